"""Training benchmarks: `model.fit` throughput, scaling, ParallelOptimizer.

Worker side:

* `measure_scaling` -- samples/s of `model.fit` for a mid-size MLP and a
  small CNN on synthetic data (nothing downloaded), weak scaling: the
  per-replica batch is fixed, the global batch grows with the workers. The
  models alternate epoch by epoch (interleaved); the first epoch of each,
  which traces, is not timed.
* `measure_parallel_optimizer` -- the MLP under the `ParallelOptimizer`
  callback: accumulation 1 vs 4 and ZeRO stage 0/1/2, plus plain `fit`,
  interleaved round by round. Reports time per sample, collectives per
  sample (counted in the compiled step functions' graphs, times the calls
  made) and optimizer-state bytes per replica (`state_bytes()`).

Driver side: `summarize_scaling` and `summarize_parallel_optimizer` merge
the ranks (the slowest rank's time: a synchronous step ends with it).
"""

import statistics
import time

MODELS = ("mlp", "cnn")


def _input_shape(name):
    return (784,) if name == "mlp" else (32, 32, 3)


def build_model(name, seed=0):
    """Mid-size MLP (1.9M parameters) or small CNN (0.3M), compiled with Adam."""
    import keras

    keras.utils.set_random_seed(seed)
    if name == "mlp":
        layers = [
            keras.Input(_input_shape(name)),
            keras.layers.Dense(1024, activation="relu"),
            keras.layers.Dense(1024, activation="relu"),
            keras.layers.Dense(10),
        ]
    elif name == "cnn":
        layers = [
            keras.Input(_input_shape(name)),
            keras.layers.Conv2D(32, 3, activation="relu"),
            keras.layers.MaxPooling2D(),
            keras.layers.Conv2D(64, 3, activation="relu"),
            keras.layers.MaxPooling2D(),
            keras.layers.Flatten(),
            keras.layers.Dense(128, activation="relu"),
            keras.layers.Dense(10),
        ]
    else:
        raise ValueError(f"unknown model {name!r}")
    model = keras.Sequential(layers)
    model.compile(
        optimizer=keras.optimizers.Adam(1e-3),
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
    )
    return model


def dataset(name, global_batch, samples=2048, seed=0):
    """Synthetic (x, y), repeated, batched globally; each worker keeps its share."""
    import numpy as np
    import tensorflow as tf

    rng = np.random.default_rng(seed)
    x = rng.random((samples, *_input_shape(name)), dtype=np.float32)
    y = rng.integers(0, 10, samples).astype(np.int32)
    ds = tf.data.Dataset.from_tensor_slices((x, y)).repeat().batch(global_batch, drop_remainder=True)
    options = tf.data.Options()
    options.experimental_distribute.auto_shard_policy = tf.data.experimental.AutoShardPolicy.DATA
    return ds.with_options(options).prefetch(2)


def _timer():
    import keras

    class BatchTimer(keras.callbacks.Callback):
        """Host time at the end of every batch (fit's step calls are synchronous)."""

        def on_train_begin(self, logs=None):
            self.begin = time.perf_counter()
            self.ends = []

        def on_train_batch_end(self, batch, logs=None):
            self.ends.append(time.perf_counter())

    return BatchTimer()


def measure_scaling(strategy, models, per_replica_batch, steps, rounds, log=print):
    """Per model: seconds of each timed epoch of `steps` steps on this rank."""
    n = strategy.num_replicas_in_sync
    rank = strategy.cluster_resolver.task_id or 0
    built = {}
    for name in models:
        with strategy.scope():
            model = build_model(name)
        ds = dataset(name, per_replica_batch[name] * n)
        model.fit(ds, epochs=1, steps_per_epoch=steps, shuffle=False, verbose=0)  # trace, warm up
        built[name] = (model, ds)
    times = {name: [] for name in models}
    for _ in range(rounds):
        for name in models:
            model, ds = built[name]
            timer = _timer()
            model.fit(ds, epochs=1, steps_per_epoch=steps, shuffle=False, verbose=0, callbacks=[timer])
            # From the end of the first step: excludes fit's own set-up.
            times[name].append((timer.ends[-1] - timer.ends[0]) / (steps - 1))
    out = {}
    for name in models:
        out[name] = {
            "step_times": times[name],
            "global_batch": per_replica_batch[name] * n,
            "params": int(built[name][0].count_params()),
        }
        if rank == 0:
            med = statistics.median(times[name])
            log(f"[scaling n={n}] {name}: {med * 1e3:.1f} ms/step, "
                f"{per_replica_batch[name] * n / med:.0f} samples/s")
    return out


