"""One command for every benchmark: `python -m benchmarks.run --workers 2 --out results/`.

Starts real worker processes with `keras_comm_run.run` (one job per
worker count; each job runs every family that needs that many workers, so
the things compared are measured side by side in the same processes) and an
MPI job through mpiexec before and after them. Writes to ``--out``:

* ``benchmarks.json`` -- machine info, parameters, every summary figure;
* ``benchmarks.md``   -- the tables (and the plots, embedded);
* ``results/*.json``  -- the same tables as the documentation shows them
  (docs/results/NAME.json: title, date, machine, command, columns, rows);
* ``*.png``           -- plots for the docs' benchmarks page;
* ``raw/``            -- per-rank timings; ``run.log`` -- all worker output.

Modes: default (full: 1/4/16/64 MB, >= 10 timed iterations, training on
1/2/4 workers, fusion of 8/32/128 mirrors of 4 and 16 MB in all),
``--quick`` (2 workers, 1 and 16 MB; about 13 minutes on 2 cores),
``--smoke`` (structure only, for the test suite). ``--docs`` copies
``results/*.json`` into docs/results/ and the plots into docs/performance/:
only the families this run measured, so a run of one family (``--no-...``
for the others) replaces that family's tables and leaves the rest.

The driver itself never imports TensorFlow: the launcher package
keras_comm_run uses only the standard library (importing keras_comm.launch
would import keras_comm and TensorFlow), as in tests/_cluster.py.
"""

import argparse
import datetime
import importlib
import json
import os
import platform
import shlex
import shutil
import subprocess
import sys
import time
from importlib import metadata
from pathlib import Path

from benchmarks import _stats
from benchmarks import collectives
from benchmarks import fsdp_speed
from benchmarks import fusion
from benchmarks import memory
from benchmarks import mpi
from benchmarks import nontrainable
from benchmarks import peers
from benchmarks import pipeline
from benchmarks import report
from benchmarks import training

REPO_DIR = Path(__file__).resolve().parent.parent
DOCS_DIR = REPO_DIR / "docs" / "performance"
RESULTS_DIR = REPO_DIR / "docs" / "results"

MODES = {
    "full": {
        "sizes_mb": [1, 4, 16, 64], "iters": 12, "warmup": 2, "workers": [2, 4],
        "training_workers": [1, 2, 4], "models": ["mlp", "cnn"],
        "scaling_steps": 20, "scaling_rounds": 3,
        "po_configs": [None, [1, 0], [4, 0], [1, 1], [1, 2], [4, 2]], "po_steps": 24, "po_rounds": 3,
        "fusion_counts": [8, 32, 128], "fusion_sizes_mb": [4, 16],
        "memory_models": ["mlp42m", "mlp200m"], "memory_workers": [2, 4],
        "memory_configs": list(memory.CONFIGS), "memory_steps": 4,
        "fsdp_workers": [2, 4], "fsdp_model": "mlp42m", "fsdp_variants": list(fsdp_speed.VARIANTS),
        "fsdp_steps": 4, "fsdp_rounds": 5,
    },
    "quick": {
        "sizes_mb": [1, 16], "iters": 10, "warmup": 1, "workers": [2],
        "training_workers": [1, 2], "models": ["mlp", "cnn"],
        "scaling_steps": 10, "scaling_rounds": 2,
        "po_configs": [None, [1, 0], [4, 0], [1, 1], [1, 2]], "po_steps": 12, "po_rounds": 2,
        "fusion_counts": [8, 128], "fusion_sizes_mb": [4],
        "memory_models": ["mlp42m"], "memory_workers": [2],
        "memory_configs": list(memory.CONFIGS), "memory_steps": 4,
        "fsdp_workers": [2], "fsdp_model": "mlp42m", "fsdp_variants": list(fsdp_speed.VARIANTS),
        "fsdp_steps": 3, "fsdp_rounds": 3,
    },
    "smoke": {
        "sizes_mb": [0.25], "iters": 3, "warmup": 1, "workers": [2],
        "training_workers": [2], "models": ["mlp"],
        "scaling_steps": 4, "scaling_rounds": 1,
        "po_configs": [None, [1, 0], [2, 2]], "po_steps": 4, "po_rounds": 1,
        "fusion_counts": [8], "fusion_sizes_mb": [0.25],
        "memory_models": ["tiny"], "memory_workers": [2],
        "memory_configs": ["zero1"], "memory_steps": 2,
        # The plumbing only: the tiny model, one step of one round, no prefetch pair.
        "fsdp_workers": [2], "fsdp_model": "tiny", "fsdp_variants": ["plain", "zero3"],
        "fsdp_steps": 1, "fsdp_rounds": 1,
    },
}
PEERS = {  # benchmarks/peers.py: jobs per framework and worker count, epochs per job
    "full": {"rounds": 5, "epochs": 6, "samples": peers.SAMPLES},
    "quick": {"rounds": 3, "epochs": 5, "samples": peers.SAMPLES},
    # Not in smoke mode: 2 more launches would not fit the suite's time for it.
    "smoke": None,
}
PER_REPLICA_BATCH = {"mlp": 128, "cnn": 64}
PO_PER_REPLICA_BATCH = 64
NT_PER_REPLICA_BATCH = 32
MEMORY_PER_REPLICA_BATCH = 32
FSDP_PER_REPLICA_BATCH = 32
PIPELINE_BATCH = 240


