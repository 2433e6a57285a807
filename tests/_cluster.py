"""Harness for multi-process tests: run a worker script as a local cluster.

Test side:

```python
from _cluster import run_cluster

def test_all_reduce():
    result = run_cluster("ops/all_reduce_worker.py", 2, "--size", "8").check()
    assert [r["sum"] for r in result.results] == [2.0, 2.0]
```

Worker side (the tests directory is on the workers' PYTHONPATH):

```python
from _cluster import write_result
write_result({"sum": float(total)})
```

The launcher runs with `--timeout`, so a deadlocked collective fails the
test instead of hanging CI, and with `--preload tensorflow,keras,keras_comm`
(`PRELOAD`): it imports them once and forks every worker from itself, so a
launch of N workers pays one import (~7 CPU-s) instead of N. The workers are
still separate processes, each with its own TensorFlow runtime, strategy
and gRPC server. `preload=False` starts every worker as a new interpreter,
the launcher's default (tests/launcher/ checks both ways).

The launcher is started as `python -m keras_comm_run` (what the
`keras-comm-run` console script runs), not `python -m keras_comm.launch`:
the latter first imports the keras_comm package, and with it TensorFlow,
costing every cluster run seconds of CPU and ~600 MB in a process that needs
neither. keras_comm_run uses only the standard library. This module imports
neither TensorFlow nor Keras; with preloading a worker finds them imported
already, but TensorFlow's runtime is not started (the launcher refuses to
fork otherwise), so a worker can still configure devices before first use.
"""

import fcntl
import hashlib
import json
import os
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

TESTS_DIR = Path(__file__).resolve().parent
REPO_DIR = TESTS_DIR.parent

OUT_DIR_VAR = "KERAS_COMM_TEST_OUT"

# Extra seconds the harness waits beyond the launcher's own --timeout before
# it stops the launcher itself (the launcher should always finish first).
_HARNESS_SLACK_SECONDS = 30
_OUTPUT_TAIL_CHARS = 8000


class ClusterResult:
    """What a cluster run produced.

    Attributes:
        returncode: the launcher's exit status (see `keras-comm-run --help`).
        output: the launcher's combined stdout and stderr, every worker line
            prefixed with `[rank i] `.
        results: per-rank objects written with `write_result`, ordered by
            rank; `None` for a rank that wrote nothing.
        out_dir: the directory the workers wrote into (removed afterwards
            unless the caller passed `out_dir`).
        command: the launcher's argv, for reproducing a failure by hand.
    """

    def __init__(self, returncode, output, results, out_dir, command=None):
        self.command = command
        self.returncode = returncode
        self.output = output
        self.results = results
        self.out_dir = out_dir

    def tail(self, chars=_OUTPUT_TAIL_CHARS):
        """The last `chars` characters of the output."""
        if len(self.output) <= chars:
            return self.output
        return "[... output truncated ...]\n" + self.output[-chars:]

    def check(self):
        """Raises AssertionError unless every rank exited 0 and wrote a result.

        Returns:
            self, so `result = run_cluster(...).check()` reads naturally.
        """
        missing = [rank for rank, r in enumerate(self.results) if r is None]
        if self.returncode != 0 or missing:
            problems = []
            if self.returncode != 0:
                problems.append(f"launcher exited {self.returncode}")
            if missing:
                problems.append(f"no result from rank(s) {missing}")
            command = shlex.join(self.command) if self.command else "?"
            raise AssertionError(
                f"cluster run failed: {'; '.join(problems)}.\n"
                f"command: {command}\n"
                f"--- output tail ---\n{self.tail()}\n--- end of output ---"
            )
        return self

    def __repr__(self):
        return (
            f"ClusterResult(returncode={self.returncode}, "
            f"results={self.results!r}, output=<{len(self.output)} chars>)"
        )


def _resolve_script(script):
    """Absolute script path; relative paths may be relative to tests/."""
    path = Path(script)
    if not path.is_absolute() and not path.exists() and (TESTS_DIR / path).exists():
        path = TESTS_DIR / path
    return str(path.resolve())


