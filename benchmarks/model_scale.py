"""Model scale: step time and peak memory against parameter count, per training mode.

MLPs of about 10M, 25M, 50M, 100M and 200M parameters (2048 -> 4 x
Dense(w, relu) -> 16, Adam, mse, 32 samples per replica) trained by plain
`fit`, by `ParallelOptimizer(zero_stage=1)` and fully sharded (every Dense
in `FullyShard`, ZeRO-3) -- `benchmarks.memory`'s configurations -- each in
fresh worker processes: peak RSS only grows, so one launch per (model,
mode).

Each worker records its resident memory before the model is built (the
process's baseline: TensorFlow, the strategy, the data), its peak
(`ru_maxrss`) after `fit`, and each step's wall time. A step's time is the
slowest rank's (a synchronous step ends with it); the figure is the median
over the steps after the first two (the first traces, ZeRO-1's first also
cuts the optimizer's slots), with their range.

Run (2 workers; jobs can be split over several calls, results accumulate in
DIR, one JSON file per rank and job):

    python -m benchmarks.model_scale --workers 2 --out-dir DIR \\
        --models scale10m scale25m --configs plain zero1 zero3
    python -m benchmarks.model_scale --summarize DIR --results docs/results/model_scale.json \\
        --plot docs/performance/model_scale/model_scale.png

Worker: ``python -m benchmarks.model_scale --worker --config C --model M
--steps S --out PREFIX`` under the launcher.
"""

import argparse
import datetime
import json
import os
import statistics
import sys
import time
from pathlib import Path

from benchmarks import memory

MIB = 2**20

# name -> (input features, hidden widths, outputs), as `benchmarks.memory.MODELS`.
SCALE_MODELS = {
    "scale10m": (2048, [1536] * 4, 16),
    "scale25m": (2048, [2560] * 4, 16),
    "scale50m": (2048, [3840] * 4, 16),
    "scale100m": (2048, [5376] * 4, 16),
    "scale200m": (2048, [7680] * 4, 16),
}
CONFIGS = ("plain", "zero1", "zero3")
LABELS = {"plain": "plain `fit`", "zero1": "ZeRO-1", "zero3": "ZeRO-3 (`FullyShard`)"}
PER_REPLICA_BATCH = 32
STEPS = 7
SKIP = 2  # steps left out of the time: tracing, ZeRO-1's slot cut


def _register():
    # The configurations of benchmarks.memory look their model up by name.
    memory.MODELS.update(SCALE_MODELS)


def measure(config, model, steps, per_replica_batch):
    """Worker side: one mode and model in this fresh process."""
    import tensorflow as tf
    import keras

    import keras_comm  # noqa: F401  (model.fit under MWMS)

    _register()
    strategy = tf.distribute.MultiWorkerMirroredStrategy()
    rank = strategy.cluster_resolver.task_id or 0
    n = strategy.num_replicas_in_sync
    ds = memory.dataset(model, per_replica_batch, n)
    baseline = memory._current_rss_bytes()  # pylint: disable=protected-access
    m, callbacks = memory.CONFIGS[config](strategy, model)

    class StepEnds(keras.callbacks.Callback):
        def on_train_begin(self, logs=None):
            self.ends = [time.perf_counter()]

        def on_train_batch_end(self, batch, logs=None):
            self.ends.append(time.perf_counter())

    timer = StepEnds()
    m.fit(ds, epochs=1, steps_per_epoch=steps, verbose=0, callbacks=callbacks + [timer])
    return {
        "rank": rank,
        "workers": n,
        "config": config,
        "model": model,
        "params": memory.params_of(SCALE_MODELS[model]),
        "global_batch": per_replica_batch * n,
        "baseline_rss": baseline,
        "peak_rss": memory._maxrss_bytes(),  # pylint: disable=protected-access
        "step_s": [b - a for a, b in zip(timer.ends, timer.ends[1:])],
    }


