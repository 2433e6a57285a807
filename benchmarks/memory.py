"""Memory benchmark: peak resident memory per worker under each training configuration.

Peak RSS (``resource.getrusage(RUSAGE_SELF).ru_maxrss``) only grows, so every
(model, workers, configuration) runs in fresh worker processes: one launch
each. A worker builds the model under MultiWorkerMirroredStrategy, trains a
few steps of synthetic data and reports its peak RSS before and after
`fit`, plus what `ParallelOptimizer.state_bytes()` says it holds.

Configurations are a registry, ``CONFIGS``: name -> function
``(strategy, model_spec) -> (model, callbacks)`` run in the worker, which
builds and compiles the model and returns the callbacks for `fit`. Another
configuration (e.g. a fully sharded one) is one more entry.

Driver side: `run` (called by `benchmarks.run`) launches the jobs one at a
time and `summarize` merges the ranks (a configuration's figure is its
largest rank's peak).

Worker: ``python -m benchmarks.memory --config NAME --model NAME --steps S
--per-replica-batch B --out FILE`` (through the launcher, which sets
TF_CONFIG).
"""

import argparse
import json
import os
import sys
import time
from pathlib import Path

MIB = 2**20

# name -> (input features, hidden widths, outputs). Adam, mse loss.
MODELS = {
    "tiny": (64, [128, 128], 8),
    # The model of issue 21: 2048 -> 3 x Dense(4096, relu) -> 16, 42.0M parameters.
    "mlp42m": (2048, [4096] * 3, 16),
    # 2048 -> 2 x Dense(2048, relu) -> 16, 8.4M parameters: the fsdp family's
    # quick model (a step is communication-heavy yet short on a loaded machine).
    "mlp8m": (2048, [2048] * 2, 16),
    # 2048 -> 3 x Dense(8192, relu) -> Dense(6144, relu) -> 16, 201.4M parameters.
    "mlp200m": (2048, [8192] * 3 + [6144], 16),
    # 2048 -> 13 x Dense(4096, relu) -> 16, 209.8M parameters: the same size in
    # layers of 64 MiB, so that ZeRO-3's transient (one layer's full weights
    # and gradient) is small beside the model.
    "mlp210m": (2048, [4096] * 13, 16),
}


def params_of(spec):
    features, hidden, outputs = spec
    widths = [features, *hidden, outputs]
    return sum(a * b + b for a, b in zip(widths, widths[1:]))


def build_model(strategy, model, seed=0):
    """The model `model` (a MODELS key), built and compiled with Adam under `strategy`."""
    import keras

    features, hidden, outputs = MODELS[model]
    keras.utils.set_random_seed(seed)
    with strategy.scope():
        m = keras.Sequential(
            [keras.Input((features,))]
            + [keras.layers.Dense(h, activation="relu") for h in hidden]
            + [keras.layers.Dense(outputs)]
        )
        m.compile(optimizer=keras.optimizers.Adam(1e-4), loss="mse")
    return m


def _parallel_optimizer(**kwargs):
    def build(strategy, model):
        import keras_comm

        return build_model(strategy, model), [keras_comm.callbacks.ParallelOptimizer(**kwargs)]

    return build


def _plain(strategy, model):
    return build_model(strategy, model), []


def _zero3(strategy, model, seed=0, prefetch=True):
    """Every Dense in `keras_comm.parallel.FullyShard` (ZeRO-3), built
    directly: no replica ever allocates the whole model. `prefetch`: the
    wrappers' gather one layer early (their default) or not."""
    import keras

    from keras_comm import parallel as P

    features, hidden, outputs = MODELS[model]
    keras.utils.set_random_seed(seed)
    with strategy.scope():
        m = keras.Sequential(
            [keras.Input((features,))]
            + [P.FullyShard(keras.layers.Dense(h, activation="relu"), prefetch=prefetch)
               for h in hidden]
            + [P.FullyShard(keras.layers.Dense(outputs), prefetch=prefetch)]
        )
        m.compile(optimizer=keras.optimizers.Adam(1e-4), loss="mse")
    return m, []