def cluster_env(out_dir, env=None):
    """Environment for the launcher (and so for the workers)."""
    child_env = dict(os.environ)
    child_env["TF_CPP_MIN_LOG_LEVEL"] = "2"
    pythonpath = [str(TESTS_DIR), str(REPO_DIR)]
    if child_env.get("PYTHONPATH"):
        pythonpath.append(child_env["PYTHONPATH"])
    child_env["PYTHONPATH"] = os.pathsep.join(pythonpath)
    child_env[OUT_DIR_VAR] = str(out_dir)
    if env:
        child_env.update({str(k): str(v) for k, v in env.items()})
    return child_env


# `python -m keras_comm_run`, found through cluster_env's PYTHONPATH (this
# repository first). -P (Python >= 3.11) keeps the current directory off the
# launcher's sys.path, so the launcher is this repository's wherever pytest runs.
LAUNCHER = [sys.executable, *(["-P"] if sys.version_info >= (3, 11) else []), "-m", "keras_comm_run"]


def free_port_block(size):
    """A port P with P..P+size-1 free: a rendezvous port and its workers' ports."""
    import keras_comm_run

    for _ in range(100):
        base = keras_comm_run.pick_ports(1)[0]
        if base + size > 65535:
            continue
        try:
            keras_comm_run.pick_ports(size, base_port=base)
        except ValueError:
            continue
        return base
    raise AssertionError("no free port block")


# The modules the launcher imports once for all its workers (--preload).
PRELOAD = ("tensorflow", "keras", "keras_comm")


def launcher_command(script, num_workers, *args, timeout=300, launcher_args=(), preload=True):
    """The argv `run_cluster` runs: `python -m keras_comm_run ...`."""
    return [
        *LAUNCHER,
        "-n", str(num_workers),
        "--timeout", str(timeout),
        *(["--preload", ",".join(PRELOAD)] if preload else []),
        # Every rank's output, for the checks and for a failure's report.
        "--console-ranks", "all",
        *[str(a) for a in launcher_args],
        _resolve_script(script),
        *[str(a) for a in args],
    ]


def _read_results(out_dir, num_workers):
    results = []
    for rank in range(num_workers):
        path = Path(out_dir) / f"rank{rank}.json"
        try:
            results.append(json.loads(path.read_text()))
        except FileNotFoundError:
            results.append(None)
    return results


def _stop_launcher(proc):
    """SIGTERM the launcher (it stops its workers), then SIGKILL; returns output."""
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
    try:
        output, _ = proc.communicate(timeout=15)
    except subprocess.TimeoutExpired:
        proc.kill()
        output, _ = proc.communicate()
    return output or ""


# Called (without arguments) before every launch when set: tests/conftest.py
# sets it to fail a test that launches workers without the `multiprocess`
# marker, so that `pytest -m "not multiprocess"` never starts a cluster.
before_launch = None


