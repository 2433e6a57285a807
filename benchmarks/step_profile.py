"""Step profile: one training step of `fit`, Keras 3 + keras_comm next to tf-keras.

The peers' model and data (`benchmarks.peers.build`: 784-1024-1024-10 MLP,
Adam, global batch 256) under each framework's own
MultiWorkerMirroredStrategy. On every worker, after one epoch that traces:

1. **time**: `epochs` epochs of `fit`, each step's wall time (from one
   `on_train_batch_end` to the next; each epoch's first step is left out,
   it carries the iterator's creation);
2. **host**: one epoch under `cProfile`, per step: the compiled functions
   the host calls, the eager ops it dispatches from Python, the tensor
   values it reads back (each a sync: the host waits for the value), and
   the Python time outside TensorFlow's C calls (inflated by the profiler:
   compare it between frameworks, not with the wall time);
3. **graph**: the ops of every compiled function a step calls (its graph
   with the functions in its library: `strategy.run`'s body, the branches),
   and its collectives by op type;
4. **ops**: one epoch under TensorFlow's profiler: per step, the ops that
   ran and their self time (summed over threads), by op type, collectives
   apart.

Worker: ``python -m benchmarks.step_profile --framework keras_comm|tf_keras
--out-dir D --tag T`` under the launcher; driver: `run` (interleaved rounds)
and `summarize`:

    python -m benchmarks.step_profile --rounds 3 --workers 1 2 --out-dir /tmp/prof

With ``--ref-source DIR`` (a `git archive` of another commit) each round also
profiles that keras_comm, for a before/after next to tf-keras.
"""

import argparse
import datetime
import cProfile
import json
import os
import pstats
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

from benchmarks import peers

# Builtins of TensorFlow's C API, as cProfile names them.
_FAST_PATH = "TFE_Py_FastPathExecute"  # an eager op from a generated wrapper
_EXECUTE = "TFE_Py_Execute"  # an eager op or a compiled function, the slow path
# Builtins where the host thread waits (for another thread, or sleeps).
_WAITS = ("acquire", "wait", "sleep", "join")


def _step_timer(k):
    class StepTimer(k.callbacks.Callback):
        def on_train_begin(self, logs=None):
            self.steps = []
            self.first_steps = []

        def on_epoch_begin(self, epoch, logs=None):
            self._last = time.perf_counter()
            self._first = True

        def on_train_batch_end(self, batch, logs=None):
            now = time.perf_counter()
            (self.first_steps if self._first else self.steps).append(now - self._last)
            self._first = False
            self._last = now

    return StepTimer()


class _CallRecorder:
    """Counts the compiled functions executed eagerly (`AtomicFunction.call_flat`)."""

    def __init__(self):
        from tensorflow.python.eager.polymorphic_function import atomic_function

        self._cls = atomic_function.AtomicFunction
        self._original = self._cls.call_flat
        self.calls = {}  # name -> [function, count]
        self.reads = 0

    def __enter__(self):
        from tensorflow.python.framework import ops

        recorder = self
        original = self._original

        def call_flat(fn, *args):
            if fn._bound_context.executing_eagerly():  # pylint: disable=protected-access
                name = fn.name.decode() if isinstance(fn.name, bytes) else fn.name
                entry = recorder.calls.setdefault(name, [fn, 0])
                entry[1] += 1
            return original(fn, *args)

        self._cls.call_flat = call_flat
        self._tensor = ops._EagerTensorBase  # pylint: disable=protected-access
        self._numpy = self._tensor._numpy

        def numpy(t):
            recorder.reads += 1
            return recorder._numpy(t)

        self._tensor._numpy = numpy
        return self

    def __exit__(self, *exc):
        self._cls.call_flat = self._original
        self._tensor._numpy = self._numpy