def _tensor_parallel(strategy, model, seed=0):
    """The MLP with its layers alternately `ColumnParallelDense` and
    `RowParallelDense` over the whole world (a last odd layer a plain Dense):
    each replica holds 1/n of every kernel and the column layers' biases."""
    import keras

    from keras_comm import parallel as P

    features, hidden, outputs = MODELS[model]
    units = [*hidden, outputs]
    layers = []
    for i, u in enumerate(units):
        activation = "relu" if i < len(hidden) else None
        if i % 2 == 0 and i < len(units) - 1:
            layers.append(P.ColumnParallelDense(u, activation=activation, seed=seed + i))
        elif i % 2 == 1:
            layers.append(P.RowParallelDense(u, activation=activation, seed=seed + i))
        else:
            layers.append(keras.layers.Dense(u, activation=activation))
    keras.utils.set_random_seed(seed)
    with strategy.scope():
        m = keras.Sequential([keras.Input((features,)), *layers])
        m.compile(optimizer=keras.optimizers.Adam(1e-4), loss="mse")
    return m, []


#: Micro-batches per pipeline step, per stage (m = 2 p: 1F1B keeps the bubble small).
PIPELINE_MICRO_BATCHES_PER_STAGE = 2


def pipeline_stages(model, n):
    """The MLP's layers (hidden widths and the output) split into `n`
    contiguous stages of as equal a layer count as possible: a list of lists
    of ``(units, activation)``."""
    _, hidden, outputs = MODELS[model]
    layers = [(h, "relu") for h in hidden] + [(outputs, None)]
    if len(layers) < n:
        raise ValueError(
            f"`model` {model!r} has {len(layers)} layers, fewer than the {n} pipeline "
            f"stages. Received: model={model!r}, n={n}"
        )
    base, extra = divmod(len(layers), n)
    out, start = [], 0
    for s in range(n):
        size = base + (1 if s < extra else 0)
        out.append(layers[start:start + size])
        start += size
    return out


def _pipeline(strategy, model, seed=0):
    """The MLP as a 1F1B `Pipeline` of one stage per worker (the model's
    last layer, so `fit` interleaves forwards and backwards)."""
    import keras

    from keras_comm import parallel as P

    features = MODELS[model][0]
    n = strategy.num_replicas_in_sync
    keras.utils.set_random_seed(seed)
    with strategy.scope():
        stages = [
            keras.Sequential([keras.layers.Dense(u, activation=a) for u, a in layers])
            for layers in pipeline_stages(model, n)
        ]
        m = keras.Sequential([
            keras.Input((features,)),
            P.Pipeline(stages, PIPELINE_MICRO_BATCHES_PER_STAGE * n, "1f1b", seed=seed),
        ])
        m.compile(optimizer=keras.optimizers.Adam(1e-4), loss="mse")
    return m, []