def run_cluster(script, num_workers, *args, timeout=300, env=None, out_dir=None, launcher_args=(),
                preload=True):
    """Runs `script` on `num_workers` local worker processes.

    Args:
        script: path of the worker script (absolute, relative to the current
            directory, or relative to tests/).
        num_workers: number of workers.
        *args: arguments passed to every worker.
        timeout: seconds before the launcher stops the job (non-zero exit).
        env: extra environment variables for the workers.
        out_dir: directory for the workers' results; kept afterwards. By
            default a fresh temporary directory, removed after reading.
        launcher_args: extra launcher options, e.g. `["--max-restarts", "1"]`.
        preload: fork the workers from a launcher that imported `PRELOAD`
            once (True), or start each as a new interpreter (False: for
            workers that import no TensorFlow, or to test that path).

    Returns:
        A ClusterResult. Call `.check()` to assert success.
    """
    if before_launch is not None:
        before_launch()
    keep = out_dir is not None
    if keep:
        out_dir = Path(out_dir)
        out_dir.mkdir(parents=True, exist_ok=True)
        # A result left by an earlier run must not pass for this run's.
        for stale in out_dir.glob("rank*.json"):
            stale.unlink()
    else:
        out_dir = Path(tempfile.mkdtemp(prefix="keras_comm_test_"))
    command = launcher_command(
        script, num_workers, *args, timeout=timeout, launcher_args=launcher_args, preload=preload
    )
    try:
        proc = subprocess.Popen(
            command,
            env=cluster_env(out_dir, env),
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            errors="replace",
        )
        try:
            output, _ = proc.communicate(timeout=timeout + _HARNESS_SLACK_SECONDS)
        except subprocess.TimeoutExpired:
            output = _stop_launcher(proc)
            output += "\n[_cluster: launcher did not finish; stopped by the harness]\n"
        except BaseException:
            # E.g. Ctrl-C in pytest: never leave the job running behind us.
            _stop_launcher(proc)
            raise
        results = _read_results(out_dir, num_workers)
    finally:
        if not keep:
            shutil.rmtree(out_dir, ignore_errors=True)
    return ClusterResult(proc.returncode, output, results, out_dir, command)


# Run directories of shared_cluster older than this are removed when a run
# starts one (a run never lasts a day; its own directory is left for reading).
_SHARED_STALE_SECONDS = 24 * 3600


def _shared_run_dir():
    # pytest-xdist gives every worker of one run the same id and the same
    # parent (the controller); without xdist the run is this process. The
    # parent also tells apart a pytest session started by a test, which
    # inherits the environment variables.
    run = f"pid{os.getpid()}"
    if os.environ.get("PYTEST_XDIST_TESTRUNUID"):
        run = f"{os.environ['PYTEST_XDIST_TESTRUNUID']}_{os.getppid()}"
    base = Path(tempfile.gettempdir())
    run_dir = base / f"keras_comm_shared_{run}"
    if not run_dir.exists():
        for old in base.glob("keras_comm_shared_*"):
            try:
                if time.time() - old.stat().st_mtime > _SHARED_STALE_SECONDS:
                    shutil.rmtree(old, ignore_errors=True)
            except OSError:
                pass
        run_dir.mkdir(exist_ok=True)
    return run_dir


