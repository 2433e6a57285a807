"""Cost of the non-trainable state sync (issue 19) on a ResNet-style model.

Worker side: `measure` builds two copies of a small ResNet-style CNN (a stem
and three residual blocks, seven BatchNormalization layers, not
synchronized) with the same weights; in one, every BatchNormalization
variable is marked `keep_per_replica`, which turns the per-step sync off
(no collective). The two `fit`s alternate epoch by epoch (interleaved); the
first epoch of each, which traces, is not timed. Reports each round's time
per step on this rank, the bytes the sync all-reduces per step, and the time
of the sync alone (the same all-reduce compiled on its own, many calls): on
a noisy machine the step-time ratio is within noise, the sync alone shows
what it adds.

Driver side: `summarize` takes the slowest rank per round (a synchronous
step ends with it) and reports the median ratio synced / not synced.

Standalone: ``keras-comm-run -n 2 python -m benchmarks.nontrainable``
prints the summary (rank 0).
"""

import statistics

from benchmarks import training


def build_model(seed=0, width=32, blocks=3):
    """Stem conv + BN, `blocks` residual blocks of two conv + BN, GAP, Dense."""
    import keras

    keras.utils.set_random_seed(seed)
    inp = keras.Input((32, 32, 3))

    def conv_bn(h, filters, stride=1):
        h = keras.layers.Conv2D(filters, 3, strides=stride, padding="same", use_bias=False)(h)
        return keras.layers.BatchNormalization()(h)

    h = keras.layers.ReLU()(conv_bn(inp, width))
    for b in range(blocks):
        stride = 2 if b else 1
        skip = h
        if stride != 1:
            skip = keras.layers.AveragePooling2D(stride)(h)
        r = keras.layers.ReLU()(conv_bn(h, width, stride))
        r = conv_bn(r, width)
        h = keras.layers.ReLU()(keras.layers.Add()([skip, r]))
    h = keras.layers.GlobalAveragePooling2D()(h)
    model = keras.Model(inp, keras.layers.Dense(10)(h))
    model.compile(
        optimizer=keras.optimizers.Adam(1e-3),
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
    )
    return model


def measure(strategy, per_replica_batch, steps, rounds, log=print):
    """Seconds per step, synced and not, interleaved over `rounds` epochs."""
    from keras_comm.training import nontrainable

    n = strategy.num_replicas_in_sync
    rank = strategy.cluster_resolver.task_id or 0
    ds = training.dataset("cnn", per_replica_batch * n)
    built = {}
    for kind in ("synced", "per_replica"):
        with strategy.scope():
            model = build_model()
        if kind == "per_replica":
            for v in model.non_trainable_variables:
                nontrainable.keep_per_replica(v)
        model.fit(ds, epochs=1, steps_per_epoch=steps, verbose=0)  # trace, warm up
        built[kind] = model
    synced = nontrainable.variables_to_agree(built["synced"])
    assert not nontrainable.variables_to_agree(built["per_replica"])
    times = {kind: [] for kind in built}
    for _ in range(rounds):
        for kind, model in built.items():
            timer = training._timer()
            model.fit(ds, epochs=1, steps_per_epoch=steps, verbose=0, callbacks=[timer])
            times[kind].append((timer.ends[-1] - timer.ends[0]) / (steps - 1))
    sync_times = _time_sync_alone(strategy, built["synced"], iters=max(20, 4 * steps))
    out = {
        "sync_alone_s": sync_times,
        "step_times": times,
        "global_batch": per_replica_batch * n,
        "params": int(built["synced"].count_params()),
        "bn_layers": sum(1 for v in synced if v.path.endswith("moving_mean")),
        "sync_bytes": int(sum(v.shape.num_elements() * 4 for v in synced)),
    }
    if rank == 0:
        ratio = statistics.median(a / b for a, b in zip(times["synced"], times["per_replica"]))
        log(f"[nontrainable n={n}] synced/per-replica step time: {ratio:.3f} "
            f"({out['bn_layers']} BN layers, {out['sync_bytes']} bytes per step); "
            f"the sync alone {statistics.median(sync_times) * 1e3:.2f} ms, "
            f"step {statistics.median(times['per_replica']) * 1e3:.1f} ms")
    return out


def _time_sync_alone(strategy, model, iters):
    """Seconds per call of the sync alone (one compiled `strategy.run`)."""
    import time

    import tensorflow as tf

    from keras_comm.training import nontrainable

    fn = tf.function(lambda: strategy.run(nontrainable.sync, args=(model,)))
    fn()  # trace
    out = []
    for _ in range(iters):
        start = time.perf_counter()
        fn()
        out.append(time.perf_counter() - start)
    return out


def summarize(ranks):
    """Rank results of `measure` -> one row (the slowest rank per round)."""
    synced = training._slowest([r["step_times"]["synced"] for r in ranks])
    plain = training._slowest([r["step_times"]["per_replica"] for r in ranks])
    ratios = [a / b for a, b in zip(synced, plain)]
    first = ranks[0]
    return {
        "workers": len(ranks),
        "global_batch": first["global_batch"],
        "params": first["params"],
        "bn_layers": first["bn_layers"],
        "sync_bytes": first["sync_bytes"],
        "step_s_synced": statistics.median(synced),
        "step_s_per_replica": statistics.median(plain),
        "ratio": statistics.median(ratios),
        "ratio_min": min(ratios),
        "ratio_max": max(ratios),
        "rounds": len(ratios),
        "sync_alone_s": statistics.median(
            max(r["sync_alone_s"][i] for r in ranks) for i in range(len(first["sync_alone_s"]))
        ),
    }


def main():
    import json
    import os

    import tensorflow as tf

    strategy = tf.distribute.MultiWorkerMirroredStrategy()
    import keras_comm  # noqa: F401  (after the strategy: TF_CONFIG is read once)

    steps = int(os.environ.get("KC_BENCH_STEPS", "10"))
    rounds = int(os.environ.get("KC_BENCH_ROUNDS", "5"))
    batch = int(os.environ.get("KC_BENCH_BATCH", "32"))
    result = measure(strategy, batch, steps, rounds)
    print("RESULT " + json.dumps(result), flush=True)


if __name__ == "__main__":
    main()