def _collective_ops(function):
    """Op types of every collective in the graphs reachable from `function`."""
    from benchmarks._graphs import concrete_functions, graph_nodes

    return [
        (node.op, "parallel_optimizer" in node.name)
        for concrete in concrete_functions(function)
        for node in graph_nodes(concrete)
        if node.op.startswith("Collective") or node.op.startswith("BroadcastSend")
    ]


def _counting_callback(accumulation_steps, zero_stage):
    from keras_comm.callbacks import ParallelOptimizer

    class Counting(ParallelOptimizer):
        """ParallelOptimizer that keeps its step functions for graph inspection."""

        def on_train_begin(self, logs=None):
            super().on_train_begin(logs)
            self.captured = dict(self._functions)

    return Counting(accumulation_steps=accumulation_steps, zero_stage=zero_stage)


def measure_parallel_optimizer(strategy, configs, per_replica_batch, steps, rounds, log=print):
    """Time per micro-batch, collectives and state bytes per configuration.

    Args:
        configs: list of [accumulation_steps, zero_stage], or None for plain fit.
        steps: micro-batches per fit; a multiple of every accumulation_steps.
    """
    try:
        import keras_comm.callbacks  # noqa: F401
        from keras_comm.callbacks import ParallelOptimizer  # noqa: F401
    except ImportError as e:
        return {"skipped": f"keras_comm.callbacks.ParallelOptimizer is not importable yet ({e})"}
    n = strategy.num_replicas_in_sync
    rank = strategy.cluster_resolver.task_id or 0
    global_batch = per_replica_batch * n
    ds = dataset("mlp", global_batch)
    entries = []
    for config in configs:
        with strategy.scope():
            model = build_model("mlp")
        entries.append({"config": config, "model": model, "times": [], "info": None})
    for _ in range(rounds):
        for entry in entries:
            config = entry["config"]
            timer = _timer()
            callbacks = [timer]
            po = None
            if config is not None:
                po = _counting_callback(*config)
                callbacks.insert(0, po)
            entry["model"].fit(ds, epochs=1, steps_per_epoch=steps, shuffle=False, verbose=0, callbacks=callbacks)
            acc = config[0] if config is not None else 1
            # Measured after the first accumulation window, which traces the
            # micro and apply steps; plain fit is a window of one step, so
            # every configuration leaves out the same warm-up (as po_overhead).
            start = acc - 1
            entry["times"].append((timer.ends[-1] - timer.ends[start]) / (steps - 1 - start))
            if entry["info"] is None:
                entry["info"] = _describe(po, steps, global_batch, entry["model"])
    out = []
    for entry in entries:
        row = {
            "config": entry["config"],
            "step_times": entry["times"],
            "global_micro_batch": global_batch,
            **(entry["info"] or {}),
        }
        out.append(row)
        if rank == 0:
            med = statistics.median(entry["times"])
            log(f"[parallel_optimizer n={n}] {entry['config']}: {med * 1e3:.1f} ms/micro-batch, "
                f"collectives/sample={row.get('collectives_per_sample')}, "
                f"state_bytes={row.get('state_bytes')}")
    return out


def _optimizer_state_bytes(model):
    """Bytes of a plain Keras optimizer's variables (one replica's copy)."""
    import numpy as np

    return sum(int(np.prod(v.shape)) * np.dtype(v.dtype).itemsize for v in model.optimizer.variables)