def bytes_per_step(config, spec, n):
    """Bytes each replica sends per step (ring algorithms, float32; see
    docs/fully_sharded.md): an all-reduce moves 2 (N-1)/N S for the gradient
    S; ZeRO-1/2 a reduce-scatter and an all-gather (the same); ZeRO-3 an
    all-gather of the weights forward, again backward, and a reduce-scatter
    of the gradient: 3 (N-1)/N S, with S padded to a multiple of N per weight."""
    features, hidden, outputs = spec
    widths = [features, *hidden, outputs]
    sizes = [s for a, b in zip(widths, widths[1:]) for s in (a * b, b)]
    if config.startswith("zero3"):
        padded = sum(-(-s // n) * n for s in sizes) * 4
        return 3 * (n - 1) / n * padded
    return 2 * (n - 1) / n * sum(sizes) * 4


# name -> (strategy, model name) -> (compiled model, callbacks for fit).
# zero2 with accumulation_steps=1 holds exactly what zero1 holds (there is no
# accumulation buffer to shard); the *_acc2 pair shows what stage 2 adds.
CONFIGS = {
    "plain": _plain,
    "zero0": _parallel_optimizer(zero_stage=0),
    "zero1": _parallel_optimizer(zero_stage=1),
    "zero2": _parallel_optimizer(zero_stage=2),
    "zero1_acc2": _parallel_optimizer(zero_stage=1, accumulation_steps=2),
    "zero2_acc2": _parallel_optimizer(zero_stage=2, accumulation_steps=2),
    "zero3": _zero3,
    "zero3_noprefetch": lambda strategy, model: _zero3(strategy, model, prefetch=False),
    "tensor_parallel": _tensor_parallel,
    "pipeline": _pipeline,
}


def _maxrss_bytes():
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux: KiB


def _current_rss_bytes():
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _anonymous_rss_bytes():
    # The heap without the libraries' file pages (which memory pressure from
    # other processes can evict); TensorFlow's allocator keeps its peak.
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("RssAnon:"):
                return int(line.split()[1]) * 1024
    return None


class _Sampler:
    """Samples this process's resident memory every `interval` seconds on a
    thread (TensorFlow's kernels release the GIL), keeping the peak of each
    phase: "build", "fit begin" (until the first batch starts), "step k"
    (batch k's train function, its callbacks included) and "fit end".

    `ru_maxrss` only says how high the process went; the phases say when,
    which is what tells a transient of the first step (slot resharding)
    from one of every step (gradients, the update).
    """

    def __init__(self, interval=0.002):
        import threading

        self.interval = interval
        self.phase = "build"
        self.peaks = {}
        # ru_maxrss when each phase ended: catches spikes between samples.
        self.high_water = {}
        # TensorFlow's allocator per phase (see `_allocator_phase_end`).
        self.allocator = {}
        before = _allocator_info()
        if before is not None:
            self.allocator["before build"] = {k: v / MIB for k, v in before.items()}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="rss sampler", daemon=True)
        self._thread.start()

    def _run(self):
        while not self._stop.is_set():
            self.sample()
            self._stop.wait(self.interval)

    def sample(self):
        rss = _current_rss_bytes()
        phase = self.phase
        if rss > self.peaks.get(phase, 0):
            self.peaks[phase] = rss

    def enter(self, phase):
        self.sample()
        self.high_water[self.phase] = _maxrss_bytes()
        self._allocator_phase_end()
        self.phase = phase
        self.sample()

    def stop(self):
        self._stop.set()
        self._thread.join()
        self.sample()
        self.high_water[self.phase] = _maxrss_bytes()
        self._allocator_phase_end()
        return {k: v / MIB for k, v in self.peaks.items()}

    def _allocator_phase_end(self):
        # TensorFlow's own count of the bytes its CPU allocator hands out
        # (the BFC pool behind oneDNN's allocator; zero when TensorFlow uses
        # the system allocator): the live tensors' peak in the phase and
        # what is live at its end. RSS above that peak is the allocator's
        # pooling and fragmentation, or memory outside TensorFlow's tensors.
        info = _allocator_info()
        if info is not None:
            self.allocator[self.phase] = {k: v / MIB for k, v in info.items()}


def _allocator_info():
    """``{"current", "peak"}`` bytes of TensorFlow's CPU allocator, then its
    peak reset (None where TensorFlow does not count)."""
    import tensorflow as tf

    try:
        info = tf.config.experimental.get_memory_info("CPU:0")
        tf.config.experimental.reset_memory_stats("CPU:0")
    except (ValueError, RuntimeError, tf.errors.OpError):
        return None
    return info


def _phase_callback(sampler):
    import keras

    class Phases(keras.callbacks.Callback):
        def on_train_begin(self, logs=None):
            sampler.enter("fit begin")

        def on_train_batch_begin(self, batch, logs=None):
            sampler.enter(f"step {batch}")

        def on_train_end(self, logs=None):
            sampler.enter("fit end")

    return Phases()


def dataset(model, per_replica_batch, n):
    """Synthetic data for `model` (a MODELS key): two global batches of
    ``per_replica_batch * n`` uniform rows, repeated forever, auto-sharded by
    DATA (every worker reads the same numbers and keeps its slice)."""
    import numpy as np
    import tensorflow as tf

    features, _, outputs = MODELS[model]
    global_batch = per_replica_batch * n
    rng = np.random.default_rng(0)
    x = rng.random((global_batch * 2, features), dtype=np.float32)
    y = rng.random((global_batch * 2, outputs), dtype=np.float32)
    ds = tf.data.Dataset.from_tensor_slices((x, y)).repeat().batch(global_batch, drop_remainder=True)
    options = tf.data.Options()
    options.experimental_distribute.auto_shard_policy = tf.data.experimental.AutoShardPolicy.DATA
    return ds.with_options(options)


def measure(config, model, steps, per_replica_batch, strategy=None):
    """Worker side: one configuration in this (fresh) process, under
    `strategy` (None: a new MultiWorkerMirroredStrategy)."""
    import tensorflow as tf

    import keras_comm  # noqa: F401  (model.fit under MWMS)

    if strategy is None:
        strategy = tf.distribute.MultiWorkerMirroredStrategy()
    rank = strategy.cluster_resolver.task_id or 0
    n = strategy.num_replicas_in_sync
    global_batch = per_replica_batch * n
    ds = dataset(model, per_replica_batch, n)
    before_build = _maxrss_bytes()
    rss_before_build = _current_rss_bytes()
    sampler = _Sampler()
    m, callbacks = CONFIGS[config](strategy, model)
    built = _maxrss_bytes()
    started = time.perf_counter()
    # The phase callback first: its batch begin runs before the others'.
    m.fit(ds, epochs=1, steps_per_epoch=steps, verbose=0,
          callbacks=[_phase_callback(sampler)] + callbacks)
    seconds = time.perf_counter() - started
    phase_peaks = sampler.stop()
    result = {
        "rank": rank,
        "workers": n,
        "config": config,
        "model": model,
        # The model's, not this replica's (ZeRO-3 holds 1/n of it).
        "params": params_of(MODELS[model]),
        "bytes_per_step": bytes_per_step(config, MODELS[model], n),
        "steps": steps,
        "global_batch": global_batch,
        "peak_rss_before_build": before_build,
        "rss_before_build": rss_before_build,
        "peak_rss_after_build": built,
        "peak_rss": _maxrss_bytes(),
        "rss_after_fit": _current_rss_bytes(),
        "rss_anon_after_fit": _anonymous_rss_bytes(),
        "fit_seconds": seconds,
        # Sampled resident memory's peak per phase, MiB (see `_Sampler`).
        "phase_peak_mib": phase_peaks,
        # ru_maxrss at the end of each phase, MiB: the high-water mark's growth.
        "phase_high_water_mib": {k: v / MIB for k, v in sampler.high_water.items()},
        # TensorFlow's allocator per phase, MiB: {"current": live at the
        # end, "peak": the live tensors' peak in the phase}.
        "phase_allocator_mib": sampler.allocator,
    }
    for cb in callbacks:
        if hasattr(cb, "state_bytes"):
            result["state_bytes"] = cb.state_bytes(breakdown=True)
    if config.startswith("zero3"):
        from keras_comm import parallel as P

        # Weights + Adam's slots this replica holds (no callback: the optimizer's own).
        result["state_bytes"] = {"weights+optimizer": max(P.replica_state_bytes(m).values())}
    return result


def run(launch, models, workers, configs, steps, per_replica_batch, raw_dir, env, stdout,
        timeout=900, say=print):
    """Driver side: one launch per (model, workers, configuration), one at a time.

    Returns ``{"rows": [...], "errors": [...]}`` (see `summarize`).
    """
    rows, errors = [], []
    for model in models:
        for n in workers:
            for config in configs:
                tag = f"memory_{model}_n{n}_{config}"
                say(f"[memory n={n}] {model} {config}")
                code = launch.run(
                    ["-m", "benchmarks.memory", "--config", config, "--model", model,
                     "--steps", str(steps), "--per-replica-batch", str(per_replica_batch),
                     "--out", str(Path(raw_dir) / tag)],
                    n, timeout=timeout, env=env, stdout=stdout, stderr=stdout,
                )
                ranks = []
                for rank in range(n):
                    path = Path(raw_dir) / f"{tag}.rank{rank}.json"
                    if path.exists():
                        ranks.append(json.loads(path.read_text()))
                if code != 0 or len(ranks) != n:
                    errors.append(f"{model}, {n} workers, {config}: job exited {code} "
                                  f"with {len(ranks)}/{n} results (see run.log)")
                    continue
                rows.append(summarize(ranks))
    return {"rows": rows, "errors": errors}


def summarize(ranks):
    """One row from every rank's result: the largest peak, and each rank's."""
    first = ranks[0]
    row = {k: first[k] for k in ("config", "model", "params", "workers", "steps", "global_batch")}
    row["peak_rss_mib"] = max(r["peak_rss"] for r in ranks) / MIB
    row["peak_rss_mib_per_rank"] = [r["peak_rss"] / MIB for r in ranks]
    row["after_build_mib"] = max(r["peak_rss_after_build"] for r in ranks) / MIB
    row["fit_seconds"] = max(r["fit_seconds"] for r in ranks)
    if "bytes_per_step" in first:
        row["bytes_per_step"] = first["bytes_per_step"]
    if all(r.get("rss_anon_after_fit") for r in ranks):
        row["anon_after_fit_mib"] = max(r["rss_anon_after_fit"] for r in ranks) / MIB
    if "state_bytes" in first:
        row["state_bytes"] = first["state_bytes"]
    if all(r.get("phase_peak_mib") for r in ranks):
        phases = {p for r in ranks for p in r["phase_peak_mib"]}
        row["phase_peak_mib"] = {
            p: max(r["phase_peak_mib"].get(p, 0.0) for r in ranks) for p in phases
        }
        # The training steps' own peak (the first step reshards the slots).
        steps = [v for p, v in row["phase_peak_mib"].items() if p.startswith("step ")]
        if steps:
            row["steps_peak_mib"] = max(steps)
            row["later_steps_peak_mib"] = max(
                [v for p, v in row["phase_peak_mib"].items()
                 if p.startswith("step ") and p != "step 0"] or steps
            )
    return row


LABELS = {
    "plain": "plain fit",
    "zero0": "ZeRO-0",
    "zero1": "ZeRO-1",
    "zero2": "ZeRO-2",
    "zero1_acc2": "ZeRO-1, accum. 2",
    "zero2_acc2": "ZeRO-2, accum. 2",
    "zero3": "ZeRO-3 (FullyShard)",
    "zero3_noprefetch": "ZeRO-3, no prefetch",
    "tensor_parallel": "tensor-parallel",
    "pipeline": "pipeline (1F1B)",
}


def _label(config):
    return LABELS.get(config, config)


def markdown_section(memory):
    """The report's memory section (a list of Markdown lines)."""
    if not memory:
        return []
    out = ["## 6. Memory: peak RSS per worker", ""]
    out.append(
        "Peak resident memory (`ru_maxrss`) of each worker process over building the model "
        "(Adam, mse) and a few `fit` steps; one fresh launch per row, the largest rank's figure. "
        "\"state MiB\" is what `ParallelOptimizer.state_bytes()` says a replica holds "
        "(slots + float32 masters while an update runs + accumulation buffers). "
        "\"RSS peak in the steps\" is the highest resident memory sampled (every 2 ms) "
        "while `fit`'s training steps ran, the largest rank's."
    )
    out.append("")
    rows = memory.get("rows", [])
    groups = sorted({(r["model"], r["params"], r["workers"]) for r in rows},
                    key=lambda g: (g[1], g[2]))
    for model, params, n in groups:
        group = [r for r in rows if (r["model"], r["workers"]) == (model, n)]
        plain = next((r["peak_rss_mib"] for r in group if r["config"] == "plain"), None)
        out.append(f"### {model} ({params / 1e6:.1f}M parameters), {n} workers")
        out.append("")
        table = []
        for r in group:
            state = r.get("state_bytes")
            table.append("| " + " | ".join([
                _label(r["config"]),
                f"{r['peak_rss_mib']:.0f}",
                " / ".join(f"{v:.0f}" for v in r["peak_rss_mib_per_rank"]),
                f"{r['peak_rss_mib'] - plain:+.0f}" if plain is not None else "–",
                f"{r['after_build_mib']:.0f}",
                f"{r['steps_peak_mib']:.0f}" if "steps_peak_mib" in r else "–",
                f"{sum(state.values()) / MIB:.0f}" if state else "–",
                f"{r['bytes_per_step'] / MIB:.0f}" if "bytes_per_step" in r else "–",
            ]) + " |")
        out.append("| configuration | peak RSS MiB | per rank | vs plain fit | after build MiB "
                   "| RSS peak in the steps MiB | state MiB / replica | sent MiB / step / replica |")
        out.append("|---|---|---|---|---|---|---|---|")
        out += table
        out.append("")
    for error in memory.get("errors", []):
        out.append(f"Failed: {error}")
        out.append("")
    return out


def plot(plt, rows):
    """Bars of peak RSS per worker, one panel per (model, workers)."""
    groups = sorted({(r["model"], r["params"], r["workers"]) for r in rows},
                    key=lambda g: (g[1], g[2]))
    fig, axes = plt.subplots(len(groups), 1, figsize=(8.0, 2.8 * len(groups) + 0.6),
                             squeeze=False)
    for ax, (model, params, n) in zip(axes[:, 0], groups):
        group = [r for r in rows if (r["model"], r["workers"]) == (model, n)]
        idx = list(range(len(group)))
        ax.bar(idx, [r["peak_rss_mib"] for r in group], color="tab:blue", label="peak RSS")
        ax.bar(idx, [r["after_build_mib"] for r in group], color="tab:gray", alpha=0.6,
               label="after building the model")
        for i, r in enumerate(group):
            ax.text(i, r["peak_rss_mib"], f"{r['peak_rss_mib']:.0f}", ha="center", va="bottom",
                    fontsize=10)
        ax.set_xticks(idx, [_label(r["config"]).replace(", ", "\n").replace(" (", "\n(")
                            for r in group], fontsize=9)
        ax.set_ylabel("MiB per worker")
        ax.set_title(f"{model} ({params / 1e6:.0f}M parameters, Adam), {n} workers")
        ax.set_ylim(0, max(r["peak_rss_mib"] for r in group) * 1.35)
    axes[0, 0].legend(loc="upper left", ncol=2)
    fig.suptitle("Peak resident memory per worker (lower is better)")
    fig.tight_layout()
    return fig


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--config", required=True, choices=sorted(CONFIGS))
    parser.add_argument("--model", required=True, choices=sorted(MODELS))
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--per-replica-batch", type=int, default=32)
    parser.add_argument("--out", required=True, help="prefix of the per-rank JSON files")
    args = parser.parse_args(argv)
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    source = os.environ.get("KERAS_COMM_BENCH_SOURCE")
    if source:  # a `git archive` snapshot (benchmarks.run --ref)
        sys.path.insert(0, source)
    result = measure(args.config, args.model, args.steps, args.per_replica_batch)
    path = Path(f"{args.out}.rank{result['rank']}.json")
    tmp = path.with_suffix(f".tmp{os.getpid()}")
    tmp.write_text(json.dumps(result))
    os.replace(tmp, path)
    print(f"[memory] rank {result['rank']}: {args.config} {args.model} peak RSS "
          f"{result['peak_rss'] / MIB:.0f} MiB", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