def _load_launch():
    # This working tree's launcher, whatever keras_comm is installed.
    if sys.path[:1] != [str(REPO_DIR)]:
        sys.path.insert(0, str(REPO_DIR))
    return importlib.import_module("keras_comm_run")


def _version(name):
    try:
        return metadata.version(name)
    except metadata.PackageNotFoundError:
        return None


def machine_info():
    info = {
        "cpu_count": os.cpu_count(),
        "platform": platform.platform(),
        "python": platform.python_version(),
        "versions": {
            name: _version(name)
            for name in ("keras-comm", "tensorflow", "keras", "numpy", "mpi4py", "mpich", "matplotlib")
        },
    }
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                info["cpu_model"] = line.split(":", 1)[1].strip()
                break
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemTotal"):
                info["memory_gb"] = round(int(line.split()[1]) / 2**20, 1)
    except OSError:
        pass
    try:
        info["git_commit"] = subprocess.run(
            ["git", "-C", str(REPO_DIR), "rev-parse", "HEAD"], capture_output=True, text=True, check=False
        ).stdout.strip() or None
    except OSError:
        info["git_commit"] = None
    return info


def _loadavg():
    try:
        return [round(x, 2) for x in os.getloadavg()]
    except OSError:
        return None


class _Tee:
    """Text stream: everything to the log, benchmark progress lines to the console."""

    def __init__(self, log, console,
                 markers=("] [collectives", "] [fusion", "] [scaling", "] [parallel_optimizer", "[peers",
                          "] [fsdp")):
        self.log = log
        self.console = console
        self.markers = markers
        self._line = ""

    def write(self, text):
        # The launcher forwards output as it is written, not line by line:
        # choose what reaches the console per whole line.
        self.log.write(text)
        if self.console is None:
            return
        *lines, self._line = (self._line + text).split("\n")
        for line in lines:
            if any(m in line for m in self.markers):
                self.console.write(line + "\n")

    def flush(self):
        self.log.flush()
        if self.console is not None:
            self.console.flush()