def run(launch, workers, models, configs, steps, out_dir, env, say=print, timeout=480):
    """Driver side: one launch per (model, mode), in order; returns the failures."""
    failures = []
    for model in models:
        for config in configs:
            tag = f"scale_{model}_{config}_n{workers}"
            started = time.perf_counter()
            code = launch.run(
                ["-m", "benchmarks.model_scale", "--worker", "--config", config,
                 "--model", model, "--steps", str(steps), "--out", str(Path(out_dir) / tag)],
                workers, timeout=timeout, env=env,
            )
            took = time.perf_counter() - started
            if code != 0:
                failures.append(f"{model} {config}: exit {code}")
            say(f"[model_scale n={workers}] {model} {config}: exit {code}, {took:.0f} s")
    return failures


def summarize(out_dir):
    """Rows from every complete job in `out_dir`: one per (model, mode).

    A row: parameters, the step time (median and range over the timed
    steps, slowest rank per step), the largest rank's peak RSS and its
    baseline.
    """
    jobs = {}
    for path in sorted(Path(out_dir).glob("scale_*.rank*.json")):
        result = json.loads(path.read_text())
        key = (result["model"], result["config"], result["workers"])
        jobs.setdefault(key, []).append(result)
    rows = []
    for (model, config, n), ranks in jobs.items():
        if len(ranks) != n:
            continue
        length = min(len(r["step_s"]) for r in ranks)
        slowest = [max(r["step_s"][i] for r in ranks) for i in range(length)]
        timed = slowest[SKIP:] or slowest
        peak = max(ranks, key=lambda r: r["peak_rss"])
        rows.append({
            "model": model,
            "config": config,
            "workers": n,
            "params": ranks[0]["params"],
            "step_ms": statistics.median(timed) * 1e3,
            "step_ms_range": [min(timed) * 1e3, max(timed) * 1e3],
            "steps_timed": len(timed),
            "peak_rss_mib": peak["peak_rss"] / MIB,
            "peak_rss_mib_per_rank": [r["peak_rss"] / MIB for r in sorted(ranks, key=lambda r: r["rank"])],
            "baseline_mib": peak["baseline_rss"] / MIB,
        })
    rows.sort(key=lambda r: (r["params"], CONFIGS.index(r["config"]) if r["config"] in CONFIGS else 9))
    return rows


def results_file(rows, command, machine):
    """The docs/results/ form of `rows`: one table row per model size."""
    configs = [c for c in CONFIGS if any(r["config"] == c for r in rows)]
    columns = ["parameters"]
    columns += [f"{LABELS[c]}: ms/step" for c in configs]
    columns += [f"{LABELS[c]}: peak MiB (above baseline)" for c in configs]
    table = []
    for params in sorted({r["params"] for r in rows}):
        by = {r["config"]: r for r in rows if r["params"] == params}
        cells = [f"{params / 1e6:.1f}M"]
        for c in configs:
            r = by.get(c)
            cells.append(
                f"{r['step_ms']:.0f} [{r['step_ms_range'][0]:.0f}–{r['step_ms_range'][1]:.0f}]"
                if r else "–"
            )
        for c in configs:
            r = by.get(c)
            cells.append(
                f"{r['peak_rss_mib']:.0f} ({r['peak_rss_mib'] - r['baseline_mib']:.0f})" if r else "–"
            )
        table.append(cells)
    workers = sorted({r["workers"] for r in rows})
    return {
        "title": "Step time and peak memory per worker against model size",
        "date": datetime.date.today().isoformat(),
        "machine": machine,
        "command": command,
        "columns": columns,
        "rows": table,
        "note": (
            f"2048 → 4 × Dense(w, relu) → 16 MLPs, Adam, {PER_REPLICA_BATCH} samples per replica, "
            f"{'/'.join(str(w) for w in workers)} workers; one fresh launch per mode and size. "
            f"ms/step: median of steps {SKIP + 1}–{STEPS} (slowest rank per step) [range]. "
            "Peak: the largest rank's `ru_maxrss`; in brackets, above its resident memory "
            "before the model was built."
        ),
        "data": rows,
    }