def _graph_ops(fn):
    """Op counts of one compiled function: its graph and its library's."""
    graph_def = fn.graph.as_graph_def()
    nodes = list(graph_def.node)
    for f in graph_def.library.function:
        nodes.extend(f.node_def)
    types = [n.op for n in nodes]
    collectives = {}
    for t in types:
        if t.startswith("Collective"):
            collectives[t] = collectives.get(t, 0) + 1
    return {"ops": len(types), "collectives": collectives}


def _op_stats(logdir, steps):
    """Per step, from a TensorFlow profiler trace: ops run, their self time, by type.

    The profiler's "framework_op_stats" tool: each op type's occurrences and
    self time on the host (this machine's devices are CPUs).
    """
    import glob

    from tensorflow.python.profiler.internal import _pywrap_profiler_plugin as plugin

    paths = sorted(glob.glob(f"{logdir}/**/*.xplane.pb", recursive=True))
    data, ok = plugin.xspace_to_tools_data(paths[-1:], "framework_op_stats")
    if not ok:
        return None
    table = json.loads(data)[0]
    columns = [c["id"] for c in table["cols"]]
    by_type = {}
    for row in table["rows"]:
        r = dict(zip(columns, (c.get("v") for c in row["c"])))
        if r["type"] == "IDLE":
            continue
        entry = by_type.setdefault(r["type"] or r["operation"], [0.0, 0.0])
        entry[0] += r["occurrences"]
        entry[1] += r["total_self_time"]  # microseconds
    total_us = sum(t for _, t in by_type.values())
    collective_us = sum(t for k, (_, t) in by_type.items() if k.startswith("Collective"))
    top = sorted(by_type.items(), key=lambda kv: -kv[1][1])[:12]
    return {
        "ops_per_step": sum(n for n, _ in by_type.values()) / steps,
        "op_ms_per_step": total_us / 1e3 / steps,
        "collective_ms_per_step": collective_us / 1e3 / steps,
        "top_ms_per_step": {k: t / 1e3 / steps for k, (_, t) in top},
        "collectives_run_per_step": {
            k: n / steps for k, (n, _) in by_type.items() if k.startswith("Collective")
        },
    }


def _host_profile(stats, steps):
    """Per-step counts and Python time from a `pstats.Stats` of one epoch."""
    calls = {_FAST_PATH: 0, _EXECUTE: 0}
    c_time = 0.0
    for (filename, _, name), (cc, nc, tt, ct, _) in stats.stats.items():
        if filename != "~":
            continue
        for key in calls:
            if key in name:
                calls[key] += nc
        # Time inside TensorFlow's C API (op kernels run synchronously
        # inside these calls, graph functions too).
        if "_pywrap_tfe" in name or "pywrap_tfe" in name or "_pywrap_" in name:
            c_time += tt
    waiting = sum(
        tt for (filename, _, name), (_, _, tt, _, _) in stats.stats.items()
        if filename == "~" and any(w in name for w in _WAITS)
    )
    top = sorted(
        ((f"{Path(f).name}:{line}({name})", tt) for (f, line, name), (_, _, tt, _, _)
         in stats.stats.items()),
        key=lambda kv: -kv[1],
    )[:10]
    return {
        "waiting_ms_per_step": waiting * 1e3 / steps,
        "top_tottime_ms_per_step": {k: v * 1e3 / steps for k, v in top},
        "eager_ops_per_step": (calls[_FAST_PATH] + calls[_EXECUTE]) / steps,
        "tf_c_api_ms_per_step": c_time * 1e3 / steps,
        "profiled_total_ms_per_step": stats.total_tt * 1e3 / steps,
        "python_ms_per_step": (stats.total_tt - c_time - waiting) * 1e3 / steps,
    }


