"""`keras-comm-run --preload`: workers forked from a launcher that imported
modules once behave as workers started as new interpreters.

Each check runs the same worker both ways and compares what the launcher
reports (exit code, its messages, every rank's prefixed output); the
comparison alone could pass with both ways broken alike, so each check also
states the expected behaviour. numpy is the preloaded module here (fast to
import); the multi-process suite preloads TensorFlow, Keras and keras_comm
(tests/_cluster.py), and tests/launcher/test_launch.py runs a restarted
TensorFlow fit and TensorFlow's stop path with them, and stops forked workers
(a signal to the launcher, the launcher's SIGKILL) beside the same checks of
new interpreters.
"""

import json
import re
import signal
import subprocess
from pathlib import Path

import pytest

from _cluster import LAUNCHER, cluster_env

pytestmark = pytest.mark.multiprocess

SCRIPTS = Path(__file__).resolve().parent
PARITY = str(SCRIPTS / "parity.py")
MISBEHAVE = str(SCRIPTS / "misbehave.py")


def _launch(out_dir, *argv, preload, timeout=60, cwd=None):
    options = ["--preload", "numpy"] if preload else []
    return subprocess.run(
        [*LAUNCHER, *options, *argv], env=cluster_env(out_dir), stdin=subprocess.DEVNULL,
        capture_output=True, text=True, timeout=timeout, cwd=cwd,
    )


def _lines(text):
    """Every line, sorted: ranks interleave differently from run to run.

    An unfinished line that another rank's output interrupted continues on a
    fresh prefixed line; it is joined back to its continuation here.
    """
    lines = []
    unfinished = {}
    for line in text.splitlines():
        match = re.match(r"(\[rank \d+\] )(.*)", line)
        if match and match[1] in unfinished:
            lines[unfinished.pop(match[1])] += match[2]
            continue
        if match and re.fullmatch(r"partial line from rank \d+", match[2]):
            unfinished[match[1]] = len(lines)
        lines.append(line)
    return sorted(lines)


def _both(tmp_path, *argv, cwd=None):
    runs = []
    for preload in (False, True):
        out_dir = tmp_path / ("forked" if preload else "exec")
        out_dir.mkdir()
        runs.append((_launch(out_dir, *argv, preload=preload, cwd=cwd), out_dir))
    (plain, plain_dir), (forked, forked_dir) = runs
    assert forked.returncode == plain.returncode, (plain.stderr, forked.stderr)
    assert _lines(forked.stdout) == _lines(plain.stdout)
    assert _lines(forked.stderr) == _lines(plain.stderr)
    return plain, forked, (plain_dir, forked_dir)


def _report(stdout, rank):
    [line] = [l for l in stdout.splitlines() if l.startswith(f"[rank {rank}] report ")]
    return json.loads(line.split("report ", 1)[1])


def test_a_forked_worker_starts_and_ends_like_a_new_interpreter(tmp_path):
    plain, forked, dirs = _both(tmp_path, "-n", "2", "--console-ranks", "all", PARITY, "report")

    assert forked.returncode == 0, forked.stderr
    for rank in (0, 1):
        report = _report(forked.stdout, rank)
        assert report == {
            "argv": [PARITY, "report"], "path0": str(SCRIPTS), "name": "__main__",
            "file": PARITY, "rank": rank, "task": {"type": "worker", "index": rank},
            "workers": 2, "stdin": "", "unbuffered": "1", "sigint": "default_int_handler",
            "sighup": str(signal.SIG_DFL), "session_leader": True,
        }
        assert f"[rank {rank}] stderr line from rank {rank}\n" in forked.stderr
        # Non-daemon threads are joined before the atexit handlers run (the
        # thread's line may continue the unfinished partial line).
        own = [l for l in forked.stdout.splitlines() if l.startswith(f"[rank {rank}] ")]
        assert own[-1] == f"[rank {rank}] atexit of rank {rank}", forked.stdout
        assert own[-2].endswith(f"thread of rank {rank} done"), forked.stdout
    # numpy's global generator is reseeded per worker: new interpreters draw
    # different numbers, and so must forked workers (and each run anew).
    draws = [[(d / f"draw{r}").read_text() for r in (0, 1)] for d in dirs]
    assert len({*draws[0], *draws[1]}) == 4, draws


def test_the_module_form_forks_like_python_m(tmp_path):
    (tmp_path / "mod_worker.py").write_text(
        "import json, os, sys\n"
        "print(json.dumps({'argv': sys.argv, 'path0': sys.path[0], 'name': __name__}))\n")
    plain, forked, _ = _both(tmp_path, "-n", "1", "-m", "mod_worker", "x", cwd=tmp_path)

    assert forked.returncode == 0, forked.stderr
    assert json.loads(forked.stdout.split("] ", 1)[1]) == {
        "argv": [str(tmp_path / "mod_worker.py"), "x"], "path0": str(tmp_path),
        "name": "__main__"}