def shared_cluster(script, num_workers, *args, timeout=300, env=None):
    """`run_cluster`'s result for a launch that several tests share.

    The first test of the pytest run to ask for (script, num_workers, args)
    runs it; every later test asking for it, in this process or in another
    pytest-xdist worker of the same run, reads the saved result (a test that
    asks while the launch runs waits for it). The worker script gets a state
    directory as its first argument, kept for the run (`result.out_dir`,
    where the workers' results are too), so that a test can read files the
    workers saved. Each test still checks its own part of the results: a
    launch running several groups of checks costs one TensorFlow import and
    cluster setup per process instead of one per group.

    Returns:
        A ClusterResult. A failed launch is every sharing test's failure:
        call `.check()`.
    """
    if before_launch is not None:
        before_launch()
    key = hashlib.sha256(
        json.dumps([str(_resolve_script(script)), num_workers, [str(a) for a in args], env],
                   sort_keys=True).encode()
    ).hexdigest()[:16]
    run_dir = _shared_run_dir()
    saved = run_dir / f"{key}.json"
    with open(run_dir / f"{key}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes
        if not saved.exists():
            state = run_dir / key
            result = run_cluster(script, num_workers, state, *args, timeout=timeout, env=env,
                                 out_dir=state)
            tmp = saved.with_suffix(f".tmp{os.getpid()}")
            tmp.write_text(json.dumps({
                "returncode": result.returncode, "output": result.output,
                "results": result.results, "out_dir": str(state), "command": result.command,
            }))
            os.replace(tmp, saved)
        data = json.loads(saved.read_text())
    return ClusterResult(data["returncode"], data["output"], data["results"], Path(data["out_dir"]),
                         data["command"])


# ---------------------------------------------------------------------------
# Worker side.
# ---------------------------------------------------------------------------


def rank():
    """This worker's rank: KERAS_COMM_RANK, else TF_CONFIG's task index, else 0."""
    if "KERAS_COMM_RANK" in os.environ:
        return int(os.environ["KERAS_COMM_RANK"])
    tf_config = os.environ.get("TF_CONFIG")
    if tf_config:
        return int(json.loads(tf_config).get("task", {}).get("index", 0))
    return 0


def _to_json(value):
    # Tensors and numpy values, without importing either library here.
    if hasattr(value, "numpy"):
        value = value.numpy()
    if hasattr(value, "tolist"):
        return value.tolist()
    raise TypeError(f"write_result cannot serialize {type(value).__name__}: {value!r}")


def _num_workers():
    tf_config = os.environ.get("TF_CONFIG")
    if not tf_config:
        return 1
    return len(json.loads(tf_config).get("cluster", {}).get("worker", [])) or 1


def finish(wait_seconds=120):
    """Ends a worker whose checks are done, skipping the interpreter's teardown.

    Call it last, after `main()` returned normally and this rank wrote its
    result (an exception never gets here, so a failing worker still exits
    non-zero with its traceback). It first waits until every rank has written
    its result: rank 0 hosts TensorFlow's coordination service, and a peer
    still working when it vanished could fail. A worker that trained a model
    spends 2-4 s exiting normally (garbage collection of TensorFlow's
    objects, the servers' shutdown; measured 2.1 s on 2 workers, 3.4-3.8 s on
    3, against 0.1-0.2 s with this), and every launch pays it. Not for
    workers whose exit is under test (atexit handlers, the launcher's stop
    path): os._exit runs no atexit handler.
    """
    out_dir = Path(os.environ[OUT_DIR_VAR])
    deadline = time.monotonic() + wait_seconds
    names = [f"rank{r}.json" for r in range(_num_workers())]
    while not all((out_dir / name).exists() for name in names):
        if time.monotonic() > deadline:
            return  # a peer never wrote: exit normally, let the test report it
        time.sleep(0.05)
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except Exception:
            pass
    os._exit(0)


def load_worker_module(path):
    """Imports the worker module at `path` (relative to tests/) by its name,
    with its directory on sys.path (for the modules beside it)."""
    import importlib

    path = TESTS_DIR / path
    if str(path.parent) not in sys.path:
        sys.path.insert(0, str(path.parent))
    return importlib.import_module(path.stem)


def run_groups(groups):
    """Runs a shared launch's groups of checks in order; returns their results.

    `groups`: (name, function) pairs, each function returning that group's
    JSON-able results; the result also holds each group's wall seconds
    ("group_seconds") and this process's CPU seconds in it
    ("group_cpu_seconds"). Each group's start is printed (`[rank i] group NAME`),
    so a launch that fails shows in its output which group failed.
    """
    out = {"group_seconds": {}, "group_cpu_seconds": {}}
    for name, fn in groups:
        print(f"group {name}: starting", flush=True)
        started, cpu_started = time.time(), time.process_time()
        out[name] = fn()
        out["group_seconds"][name] = round(time.time() - started, 1)
        out["group_cpu_seconds"][name] = round(time.process_time() - cpu_started, 1)
        print(f"group {name}: done in {out['group_seconds'][name]} s, "
              f"{out['group_cpu_seconds'][name]} CPU-s", flush=True)
    return out


def write_result(obj):
    """Writes `obj` as this worker's JSON result for `run_cluster`.

    Tensors and numpy arrays/scalars are converted with `.tolist()`. The file
    is written atomically, so a crash never leaves half a result.
    """
    out_dir = os.environ.get(OUT_DIR_VAR)
    if not out_dir:
        raise RuntimeError(
            f"write_result needs ${OUT_DIR_VAR}; run the script through run_cluster."
        )
    path = Path(out_dir) / f"rank{rank()}.json"
    tmp = path.with_suffix(f".json.tmp{os.getpid()}")
    tmp.write_text(json.dumps(obj, default=_to_json))
    os.replace(tmp, path)
    return path