def measure(framework, epochs, samples, global_batch):
    """This worker's profile of `framework`'s `fit` step (see the module doc)."""
    k, strategy, model, ds = peers.build(framework, samples, global_batch)
    steps = samples // global_batch
    model.fit(ds, epochs=1, verbose=0)  # traces

    timer = _step_timer(k)
    model.fit(ds, epochs=epochs, verbose=0, callbacks=[timer])

    profiler = cProfile.Profile()
    with _CallRecorder() as recorder:
        profiler.enable()
        model.fit(ds, epochs=1, verbose=0)
        profiler.disable()
    host = _host_profile(pstats.Stats(profiler), steps)
    # Each step function's calls in the epoch: how many per step.
    functions = {}
    graph_ops = 0
    collectives = {}
    for name, (fn, count) in recorder.calls.items():
        ops = _graph_ops(fn)
        functions[name] = {"calls_per_step": count / steps, **ops}
        graph_ops += ops["ops"] * count / steps
        for t, c in ops["collectives"].items():
            collectives[t] = collectives.get(t, 0) + c * count / steps
    host["function_calls_per_step"] = sum(f["calls_per_step"] for f in functions.values())
    host["host_reads_per_step"] = recorder.reads / steps

    import tensorflow as tf

    logdir = tempfile.mkdtemp(prefix="step_profile_")
    tf.profiler.experimental.start(logdir)
    model.fit(ds, epochs=1, verbose=0)
    tf.profiler.experimental.stop()
    device = _op_stats(logdir, steps)
    shutil.rmtree(logdir, ignore_errors=True)

    return {
        "framework": framework,
        "version": k.__version__,
        "rank": strategy.cluster_resolver.task_id or 0,
        "workers": strategy.num_replicas_in_sync,
        "steps_per_epoch": steps,
        "step_s": timer.steps,
        # Each epoch's first step: Keras 3 creates the epoch's iterator in it,
        # tf-keras before `on_epoch_begin`.
        "first_step_s": timer.first_steps,
        "host": host,
        "graph": {"ops_per_step": graph_ops, "collectives_per_step": collectives,
                  "functions": functions},
        "device": device,
    }


#: The reference label: keras_comm from a snapshot (`--ref-source`).
REF = "keras_comm_ref"


def variants(ref_source=None):
    """label -> (framework, extra environment) of the jobs each round runs."""
    out = {"keras_comm": ("keras_comm", {}), "tf_keras": ("tf_keras", {})}
    if ref_source:
        out[REF] = ("keras_comm", {"KERAS_COMM_BENCH_SOURCE": str(ref_source)})
    return out


def run(launch, workers, rounds, epochs, out_dir, env=None, ref_source=None, say=print,
        timeout=600):
    """Launches the profile jobs, interleaved: each round runs every variant
    back to back, in an order reversed every other round.

    Returns:
        {str(n): {label: [this round's rank dicts or None, ...]}}.
    """
    jobs = variants(ref_source)
    out = {str(n): {label: [] for label in jobs} for n in workers}
    for r in range(rounds):
        for n in workers:
            order = list(jobs) if r % 2 == 0 else list(reversed(jobs))
            for label in order:
                framework, extra = jobs[label]
                tag = f"profile_{label}_n{n}_r{r}"
                code = launch.run(
                    ["-m", "benchmarks.step_profile", "--framework", framework,
                     "--epochs", str(epochs), "--out-dir", str(out_dir), "--tag", tag],
                    n, timeout=timeout, env={**(env or {}), **extra},
                )
                ranks = [Path(out_dir) / f"{tag}.rank{k}.json" for k in range(n)]
                job = [json.loads(p.read_text()) for p in ranks] if all(
                    p.exists() for p in ranks) else None
                out[str(n)][label].append(job)
                if job is None:
                    say(f"[profile n={n}] {label} round {r}: failed (exit {code})")
                else:
                    say(f"[profile n={n}] {label} round {r}: {_step_ms(job):.2f} ms/step")
    return out


def _step_ms(ranks, key="step_s"):
    """A job's step time: per step the slowest rank's, the median over steps."""
    length = min(len(r[key]) for r in ranks)
    return statistics.median(max(r[key][i] for r in ranks) for i in range(length)) * 1e3


