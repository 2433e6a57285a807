"""Pipeline parallelism: step time vs micro-batches and stages, bubble, activation memory.

Standalone: ``python -m benchmarks.pipeline --workers 2 4 --out results/pipeline``;
`benchmarks.run` runs it too (``--no-pipeline`` skips it).

One job per stage count p (p worker processes, one stage each). In a job,
every configuration (m in MICRO_BATCHES x schedule) is built and traced
first, then timed in rounds, configurations interleaved (rotated each
round); the step time of a configuration is the median over rounds of the
mean over `steps` calls of the compiled train function. A model: Input ->
Pipeline of p stages, each 2 x Dense(width, tanh) (equal stages), trained
with SGD on a global batch of ``batch`` samples (the pipeline being the
model's last layer, 1F1B runs interleaved).

Measured bubble: each worker also times its own stage's forward+backward on
one micro-batch alone (compiled, no communication), t_mb; the busy share of
a step is ``m * t_mb / step time`` and the measured bubble is one minus it
(communication counts as bubble). Compared with the textbook
(p - 1) / (m + p - 1).

Activation memory (tensor accounting): a micro-batch keeps, per stage, its
input and the 2 layers' outputs (3 x mb x width floats) until its backward;
the schedule's `max_in_flight` per stage gives the peak, so at m = 8 GPipe
keeps 8 micro-batches alive on every stage and 1F1B p - s on stage s. The
peak RSS of each worker is recorded too (it includes TensorFlow itself).
"""

import argparse
import json
import os
import resource
import statistics
import sys
import time
from pathlib import Path

MICRO_BATCHES = (1, 2, 4, 8)
# Set by the worker functions: a collective every worker calls after writing
# its result. Without it a worker that finished first exits, the chief's
# coordination service sees it stop heartbeating and aborts the chief
# before it writes (the missing-rank result seen before).
_BARRIER = []


def _set_barrier(strategy):
    import tensorflow as tf

    _BARRIER[:] = [lambda: strategy.reduce(
        tf.distribute.ReduceOp.SUM, strategy.run(lambda: tf.constant(1.0)), axis=None)]
SCHEDULES = ("gpipe", "1f1b")