def parse_args(argv=None):
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks.run",
        description=__doc__.split("\n\n")[0],
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    parser.add_argument("--workers", type=int, nargs="+", default=None,
                        help="worker counts for the collective benchmarks (default: mode's, full: 2 4)")
    parser.add_argument("--training-workers", type=int, nargs="+", default=None,
                        help="worker counts for the model.fit scaling runs (default: mode's, full: 1 2 4)")
    parser.add_argument("--out", default="results", help="output directory")
    mode = parser.add_mutually_exclusive_group()
    mode.add_argument("--quick", action="store_true", help="2 workers, fewer sizes (about 13 minutes on 2 cores)")
    mode.add_argument("--smoke", action="store_true", help="tiny run that checks the plumbing")
    parser.add_argument("--sizes", type=float, nargs="+", default=None, help="sizes in MB (2^20 bytes)")
    parser.add_argument("--iters", type=int, default=None, help="timed iterations per measurement (>= 10 for reports)")
    parser.add_argument("--ops", nargs="+", default=list(_stats.OPS), choices=_stats.OPS)
    parser.add_argument("--no-mpi", action="store_true", help="skip the MPI reference")
    parser.add_argument("--no-training", action="store_true", help="skip the training benchmarks")
    parser.add_argument("--no-collectives", action="store_true", help="skip the collective benchmarks")
    parser.add_argument("--no-fusion", action="store_true", help="skip the fusion-group benchmark")
    parser.add_argument("--no-pipeline", action="store_true", help="skip the pipeline benchmark (benchmarks/pipeline.py)")
    parser.add_argument("--no-peers", action="store_true", help="skip model.fit next to tf-keras (peers)")
    parser.add_argument("--memory", action=argparse.BooleanOptionalAction, default=True,
                        help="the memory family: peak RSS per worker, one launch per configuration "
                             "(full mode includes a 201M-parameter model: ~4 GiB per worker)")
    parser.add_argument("--memory-models", nargs="+", default=None, choices=sorted(memory.MODELS),
                        help="models for the memory family (default: mode's, full: mlp42m mlp200m)")
    parser.add_argument("--memory-workers", type=int, nargs="+", default=None,
                        help="worker counts for the memory family (default: mode's, full: 2 4)")
    parser.add_argument("--memory-configs", nargs="+", default=None, choices=list(memory.CONFIGS),
                        help="configurations for the memory family (default: mode's)")
    parser.add_argument("--no-fsdp", action="store_true",
                        help="skip the fsdp family (ZeRO-3 next to ZeRO-0: step time, bytes; benchmarks/fsdp_speed.py)")
    parser.add_argument("--fsdp-workers", type=int, nargs="+", default=None,
                        help="worker counts for the fsdp family (default: mode's, full: 2 4)")
    parser.add_argument("--fsdp-model", default=None, choices=sorted(memory.MODELS),
                        help="model for the fsdp family (default: mode's, full: mlp42m)")
    parser.add_argument("--docs", action="store_true",
                        help="also copy this run's tables into docs/results/ and its plots into docs/performance/")
    parser.add_argument("--job-timeout", type=float, default=1800, help="seconds before a worker job is stopped")
    parser.add_argument("--ref", default=None, metavar="REV",
                        help="benchmark keras_comm as committed at git REV (e.g. HEAD), extracted "
                             "with `git archive` into OUT/src, instead of the working tree (which "
                             "others may be editing while the run goes on)")
    parser.add_argument("--quiet", action="store_true", help="no progress on the console")
    args = parser.parse_args(argv)
    args.mode = "smoke" if args.smoke else "quick" if args.quick else "full"
    params = dict(MODES[args.mode])
    if args.workers:
        params["workers"] = args.workers
    if args.training_workers:
        params["training_workers"] = args.training_workers
    if args.sizes:
        params["sizes_mb"] = args.sizes
    if args.iters:
        params["iters"] = args.iters
    if args.fsdp_workers:
        params["fsdp_workers"] = args.fsdp_workers
    if args.fsdp_model:
        params["fsdp_model"] = args.fsdp_model
    for name in ("memory_models", "memory_workers", "memory_configs"):
        if getattr(args, name):
            params[name] = getattr(args, name)
    for n in params["workers"] + params["training_workers"] + params["fsdp_workers"]:
        if n < 1:
            parser.error(f"worker counts must be >= 1. Received: {n}")
    if any(n < 2 for n in params["workers"]):
        parser.error(f"--workers must be >= 2 (collectives need peers). Received: {params['workers']}")
    args.params = params
    args.command = _command(sys.argv[1:] if argv is None else argv)
    return args


def _command(argv):
    """The command that reproduces this run, as the docs quote it: without the
    output directory (a path on this machine) and the console switch."""
    kept, skip = [], False
    for arg in argv:
        if skip:
            skip = False
        elif arg in ("--out", "--job-timeout"):
            skip = True
        elif arg.startswith(("--out=", "--job-timeout=")) or arg == "--quiet":
            continue
        else:
            kept.append(arg)
    return shlex.join(["python", "-m", "benchmarks.run", *kept])