def summarize(jobs):
    """Per worker count: each variant's step time (median over rounds), its
    profile (the last round's rank 0), and its speed relative to tf-keras's
    (tf-keras's step time over its own)."""
    rows = []
    for n, per_framework in sorted(jobs.items(), key=lambda kv: int(kv[0])):
        row = {"workers": int(n)}
        for framework, rounds in per_framework.items():
            done = [j for j in rounds if j]
            if not done:
                row[framework] = {"error": "no job finished"}
                continue
            rank0 = done[-1][0]
            row[framework] = {
                "version": rank0["version"],
                "step_ms": statistics.median(_step_ms(j) for j in done),
                "step_ms_rounds": [_step_ms(j) for j in done],
                "first_step_ms": statistics.median(_step_ms(j, "first_step_s") for j in done),
                "host": rank0["host"],
                "graph": rank0["graph"],
                "device": rank0["device"],
            }
        # Speed relative to tf-keras, round by round (each round's jobs ran
        # back to back) and its median; above 1: faster than tf-keras.
        for label, rounds in per_framework.items():
            if label == "tf_keras":
                continue
            pairs = [(a, b) for a, b in zip(rounds, per_framework["tf_keras"]) if a and b]
            if pairs:
                ratios = [_step_ms(b) / _step_ms(a) for a, b in pairs]
                row[label]["speed_vs_tf_keras_rounds"] = ratios
                row[label]["speed_vs_tf_keras"] = statistics.median(ratios)
        rows.append(row)
    return rows


def results_file(rows, command, machine):
    """The docs/results/ form of `summarize`'s rows: one row per worker count and variant."""
    table = []
    for row in rows:
        for label, d in row.items():
            if label == "workers" or "error" in d:
                continue
            h, g, dev = d["host"], d["graph"], d["device"] or {}
            ratio = d.get("speed_vs_tf_keras")
            table.append([
                f"{row['workers']} worker{'s' if row['workers'] > 1 else ''}, {label.replace('_', '-')}",
                f"{d['step_ms']:.1f} [{min(d['step_ms_rounds']):.1f}–{max(d['step_ms_rounds']):.1f}]",
                f"{ratio:.2f}" if ratio else "–",
                f"{d['first_step_ms']:.0f}" if d.get("first_step_ms") else "–",
                f"{h['function_calls_per_step']:.0f}",
                f"{h['host_reads_per_step']:.2f}",
                f"{h['eager_ops_per_step']:.1f}",
                f"{g['ops_per_step']:.0f}",
                f"{sum(g['collectives_per_step'].values()):.0f}",
                f"{dev.get('op_ms_per_step', float('nan')):.0f} "
                f"({dev.get('collective_ms_per_step', float('nan')):.0f})",
            ])
    return {
        "title": "One `fit` step, Keras 3 + keras_comm next to tf-keras",
        "date": datetime.date.today().isoformat(),
        "machine": machine,
        "command": command,
        "columns": [
            "workers, framework", "ms per step [rounds]", "speed vs tf-keras",
            "epoch's first step, ms", "compiled calls per step", "host reads per step",
            "eager ops per step", "graph ops per step", "collectives in the graph",
            "op time ms per step (collectives)",
        ],
        "rows": table,
        "note": (
            "784-1024-1024-10 MLP, Adam, global batch 256, 40 steps per epoch. ms per step: "
            "median over the steps after each epoch's first (slowest rank per step), median "
            "over rounds [range]; speed: tf-keras's step time over the variant's, median of "
            "per-round ratios. The first step of an epoch is given apart: Keras 3 creates "
            "the epoch's iterator inside it, tf-keras before `on_epoch_begin`. Calls, reads "
            "(tensor values copied to the host) and eager ops from `cProfile` of one epoch; "
            "graph ops: the nodes of the compiled functions a step calls, cond branches "
            "included; op time: TensorFlow's profiler, self time summed over threads "
            "(a collective's includes its wait for the peer)."
        ),
    }