def measure(width=256, batch=256, steps=5, rounds=3, micro_batches=MICRO_BATCHES):
    """Worker side (inside a p-worker MWMS job): the timings of one job."""
    import numpy as np
    import tensorflow as tf

    strategy = tf.distribute.MultiWorkerMirroredStrategy()
    import keras

    import keras_comm  # noqa: F401
    from keras_comm.parallel import Pipeline
    from keras_comm.parallel import schedules

    _set_barrier(strategy)
    p = strategy.num_replicas_in_sync
    rank = strategy.cluster_resolver.task_id or 0
    rng = np.random.default_rng(0)
    x = rng.normal(size=(batch * (steps + 1), width)).astype("float32")
    y = rng.normal(size=(batch * (steps + 1), width)).astype("float32")
    ds = tf.data.Dataset.from_tensor_slices((x, y)).batch(batch).repeat()
    options = tf.data.Options()
    options.experimental_distribute.auto_shard_policy = tf.data.experimental.AutoShardPolicy.DATA
    ds = ds.with_options(options)

    def stage():
        return keras.Sequential([keras.layers.Dense(width, activation="tanh") for _ in range(2)])

    configs = {}
    for m in micro_batches:
        for schedule in SCHEDULES:
            with strategy.scope():
                model = keras.Sequential([keras.Input((width,)), Pipeline([stage() for _ in range(p)], m, schedule)])
                model.compile(optimizer=keras.optimizers.SGD(0.01), loss="mse")
            model.make_train_function()
            it = iter(strategy.experimental_distribute_dataset(ds))
            model.train_function(it)  # trace
            configs[(m, schedule)] = (model, it)

    # One stage alone on one micro-batch: the compute a pipeline step needs m of.
    alone = {}
    for m in micro_batches:
        layer = stage()
        xm = tf.constant(x[: batch // m])

        @tf.function
        def fwd_bwd(xm=xm, layer=layer):
            with tf.GradientTape() as tape:
                out = tf.reduce_sum(layer(xm))
            return tape.gradient(out, layer.trainable_variables)

        fwd_bwd()
        times = []
        for _ in range(rounds):
            t0 = time.perf_counter()
            for _ in range(steps):
                fwd_bwd()
            times.append((time.perf_counter() - t0) / steps)
        alone[m] = statistics.median(times)

    keys = list(configs)
    samples = {k: [] for k in keys}
    for r in range(rounds):
        order = keys[r % len(keys):] + keys[: r % len(keys)]
        for k in order:
            model, it = configs[k]
            t0 = time.perf_counter()
            for _ in range(steps):
                model.train_function(it)
            samples[k].append((time.perf_counter() - t0) / steps)

    out = {"rank": rank, "stages": p, "width": width, "batch": batch, "configs": []}
    for (m, schedule), times in samples.items():
        step = statistics.median(times)
        table = schedules.train_schedule(schedule, p, m)
        in_flight = [schedules.max_in_flight(ops) for ops in table]
        mb_bytes = 3 * (batch // m) * width * 4
        out["configs"].append({
            "micro_batches": m,
            "schedule": schedule,
            "step_seconds": step,
            "samples": times,
            "stage_alone_seconds": alone[m],
            "measured_bubble": max(0.0, 1.0 - m * alone[m] / step),
            "ideal_bubble": schedules.ideal_bubble(p, m),
            "simulated_bubble": schedules.simulate(table)["bubble"],
            "activation_bytes_in_flight": in_flight[rank] * mb_bytes,
            "micro_batches_in_flight": in_flight[rank],
        })
    out["peak_rss_mb"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    return out


def measure_memory(schedule, width=1024, batch=8192, micro_batches=8, layers=4, steps=2):
    """Worker side: peak RSS growth of training steps with one schedule.

    Run in its own process per schedule (peak RSS only grows): the RSS
    high-water mark after building and tracing, then after `steps` steps.
    """
    import numpy as np
    import tensorflow as tf

    strategy = tf.distribute.MultiWorkerMirroredStrategy()
    import keras

    import keras_comm  # noqa: F401
    from keras_comm.parallel import Pipeline
    from keras_comm.parallel import schedules

    _set_barrier(strategy)
    p = strategy.num_replicas_in_sync
    rank = strategy.cluster_resolver.task_id or 0
    x = np.random.default_rng(0).normal(size=(batch, width)).astype("float32")
    ds = tf.data.Dataset.from_tensors((x, x)).repeat()
    options = tf.data.Options()
    options.experimental_distribute.auto_shard_policy = tf.data.experimental.AutoShardPolicy.DATA
    ds = ds.with_options(options)

    def stage():
        return keras.Sequential([keras.layers.Dense(width, activation="tanh") for _ in range(layers)])

    with strategy.scope():
        model = keras.Sequential([keras.Input((width,)), Pipeline([stage() for _ in range(p)], micro_batches, schedule)])
        model.compile(optimizer=keras.optimizers.SGD(0.0), loss="mse")
    model.make_train_function()
    # A per-replica batch of batch / p; the pipeline gathers the group's `batch`.
    it = iter(strategy.experimental_distribute_dataset(ds.unbatch().batch(batch)))
    model.train_function(it)
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    for _ in range(steps):
        model.train_function(it)
    after = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    in_flight = schedules.max_in_flight(schedules.train_schedule(schedule, p, micro_batches)[rank])
    mb = batch // micro_batches
    return {
        "rank": rank, "schedule": schedule, "stages": p, "micro_batches": micro_batches,
        "peak_rss_mb_after_trace": before, "peak_rss_mb_after_steps": after,
        "micro_batches_in_flight": in_flight,
        # Per micro-batch the stage keeps its input and each layer's output.
        "accounted_activation_mb": in_flight * (layers + 1) * mb * width * 4 / 2**20,
    }


def summarize(per_rank):
    """Driver side: per configuration, the slowest rank's step and the mean bubble."""
    p = per_rank[0]["stages"]
    rows = []
    for i, c in enumerate(per_rank[0]["configs"]):
        across = [r["configs"][i] for r in per_rank]
        rows.append({
            "stages": p,
            "micro_batches": c["micro_batches"],
            "schedule": c["schedule"],
            "step_seconds": max(a["step_seconds"] for a in across),
            "measured_bubble": statistics.mean(a["measured_bubble"] for a in across),
            "ideal_bubble": c["ideal_bubble"],
            "activation_bytes_in_flight_stage0": across[0]["activation_bytes_in_flight"],
            "activation_bytes_in_flight_max": max(a["activation_bytes_in_flight"] for a in across),
        })
    return {"stages": p, "rows": rows, "peak_rss_mb": [r["peak_rss_mb"] for r in per_rank]}


def plot(summaries, path):
    """Step time vs micro-batches, one line per (stages, schedule)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax, bx) = plt.subplots(1, 2, figsize=(10, 4))
    for s in summaries:
        for schedule in SCHEDULES:
            rows = [r for r in s["rows"] if r["schedule"] == schedule]
            ms = [r["micro_batches"] for r in rows]
            ax.plot(ms, [r["step_seconds"] * 1e3 for r in rows], marker="o", label=f"p={s['stages']} {schedule}")
            bx.plot(ms, [r["measured_bubble"] for r in rows], marker="o", label=f"p={s['stages']} {schedule} measured")
        rows = [r for r in s["rows"] if r["schedule"] == SCHEDULES[0]]
        bx.plot([r["micro_batches"] for r in rows], [r["ideal_bubble"] for r in rows], "k--", alpha=0.5,
                label=f"p={s['stages']} (p-1)/(m+p-1)")
    for a, title, ylabel in ((ax, "step time", "ms per step"), (bx, "bubble fraction", "idle share")):
        a.set_xscale("log", base=2)
        a.set_xlabel("micro-batches m")
        a.set_ylabel(ylabel)
        a.set_title(title)
        a.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return str(path)


def run_all(workers, out_dir, env=None, timeout=1800, stdout=None, **params):
    """Driver: one job per stage count; returns the summaries and the plot path."""
    import importlib

    launch = importlib.import_module("keras_comm_run")
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    summaries, errors = [], []
    for p in workers:
        tag = out_dir / f"pipeline_p{p}"
        code = launch.run(
            ["-m", "benchmarks.pipeline", "--worker", str(tag), "--params", json.dumps(params)],
            p, timeout=timeout, env=env, stdout=stdout, stderr=stdout,
        )
        ranks = [tag.with_suffix(f".rank{r}.json") for r in range(p)]
        if code != 0 or not all(f.exists() for f in ranks):
            errors.append(f"p={p}: job exited {code}")
            continue
        summaries.append(summarize([json.loads(f.read_text()) for f in ranks]))
    result = {"summaries": summaries, "errors": errors}
    if summaries:
        try:
            result["plot"] = plot(summaries, out_dir / "pipeline.png")
        except ImportError as e:
            result["plot_error"] = str(e)
    (out_dir / "pipeline.json").write_text(json.dumps(result, indent=1))
    return result


def main(argv=None):
    parser = argparse.ArgumentParser(prog="python -m benchmarks.pipeline", description=__doc__.split("\n\n")[0])
    parser.add_argument("--workers", type=int, nargs="+", default=[2, 4], help="stage counts (one job each)")
    parser.add_argument("--out", default="results/pipeline")
    parser.add_argument("--width", type=int, default=256)
    parser.add_argument("--batch", type=int, default=256)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--params", default="{}", help=argparse.SUPPRESS)
    parser.add_argument("--memory", action="store_true",
                        help="instead: peak RSS of GPipe vs 1F1B at m=8 (one job per schedule)")
    parser.add_argument("--memory-batch", type=int, default=8192,
                        help="global batch of --memory (activations per micro-batch grow with it)")
    args = parser.parse_args(argv)
    if args.memory and not args.worker:
        return memory_main(args)
    if args.worker:
        os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
        params = json.loads(args.params)
        result = measure_memory(**params["memory"]) if "memory" in params else measure(**params)
        Path(f"{args.worker}.rank{result['rank']}.json").write_text(json.dumps(result))
        for barrier in _BARRIER:
            barrier()
        return 0
    params = dict(width=args.width, batch=args.batch, steps=args.steps, rounds=args.rounds)
    result = run_all(args.workers, args.out, env={"PYTHONPATH": str(Path(__file__).resolve().parents[1])}, **params)
    for s in result["summaries"]:
        for r in s["rows"]:
            print(f"p={r['stages']} m={r['micro_batches']} {r['schedule']:5s} step {r['step_seconds'] * 1e3:8.1f} ms"
                  f"  bubble {r['measured_bubble']:.2f} (ideal {r['ideal_bubble']:.2f})"
                  f"  activations in flight (stage 0) {r['activation_bytes_in_flight_stage0'] / 2**20:.1f} MiB")
    print(json.dumps({k: v for k, v in result.items() if k != "summaries"}))
    return 1 if result["errors"] else 0


def memory_main(args):
    import importlib

    launch = importlib.import_module("keras_comm_run")
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    env = {"PYTHONPATH": str(Path(__file__).resolve().parents[1])}
    p = args.workers[0]
    rows = []
    for schedule in ("gpipe", "1f1b", "gpipe", "1f1b"):  # twice each, alternating
        tag = out_dir / f"memory_{schedule}_{len(rows)}"
        params = {"memory": {"schedule": schedule, "batch": args.memory_batch}}
        code = launch.run(["-m", "benchmarks.pipeline", "--worker", str(tag), "--params", json.dumps(params)],
                          p, timeout=1800, env=env)
        for r in range(p):
            f = tag.with_suffix(f".rank{r}.json")
            if code == 0 and f.exists():
                rows.append(json.loads(f.read_text()))
    for r in rows:
        print(f"{r['schedule']:5s} rank {r['rank']}: peak RSS {r['peak_rss_mb_after_steps']:.0f} MB "
              f"(after tracing {r['peak_rss_mb_after_trace']:.0f} MB); in flight {r['micro_batches_in_flight']}, "
              f"accounted activations {r['accounted_activation_mb']:.0f} MB")
    (out_dir / "memory.json").write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