def _job_spec(args, n):
    p = args.params
    spec = {}
    if not args.no_collectives and n in p["workers"]:
        spec["collectives"] = {
            "ops": args.ops, "sizes_mb": p["sizes_mb"], "iters": p["iters"], "warmup": p["warmup"],
        }
    if not args.no_fusion and n == p["workers"][0]:
        spec["fusion"] = {
            "counts": p["fusion_counts"], "sizes_mb": p["fusion_sizes_mb"],
            "iters": p["iters"], "warmup": p["warmup"],
        }
    if not args.no_training and n in p["training_workers"]:
        spec["scaling"] = {
            "models": p["models"],
            "per_replica_batch": {m: PER_REPLICA_BATCH[m] for m in p["models"]},
            "steps": p["scaling_steps"], "rounds": p["scaling_rounds"],
        }
    if not args.no_training and n == p["workers"][0]:
        spec["parallel_optimizer"] = {
            "configs": p["po_configs"], "per_replica_batch": PO_PER_REPLICA_BATCH,
            "steps": p["po_steps"], "rounds": p["po_rounds"],
        }
    if not args.no_training and n == p["workers"][0]:
        # Non-trainable state sync (BatchNormalization): synced vs not, interleaved.
        spec["nontrainable"] = {
            "per_replica_batch": NT_PER_REPLICA_BATCH, "steps": p["po_steps"], "rounds": p["po_rounds"],
        }
    if not args.no_fsdp and n in p["fsdp_workers"]:
        spec["fsdp"] = {
            "model": p["fsdp_model"], "variants": p["fsdp_variants"], "steps": p["fsdp_steps"],
            "rounds": p["fsdp_rounds"], "per_replica_batch": FSDP_PER_REPLICA_BATCH,
        }
    return spec


def _read_ranks(raw_dir, tag, n):
    ranks = []
    for rank in range(n):
        path = raw_dir / f"{tag}.rank{rank}.json"
        if not path.exists():
            return None
        ranks.append(json.loads(path.read_text()))
    return ranks


def _snapshot(ref, dest):
    """Extracts keras_comm/ at git `ref` into `dest`; returns the full commit id."""
    commit = subprocess.run(
        ["git", "-C", str(REPO_DIR), "rev-parse", "--verify", f"{ref}^{{commit}}"],
        capture_output=True, text=True, check=True,
    ).stdout.strip()
    if dest.exists():
        shutil.rmtree(dest)
    dest.mkdir(parents=True)
    archive = subprocess.run(
        ["git", "-C", str(REPO_DIR), "archive", "--format=tar", commit, "keras_comm"],
        capture_output=True, check=True,
    ).stdout
    subprocess.run(["tar", "-x", "-C", str(dest)], input=archive, check=True)
    return commit


def _family_error(job, family):
    """Why `family`'s results from `job` are unusable, or None if they are fine."""
    if job is None:
        return "not run"
    if job["ranks"] is None:
        return f"worker job exited {job['code']} before writing results (see run.log)"
    for rank, r in enumerate(job["ranks"]):
        value = r.get(family)
        if value is None:
            return f"rank {rank} has no result (job exited {job['code']}; see run.log)"
        if isinstance(value, dict) and "error" in value:
            return f"rank {rank}: {value['error']}"
    return None


def _run_peers(args, launch, raw_dir, env, log, say):
    """The `peers` family (benchmarks/peers.py): skipped without tf-keras."""
    if _version("tf-keras") is None:
        return {"error": "tf-keras is not installed (pip install -e '.[bench]')"}
    q = PEERS[args.mode]
    if q is None:
        return {"skipped": f"not run in {args.mode} mode"}
    before = _loadavg()
    jobs = peers.run_jobs(launch, args.params["training_workers"], q["rounds"], q["epochs"], raw_dir,
                          env, log, say=say, samples=q["samples"], timeout=args.job_timeout)
    return {"parameters": {**q, "global_batch": peers.GLOBAL_BATCH}, "rows": peers.summarize(jobs),
            "loadavg": [before, _loadavg()], "jobs": jobs}