def plot(rows, path):
    """Step time and peak RSS against parameters, one line per mode, one figure."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from benchmarks import report

    with matplotlib.rc_context(report.PLOT_STYLE):
        fig, (a1, a2) = plt.subplots(1, 2, figsize=(report.PLOT_WIDTH_IN * 1.25, 4.2))
        for config in CONFIGS:
            mine = [r for r in rows if r["config"] == config]
            if not mine:
                continue
            x = [r["params"] / 1e6 for r in mine]
            label = LABELS[config].replace("`", "")
            y = [r["step_ms"] for r in mine]
            err = [[r["step_ms"] - r["step_ms_range"][0] for r in mine],
                   [r["step_ms_range"][1] - r["step_ms"] for r in mine]]
            a1.errorbar(x, y, yerr=err, marker="o", capsize=3, label=label)
            a2.plot(x, [r["peak_rss_mib"] for r in mine], marker="o", label=label)
        for ax in (a1, a2):
            ax.set_xscale("log")
            ax.set_yscale("log")
            ax.set_xlabel("parameters (millions)")
            ax.grid(True, which="both", alpha=0.3)
            ax.legend()
        a1.set_ylabel("ms per step (lower is better)")
        a1.set_title("step time (bars: range over steps)")
        a2.set_ylabel("peak RSS per worker, MiB")
        a2.set_title("peak resident memory")
        n = sorted({r["workers"] for r in rows})
        sizes = [r["params"] / 1e6 for r in rows]
        fig.suptitle(f"MLPs of {min(sizes):.0f}M–{max(sizes):.0f}M parameters, Adam, "
                     f"{'/'.join(map(str, n))} workers")
        fig.tight_layout()
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        fig.savefig(path, dpi=report.PLOT_DPI)
        plt.close(fig)


def machine():
    """This machine, as docs/results/ files describe it."""
    from benchmarks import run as bench_run

    info = bench_run.machine_info()
    versions = info.get("versions", {})
    return (
        f"a {info.get('cpu_count')}-core CPU machine ({info.get('cpu_model', 'unknown CPU')}, "
        f"{info.get('memory_gb')} GB; TensorFlow {versions.get('tensorflow')}, "
        f"Keras {versions.get('keras')})"
    )


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--worker", action="store_true", help="run one job's worker (under the launcher)")
    parser.add_argument("--config", choices=CONFIGS)
    parser.add_argument("--model", choices=sorted(SCALE_MODELS))
    parser.add_argument("--steps", type=int, default=STEPS)
    parser.add_argument("--per-replica-batch", type=int, default=PER_REPLICA_BATCH)
    parser.add_argument("--out", help="worker: prefix of the per-rank JSON files")
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--models", nargs="+", default=list(SCALE_MODELS), choices=sorted(SCALE_MODELS))
    parser.add_argument("--configs", nargs="+", default=list(CONFIGS), choices=CONFIGS)
    parser.add_argument("--out-dir", help="driver: where the jobs' results accumulate")
    parser.add_argument("--summarize", metavar="DIR", help="summarize the jobs in DIR")
    parser.add_argument("--results", help="with --summarize: write this docs/results JSON")
    parser.add_argument("--plot", help="with --summarize: write this PNG")
    args = parser.parse_args(argv)
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    if args.worker:
        result = measure(args.config, args.model, args.steps, args.per_replica_batch)
        Path(f"{args.out}.rank{result['rank']}.json").write_text(json.dumps(result))
        return 0
    if args.summarize:
        rows = summarize(args.summarize)
        for r in rows:
            print(f"{r['model']:10s} {r['params'] / 1e6:6.1f}M {r['config']:6s} "
                  f"{r['step_ms']:8.0f} ms/step [{r['step_ms_range'][0]:.0f}-{r['step_ms_range'][1]:.0f}]  "
                  f"peak {r['peak_rss_mib']:6.0f} MiB (baseline {r['baseline_mib']:.0f}) "
                  f"per rank {', '.join(f'{v:.0f}' for v in r['peak_rss_mib_per_rank'])}")
        command = ("python -m benchmarks.model_scale --workers 2 --out-dir DIR; "
                   "python -m benchmarks.model_scale --summarize DIR --results "
                   "docs/results/model_scale.json --plot docs/performance/model_scale/model_scale.png")
        if args.results:
            Path(args.results).write_text(
                json.dumps(results_file(rows, command, machine()), indent=1) + "\n")
        if args.plot:
            plot(rows, args.plot)
        return 0
    import keras_comm_run as launch

    Path(args.out_dir).mkdir(parents=True, exist_ok=True)
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [os.getcwd(), env.get("PYTHONPATH")]))
    failures = run(launch, args.workers, args.models, args.configs, args.steps, args.out_dir, env)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