def _describe(po, steps, global_batch, model):
    if po is None:
        # Plain fit: every replica holds the whole optimizer state (Adam's two
        # moments and its step counter), the figure ZeRO shards.
        state = _optimizer_state_bytes(model)
        return {"state_bytes": state, "state_breakdown": {"optimizer": state},
                "unsharded_state_bytes": {"optimizer": state}, "collectives_per_sample": None}
    info = {
        "state_bytes": int(po.state_bytes()),
        "state_breakdown": {k: int(v) for k, v in po.state_bytes(breakdown=True).items()},
        "unsharded_state_bytes": {k: int(v) for k, v in po.unsharded_state_bytes().items()},
        "micro_steps": po.counts["micro_steps"],
        "updates": po.counts["updates"],
    }
    try:
        per_fn = {}
        for kind in ("micro", "apply"):
            fn = po.captured.get(kind)
            ops = _collective_ops(fn) if fn is not None else []
            per_fn[kind] = {
                "all": len(ops),
                "gradient": sum(1 for _, ours in ops if ours),
                "types": sorted(op for op, _ in ops),
            }
        micro_calls = po.counts["micro_steps"] - po.counts["updates"]
        apply_calls = po.counts["updates"]
        samples = po.counts["micro_steps"] * global_batch
        for what in ("all", "gradient"):
            total = micro_calls * per_fn["micro"][what] + apply_calls * per_fn["apply"][what]
            key = "collectives_per_sample" if what == "all" else "gradient_collectives_per_sample"
            info[key] = total / samples
        info["collectives_per_function"] = per_fn
    except Exception as e:  # noqa: BLE001  (graph inspection is best effort)
        info["collectives_per_sample"] = None
        info["collectives_error"] = f"{type(e).__name__}: {e}"
    return info


def _slowest(per_rank_lists):
    length = min(len(t) for t in per_rank_lists)
    return [max(t[i] for t in per_rank_lists) for i in range(length)]


def summarize_scaling(per_n):
    """{n: [rank results]} -> rows with samples/s and scaling efficiency."""
    rows = []
    base = {}
    for n in sorted(per_n):
        ranks = per_n[n]
        for name in ranks[0]:
            times = _slowest([r[name]["step_times"] for r in ranks])
            med = statistics.median(times)
            gb = ranks[0][name]["global_batch"]
            row = {
                "model": name,
                "workers": n,
                "params": ranks[0][name]["params"],
                "global_batch": gb,
                "step_s": med,
                "samples_per_s": gb / med,
                "rounds": len(times),
                # Run-to-run spread: the slowest and fastest round.
                "step_min_s": min(times),
                "step_max_s": max(times),
            }
            if n == 1:
                base[name] = row["samples_per_s"]
            rows.append(row)
    for row in rows:
        b = base.get(row["model"])
        row["speedup"] = row["samples_per_s"] / b if b else None
        row["efficiency"] = row["samples_per_s"] / (row["workers"] * b) if b else None
    return rows


def summarize_parallel_optimizer(ranks):
    """Rank results of `measure_parallel_optimizer` -> report rows."""
    if isinstance(ranks[0], dict) and "skipped" in ranks[0]:
        return ranks[0]
    rows = []
    plain = None
    for i, entry in enumerate(ranks[0]):
        times = _slowest([r[i]["step_times"] for r in ranks])
        med = statistics.median(times)
        row = {k: v for k, v in entry.items() if k != "step_times"}
        row["micro_batch_s"] = med
        row["time_per_sample_us"] = med / entry["global_micro_batch"] * 1e6
        row["rounds"] = len(times)
        row["micro_batch_min_s"], row["micro_batch_max_s"] = min(times), max(times)
        if entry["config"] is None:
            plain = med
        rows.append(row)
    for row in rows:
        row["vs_plain_fit"] = row["micro_batch_s"] / plain if plain else None
    return {"rows": rows}