def main(argv=None):
    args = parse_args(argv)
    p = args.params
    out = Path(args.out)
    raw_dir = out / "raw"
    raw_dir.mkdir(parents=True, exist_ok=True)
    for stale in raw_dir.glob("*.json"):
        stale.unlink()
    launch = _load_launch()
    console = None if args.quiet else sys.stdout
    source = {"keras_comm": "working tree", "path": str(REPO_DIR)}
    path = [str(REPO_DIR)]
    if args.ref:
        snapshot = out / "src"
        commit = _snapshot(args.ref, snapshot)
        source = {"keras_comm": f"git {args.ref} = {commit}", "path": str(snapshot)}
    env = {
        "PYTHONPATH": os.pathsep.join(filter(None, [*path, os.environ.get("PYTHONPATH")])),
        "TF_CPP_MIN_LOG_LEVEL": "2",
        "PYTHONWARNINGS": "ignore",
    }
    if args.ref:
        env["KERAS_COMM_BENCH_SOURCE"] = source["path"]  # see benchmarks/worker.py
    full_env = {**os.environ, **env}
    started = time.perf_counter()
    results = {
        "started": datetime.datetime.now().isoformat(timespec="seconds"),
        "mode": args.mode,
        "command": args.command,
        "parameters": p,
        "machine": machine_info(),
        "source": source,
        "notes": [],
    }
    results["machine"]["loadavg_before"] = _loadavg()

    def say(message):
        if console is not None:
            print(message, flush=True)

    with open(out / "run.log", "w") as log_file:
        tee = _Tee(log_file, console)
        # MPI before the TensorFlow jobs ...
        mpi_runs = {n: [] for n in p["workers"]}
        mpi_ok, mpi_why = mpi.available()
        run_mpi = not args.no_mpi and not args.no_collectives and mpi_ok

        def mpi_bracket(label):
            for n in p["workers"]:
                say(f"[mpi n={n}] {label}")
                log_file.flush()
                res = mpi.run(n, args.ops, p["sizes_mb"], max(p["iters"], 10), p["warmup"],
                              raw_dir / f"mpi_n{n}_{label}.json", full_env, 600, log_file)
                res["when"] = label
                mpi_runs[n].append(res)

        if run_mpi:
            mpi_bracket("before")

        # ... one TensorFlow job per worker count ...
        job_results = {}
        for n in sorted(set(p["workers"]) | set(p["training_workers"]) | set(p["fsdp_workers"])):
            spec = _job_spec(args, n)
            if not spec:
                continue
            spec_path = raw_dir / f"spec_n{n}.json"
            spec_path.write_text(json.dumps(spec))
            say(f"[job n={n}] {', '.join(spec)}")
            job_start = time.perf_counter()
            code = launch.run(
                ["-m", "benchmarks.worker", "--spec", str(spec_path), "--out-dir", str(raw_dir), "--tag", f"n{n}"],
                n, timeout=args.job_timeout, env=env, stdout=tee, stderr=tee,
            )
            ranks = _read_ranks(raw_dir, f"n{n}", n)
            job_results[n] = {"code": code, "ranks": ranks, "spec": spec,
                              "seconds": time.perf_counter() - job_start}
            if code != 0 or ranks is None:
                say(f"[job n={n}] failed with exit code {code}; see {out / 'run.log'}")

        # The pipeline benchmark: one job per stage count (benchmarks/pipeline.py).
        # (Not in --smoke: one more job launch would not fit the smoke test's budget.)
        if not args.no_pipeline and args.mode != "smoke":
            say(f"[pipeline] stages {p['workers']}")
            # A global batch of 240 divides evenly over 2, 3, 4 or 5 stages (the
            # pipeline gathers the batch over its group, which needs equal shares).
            results["pipeline"] = pipeline.run_all(
                p["workers"], out, env=env, timeout=args.job_timeout, stdout=tee, batch=PIPELINE_BATCH,
                **({"steps": 3, "rounds": 2} if args.mode == "quick" else {}),
            )
        # ... tf-keras next to keras_comm, jobs alternating ...
        if not args.no_peers and not args.no_training:
            results["peers"] = _run_peers(args, launch, raw_dir, env, tee, say)

        # ... and MPI again after them.
        if run_mpi:
            mpi_bracket("after")

        # Memory: fresh processes per configuration (peak RSS only grows).
        if args.memory:
            log_file.flush()
            memory_results = memory.run(
                launch, p["memory_models"], p["memory_workers"], p["memory_configs"],
                p["memory_steps"], MEMORY_PER_REPLICA_BATCH, raw_dir, env, tee,
                timeout=args.job_timeout, say=say,
            )

    results["machine"]["loadavg_after"] = _loadavg()
    if args.no_mpi:
        results["mpi_note"] = "skipped (--no-mpi)."
    elif not mpi_ok:
        results["mpi_note"] = f"skipped: {mpi_why}."
    else:
        results["mpi_note"] = (
            "mpi4py + MPICH (PyPI), own mpiexec job; median of the runs before and after the TF jobs."
        )
    results["mpi"] = {str(n): {"runs": runs} for n, runs in mpi_runs.items() if runs}
    results["jobs"] = {str(n): {"exit_code": j["code"], "seconds": j["seconds"], "families": list(j["spec"])}
                       for n, j in job_results.items()}

    # Collectives.
    coll = {}
    for n in p["workers"]:
        job = job_results.get(n)
        if job is None or "collectives" not in job["spec"]:
            continue
        error = _family_error(job, "collectives")
        if error:
            coll[str(n)] = {"error": error}
            continue
        coll[str(n)] = collectives.summarize([r["collectives"] for r in job["ranks"]], n)
    if coll:
        results["collectives"] = coll
        results["reduce_scatter"] = collectives.reduce_scatter_comparison(
            {int(n): v for n, v in coll.items() if "error" not in v}
        )

    # Fusion groups.
    if not args.no_fusion:
        n0 = p["workers"][0]
        job = job_results.get(n0)
        error = _family_error(job, "fusion")
        results["fusion"] = (
            {"workers": n0, "error": error} if error
            else fusion.summarize([r["fusion"] for r in job["ranks"]], n0)
        )

    # Training.
    if not args.no_training:
        tr = {}
        scaling = {}
        errors = []
        for n in p["training_workers"]:
            job = job_results.get(n)
            error = _family_error(job, "scaling")
            if error:
                errors.append(f"{n} workers: {error}")
                continue
            scaling[n] = [r["scaling"] for r in job["ranks"]]
        tr["scaling"] = training.summarize_scaling(scaling) if scaling else {"error": "; ".join(errors)}
        if errors:
            tr["scaling_errors"] = errors
        n0 = p["workers"][0]
        job = job_results.get(n0)
        tr["parallel_optimizer_workers"] = n0
        error = _family_error(job, "parallel_optimizer")
        if error:
            tr["parallel_optimizer"] = {"error": error}
        else:
            tr["parallel_optimizer"] = training.summarize_parallel_optimizer(
                [r["parallel_optimizer"] for r in job["ranks"]]
            )
        error = _family_error(job, "nontrainable")
        tr["nontrainable"] = (
            {"error": error} if error
            else nontrainable.summarize([r["nontrainable"] for r in job["ranks"]])
        )
        results["training"] = tr

    # Fully sharded next to ZeRO-0.
    if not args.no_fsdp:
        fsdp = {}
        for n in p["fsdp_workers"]:
            job = job_results.get(n)
            error = _family_error(job, "fsdp")
            fsdp[str(n)] = {"error": error} if error else fsdp_speed.summarize([r["fsdp"] for r in job["ranks"]])
        results["fsdp"] = fsdp

    if args.memory:
        results["memory"] = memory_results
        if memory_results["errors"]:
            job_results["memory"] = {"code": 1, "ranks": []}

    results["seconds"] = time.perf_counter() - started
    # The numbers first, so a plotting failure cannot lose them.
    (out / "benchmarks.json").write_text(json.dumps(results, indent=1, default=str))
    results["plots"] = report.write_plots(results, out)
    (out / "benchmarks.json").write_text(json.dumps(results, indent=1, default=str))
    report.write_markdown(results, out / "benchmarks.md")
    tables = report.write_results(results, out / "results")
    if args.docs:
        # Only what this run measured: the other families' tables and plots stay.
        RESULTS_DIR.mkdir(parents=True, exist_ok=True)
        for table in tables:
            shutil.copy(table, RESULTS_DIR / table.name)
        DOCS_DIR.mkdir(parents=True, exist_ok=True)
        for plot in results["plots"]:
            shutil.copy(plot, DOCS_DIR / Path(plot).name)
    say(f"wrote {out / 'benchmarks.json'}, {out / 'benchmarks.md'}, {len(tables)} tables and "
        f"{len(results['plots'])} plots in {results['seconds']:.0f} s"
        + (" (copied into docs/results/ and docs/performance/)" if args.docs else ""))
    failed = [n for n, j in job_results.items() if j["code"] != 0 or j["ranks"] is None]
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