@pytest.mark.parametrize("mode, code, text", [
    ("exit", 42, "exit code 42"),
    ("exit-message", 1, "exit code 1"),
    ("raise", 1, "exit code 1"),
    ("sigkill", 128 + signal.SIGKILL, "killed by SIGKILL"),
    ("interrupt", 128 + signal.SIGINT, "killed by SIGINT"),
], ids=["exit", "exit-message", "raise", "sigkill", "interrupt"])
def test_a_forked_workers_end_is_reported_like_a_new_interpreters(tmp_path, mode, code, text):
    plain, forked, _ = _both(tmp_path, "-n", "2", "--console-ranks", "all", PARITY, mode)

    assert forked.returncode == code, forked.stderr
    assert f"worker rank 1 failed ({text}); stopped the other 1 worker(s)." in forked.stderr
    if mode == "raise":
        # The same traceback as `python script.py` prints: from the
        # bootstrap's frame down, no frame of the fork's own.
        assert "[rank 1] Traceback (most recent call last):\n" in forked.stderr
        assert "[rank 1] ValueError: boom in rank 1\n" in forked.stderr
        assert "preload.py" not in forked.stderr
    if mode == "exit-message":
        assert "[rank 1] a message instead of a code\n" in forked.stderr
    if mode in ("exit", "raise", "exit-message"):
        # The interpreter's exit: threads joined, then atexit handlers run
        # (the thread's line may continue rank 1's unfinished partial line).
        assert "thread of rank 1 done\n" in forked.stdout
        assert "[rank 1] atexit of rank 1\n" in forked.stdout
        assert (forked.stdout.index("thread of rank 1 done")
                < forked.stdout.index("[rank 1] atexit of rank 1"))
    # Rank 0, stopped by SIGTERM, still ran its atexit handler.
    assert "[rank 0] atexit of rank 0\n" in forked.stdout


def test_forked_workers_restart_and_stop_like_new_interpreters(tmp_path):
    plain, forked, dirs = _both(tmp_path, "-n", "2", "--max-restarts", "2", MISBEHAVE,
                                "--fail-rank", "1", "--exit-code", "5")

    assert forked.returncode == 5, forked.stderr
    assert forked.stderr.count("worker rank 1 failed (exit code 5)") == 3
    assert "attempt 2 of 2" in forked.stderr
    for out_dir in dirs:
        assert [json.loads((out_dir / f"rank{r}.json").read_text())["attempt"]
                for r in (0, 1)] == ["2", "2"]


@pytest.mark.parametrize("preload, message", [
    ("no_such_module_here", "`preload` module 'no_such_module_here' cannot be imported: "
                            "ModuleNotFoundError"),
    ("starts_a_thread", "the launcher has other threads (started on import)"),
    ("creates_tf_context", "TensorFlow's runtime (its eager context) was created in the launcher"),
    ("numpy,bad name", "`preload` must be None or a collection of module names"),
    (" , ", "--preload must name at least one module"),
], ids=["missing", "starts-a-thread", "creates-tf-context", "bad-name", "empty"])
def test_unsafe_or_missing_preload_modules_are_refused_before_any_worker(tmp_path, preload,
                                                                          message):
    proc = subprocess.run(
        [*LAUNCHER, "--preload", preload, "-n", "2", MISBEHAVE],
        env=cluster_env(tmp_path, {"PYTHONPATH": f"{SCRIPTS}:{cluster_env(tmp_path)['PYTHONPATH']}"}),
        stdin=subprocess.DEVNULL, capture_output=True, text=True, timeout=120,
    )

    assert proc.returncode == 2, proc.stderr
    assert message in proc.stderr, proc.stderr
    assert not list(tmp_path.glob("rank*.json"))  # no worker started


def test_worker_environment_that_preloaded_modules_already_read_is_refused(tmp_path):
    import keras_comm_run

    with pytest.raises(ValueError, match=r"the workers' KERAS_BACKEND must be the launcher's.*"
                                         r"Received: KERAS_BACKEND='jax'"):
        keras_comm_run.run([MISBEHAVE], 2, preload=("json",), env={"KERAS_BACKEND": "jax"})
    with pytest.raises(ValueError, match=r"`preload` must be None or a collection of module names"):
        keras_comm_run.run([MISBEHAVE], 2, preload="numpy")