def _print(rows):
    for row in rows:
        print(f"== {row['workers']} worker(s)")
        for f, d in row.items():
            if f == "workers":
                continue
            if "error" in d:
                print(f"  {f}: {d['error']}")
                continue
            if "speed_vs_tf_keras" in d:
                print(f"  {f}: speed / tf-keras {d['speed_vs_tf_keras']:.3f} (rounds "
                      f"{', '.join(f'{r:.3f}' for r in d['speed_vs_tf_keras_rounds'])})")
            h, g, dev = d["host"], d["graph"], d["device"] or {}
            print(f"  {f:10s} {d['step_ms']:7.2f} ms/step (epochs' first steps "
                  f"{d['first_step_ms']:.1f} ms)  "
                  f"calls {h['function_calls_per_step']:.2f}  reads {h['host_reads_per_step']:.2f}  "
                  f"eager ops {h['eager_ops_per_step']:.1f}  python {h['python_ms_per_step']:.2f} ms  "
                  f"graph ops {g['ops_per_step']:.0f}  collectives {g['collectives_per_step']}  "
                  f"ops run {dev.get('ops_per_step', float('nan')):.0f}, "
                  f"{dev.get('op_ms_per_step', float('nan')):.2f} ms "
                  f"(collectives {dev.get('collective_ms_per_step', float('nan')):.2f} ms)  "
                  f"host waits {h['waiting_ms_per_step']:.2f} ms")
            print("      ops:", ", ".join(f"{k} {v:.2f}" for k, v in dev.get("top_ms_per_step", {}).items()))
            print("      host:", ", ".join(f"{k} {v:.2f}" for k, v in h["top_tottime_ms_per_step"].items()))
            for name, fn in g["functions"].items():
                print(f"      {fn['calls_per_step']:.2f} x {name}: {fn['ops']} ops {fn['collectives']}")


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--framework", choices=peers.FRAMEWORKS)
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--samples", type=int, default=peers.SAMPLES)
    parser.add_argument("--global-batch", type=int, default=peers.GLOBAL_BATCH)
    parser.add_argument("--out-dir", required=True)
    parser.add_argument("--tag", help="worker mode: this job's file prefix")
    parser.add_argument("--rounds", type=int, default=3, help="driver mode: rounds")
    parser.add_argument("--workers", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--results", help="driver mode: also write this docs/results JSON")
    parser.add_argument("--ref-source", help="driver mode: also profile keras_comm from this "
                        "source tree (e.g. a `git archive` of main), labelled keras_comm_ref")
    args = parser.parse_args(argv)
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    if args.framework:  # a worker, under the launcher
        source = os.environ.get("KERAS_COMM_BENCH_SOURCE")
        if source:  # --ref-source: that snapshot of keras_comm first
            sys.path.insert(0, source)
        result = measure(args.framework, args.epochs, args.samples, args.global_batch)
        path = Path(args.out_dir) / f"{args.tag}.rank{result['rank']}.json"
        path.write_text(json.dumps(result))
        return 0
    import keras_comm_run as launch

    Path(args.out_dir).mkdir(parents=True, exist_ok=True)
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [os.getcwd(), env.get("PYTHONPATH")]))
    jobs = run(launch, args.workers, args.rounds, args.epochs, args.out_dir, env,
               ref_source=args.ref_source)
    rows = summarize(jobs)
    (Path(args.out_dir) / "summary.json").write_text(json.dumps(rows, indent=1))
    _print(rows)
    if args.results:
        from benchmarks import model_scale

        command = "python -m benchmarks.step_profile " + " ".join(
            a for a in (argv if argv is not None else sys.argv[1:]))
        Path(args.results).write_text(json.dumps(
            results_file(rows, command, model_scale.machine()), indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
