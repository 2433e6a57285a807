"""Tests for keras_comm_run (`keras-comm-run`, also `keras_comm.launch`) and tests/_cluster.

Worker scripts live beside this file (tests/launcher/). All but the last test only read
environment variables in the workers, so they start in a fraction of a second.
"""

import io
import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from _cluster import LAUNCHER, REPO_DIR, cluster_env, free_port_block, run_cluster, write_result
from keras_comm import launch
from keras_comm_run import cluster

pytestmark = pytest.mark.multiprocess

SCRIPTS = Path(__file__).resolve().parent
REPORT_ENV = str(SCRIPTS / "report_env.py")
MISBEHAVE = str(SCRIPTS / "misbehave.py")

# The launcher promises to stop everything within 10 s of a failure.
STOP_BUDGET_SECONDS = 10


def _launch(out_dir, *argv, timeout=30):
    """Runs the launcher with `argv`; stdout and stderr kept separate.

    Like run_cluster, this runs `python -m keras_comm_run`, which never
    imports the keras_comm package (and TensorFlow) in the launcher.
    """
    return subprocess.run(
        [*LAUNCHER, *argv],
        env=cluster_env(out_dir),
        stdin=subprocess.DEVNULL,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def _results(out_dir, num_workers):
    return [json.loads((Path(out_dir) / f"rank{r}.json").read_text()) for r in range(num_workers)]


def _alive(pid):
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:
        # A zombie has exited; it only waits for its parent to reap it.
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (FileNotFoundError, IndexError):
        return False
    return state != "Z"


def _assert_all_gone(pids):
    deadline = time.monotonic() + 1.0
    while any(_alive(pid) for pid in pids) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not [pid for pid in pids if _alive(pid)], f"workers still alive: {pids}"


def _wait_for_files(out_dir, num_workers, timeout=20):
    paths = [Path(out_dir) / f"rank{r}.json" for r in range(num_workers)]
    deadline = time.monotonic() + timeout
    while not all(p.exists() for p in paths):
        assert time.monotonic() < deadline, "workers never reported ready"
        time.sleep(0.05)


# ---------------------------------------------------------------------------
# Success paths.
# ---------------------------------------------------------------------------


def test_success_prefixes_lines_and_sets_tf_config_per_rank(tmp_path):
    proc = _launch(tmp_path, "-n", "3", "--console-ranks", "all", REPORT_ENV,
                   "--flag", "-n", "7", "--timeout", "x")

    assert proc.returncode == 0, proc.stderr
    for r in range(3):
        assert f"[rank {r}] stdout line from rank {r}\n" in proc.stdout
        assert f"[rank {r}] partial line from rank {r}\n" in proc.stdout
        assert f"[rank {r}] stderr line from rank {r}\n" in proc.stderr
    assert "stderr line" not in proc.stdout
    assert "stdout line" not in proc.stderr

    results = _results(tmp_path, 3)
    workers = json.loads(results[0]["tf_config"])["cluster"]["worker"]
    assert len(workers) == len(set(workers)) == 3
    for r, result in enumerate(results):
        assert json.loads(result["tf_config"]) == {
            "cluster": {"worker": workers},
            "task": {"type": "worker", "index": r},
        }
        assert result["rank"] == str(r)
        assert result["world_size"] == "3"
        # Everything after the script belongs to the script, launcher-like
        # options included.
        assert result["argv"] == ["--flag", "-n", "7", "--timeout", "x"]
    for address in workers:
        host, port = address.rsplit(":", 1)
        assert host == "127.0.0.1" and 0 < int(port) < 65536


@pytest.mark.parametrize(
    "entry",
    [
        [sys.executable, "-m", "keras_comm_run"],
        [sys.executable, "-m", "keras_comm.launch"],
        [sys.executable, str(REPO_DIR / "keras_comm" / "launch.py")],
        [str(Path(sys.executable).with_name("keras-comm-run"))],
    ],
    ids=["python-m", "python-m-old-name", "old-file", "console-script"],
)
def test_documented_entry_points(tmp_path, entry):
    if not Path(entry[0]).exists():
        pytest.skip(f"{entry[0]} is not installed")
    proc = subprocess.run(
        [*entry, "-n", "2", REPORT_ENV],
        env=cluster_env(tmp_path),
        stdin=subprocess.DEVNULL,
        capture_output=True,
        text=True,
        timeout=60,
    )

    assert proc.returncode == 0, proc.stderr
    assert "[rank 0] stdout line from rank 0" in proc.stdout
    assert len(_results(tmp_path, 2)) == 2


def test_module_form(tmp_path):
    # tests/ is on the workers' PYTHONPATH (cluster_env), like a package dir.
    proc = _launch(tmp_path, "-n", "2", "-m", "launcher.report_env", "--epochs", "1")

    assert proc.returncode == 0, proc.stderr
    assert "[rank 0] stdout line from rank 0" in proc.stdout
    assert [r["argv"] for r in _results(tmp_path, 2)] == [["--epochs", "1"]] * 2


def test_no_prefix(tmp_path):
    proc = _launch(tmp_path, "-n", "1", "--no-prefix", REPORT_ENV)

    assert proc.returncode == 0, proc.stderr
    assert proc.stdout == "stdout line from rank 0\npartial line from rank 0\n"


def test_run_api_routes_streams_and_layers_env(tmp_path, monkeypatch):
    for key, value in cluster_env(tmp_path).items():
        monkeypatch.setenv(key, value)
    environ_before = dict(os.environ)
    out, err = io.StringIO(), io.StringIO()

    code = launch.run(
        [REPORT_ENV, "a"], 2, env={"KERAS_COMM_TEST_EXTRA": "x"}, stdout=out, stderr=err, timeout=30
    )

    assert code == 0, err.getvalue()
    assert "[rank 0] stdout line from rank 0\n" in out.getvalue()
    assert "[rank 1] stderr line from rank 1\n" in err.getvalue()
    assert [r["extra"] for r in _results(tmp_path, 2)] == ["x", "x"]
    assert dict(os.environ) == environ_before


def test_run_api_validates_before_starting_anything(tmp_path):
    with pytest.raises(ValueError, match=r"Received: num_workers=0"):
        launch.run([REPORT_ENV], 0)
    with pytest.raises(ValueError, match=r"non-empty list"):
        launch.run(REPORT_ENV, 2)
    with pytest.raises(ValueError, match=r"Received: script='.*missing\.py'"):
        launch.run([str(tmp_path / "missing.py")], 2)
    with pytest.raises(ValueError, match=r"unauthenticated"):
        launch.run([REPORT_ENV], 2, host="192.0.2.1")
    with pytest.raises(ValueError, match=r"Received: timeout=0"):
        launch.run([REPORT_ENV], 2, timeout=0)


# ---------------------------------------------------------------------------
# Failures, signals, timeouts.
# ---------------------------------------------------------------------------


def test_failing_worker_stops_the_others(tmp_path):
    start = time.monotonic()
    proc = _launch(tmp_path, "-n", "2", MISBEHAVE, "--fail-rank", "1", "--exit-code", "3")
    elapsed = time.monotonic() - start

    assert proc.returncode == 3, proc.stderr
    assert elapsed < STOP_BUDGET_SECONDS
    assert "keras-comm-run: worker rank 1 failed (exit code 3); stopped the other 1 worker(s)." in (
        proc.stderr
    )
    _assert_all_gone([r["pid"] for r in _results(tmp_path, 2)])


def test_first_failure_wins_over_the_stopped_workers_exit_codes(tmp_path):
    # Rank 0 exits 7 when the launcher's SIGTERM stops it: still rank 1's 3.
    proc = _launch(
        tmp_path, "-n", "3", MISBEHAVE, "--fail-rank", "1", "--exit-code", "3", "--exit-on-term", "7"
    )

    assert proc.returncode == 3, proc.stderr
    assert "worker rank 1 failed (exit code 3); stopped the other 2 worker(s)." in proc.stderr
    assert "rank 0 failed" not in proc.stderr


def test_worker_killed_by_signal(tmp_path):
    proc = _launch(tmp_path, "-n", "2", MISBEHAVE, "--fail-rank", "1", "--sigkill")

    assert proc.returncode == 128 + signal.SIGKILL, proc.stderr
    assert "worker rank 1 failed (killed by SIGKILL)" in proc.stderr
    _assert_all_gone([r["pid"] for r in _results(tmp_path, 2)])


def test_worker_exit_code_is_passed_through(tmp_path):
    proc = _launch(tmp_path, "-n", "2", MISBEHAVE, "--fail-rank", "0", "--exit-code", "42")

    assert proc.returncode == 42, proc.stderr
    assert "worker rank 0 failed (exit code 42)" in proc.stderr


@pytest.mark.parametrize(
    "signum, extra_args, launcher_args",
    [
        (signal.SIGINT, [], []),
        (signal.SIGTERM, [], []),
        (signal.SIGHUP, [], []),
        # Workers that ignore the signal are SIGKILLed after the grace period.
        (signal.SIGINT, ["--ignore-signals"], []),
        # Workers forked from a launcher that preloaded a module.
        (signal.SIGTERM, ["--ignore-signals"], ["--preload", "numpy"]),
    ],
    ids=["sigint", "sigterm", "sighup", "sigint-ignored-by-workers", "sigterm-preloaded"],
)
def test_signal_to_launcher_stops_all_workers(tmp_path, signum, extra_args, launcher_args):
    proc = subprocess.Popen(
        [*LAUNCHER, *launcher_args, "-n", "2", MISBEHAVE, *extra_args],
        env=cluster_env(tmp_path),
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        _wait_for_files(tmp_path, 2)
        pids = [r["pid"] for r in _results(tmp_path, 2)]
        start = time.monotonic()
        proc.send_signal(signum)
        _, stderr = proc.communicate(timeout=STOP_BUDGET_SECONDS)
        elapsed = time.monotonic() - start
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()

    assert proc.returncode == 128 + signum, stderr
    assert elapsed < STOP_BUDGET_SECONDS
    assert f"received {signal.Signals(signum).name}; stopped 2 worker(s)." in stderr
    _assert_all_gone(pids)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="PR_SET_PDEATHSIG is Linux-only")
@pytest.mark.parametrize("launcher_args", [[], ["--preload", "numpy"]],
                         ids=["new-interpreters", "preloaded"])
def test_sigkill_of_the_launcher_kills_the_workers(tmp_path, launcher_args):
    proc = subprocess.Popen(
        [*LAUNCHER, *launcher_args, "-n", "2", MISBEHAVE, "--ignore-signals"],
        env=cluster_env(tmp_path),
        stdin=subprocess.DEVNULL,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        _wait_for_files(tmp_path, 2)
    finally:
        proc.kill()
        proc.wait()

    _assert_all_gone([r["pid"] for r in _results(tmp_path, 2)])


def test_timeout_stops_all_workers(tmp_path):
    start = time.monotonic()
    proc = _launch(tmp_path, "-n", "2", "--timeout", "1.5", MISBEHAVE)
    elapsed = time.monotonic() - start

    assert proc.returncode == launch.EXIT_TIMEOUT, proc.stderr
    assert elapsed < 1.5 + STOP_BUDGET_SECONDS
    assert "keras-comm-run: timed out after 1.5 s; stopped 2 worker(s)." in proc.stderr
    _assert_all_gone([r["pid"] for r in _results(tmp_path, 2)])


# ---------------------------------------------------------------------------
# Bad launcher input: argparse errors (exit 2), nothing started.
# ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    "argv, message",
    [
        (["-n", "0", REPORT_ENV], "-n must be >= 1. Received: -n 0"),
        (["-n", "-3", REPORT_ENV], "-n must be >= 1. Received: -n -3"),
        (["-n", "two", REPORT_ENV], "argument -n/--num-workers: invalid int value: 'two'"),
        (["-n", "2", "missing.py"], "script must be an existing file. Received: script 'missing.py'"),
        (["-n", "2", str(SCRIPTS)], "script must be an existing file. Received: script"),
        (["-n", "2"], "a script (or -m module) to run is required"),
        (["-n", "2", "-m"], "-m must be followed by a module name"),
        ([REPORT_ENV], "the following arguments are required: -n/--num-workers"),
        (["-n", "2", "--timeout", "0", REPORT_ENV], "--timeout must be > 0. Received: --timeout 0"),
        (["-n", "2", "--base-port", "65535", REPORT_ENV], "Received: --base-port 65535"),
        (["-n", "2", "--host", "no such host", REPORT_ENV], "Received: host='no such host'"),
    ],
)
def test_bad_arguments(tmp_path, argv, message):
    proc = _launch(tmp_path, *argv)

    assert proc.returncode == 2
    assert "keras-comm-run: error:" in proc.stderr
    assert message in proc.stderr
    assert not list(tmp_path.iterdir())


def test_busy_base_port_is_an_argument_error(tmp_path):
    with socket.socket() as busy:
        busy.bind(("0.0.0.0", 0))
        busy.listen()
        port = busy.getsockname()[1]
        proc = _launch(tmp_path, "-n", "1", "--base-port", str(port), REPORT_ENV)

    assert proc.returncode == 2
    assert f"cannot use port {port}" in proc.stderr
    assert not list(tmp_path.iterdir())


def test_pick_ports_are_distinct():
    ports = launch.pick_ports(16)

    assert len(set(ports)) == 16
    assert all(0 < p < 65536 for p in ports)


@pytest.mark.parametrize("host", ["192.0.2.1", "0.0.0.0"])
def test_non_loopback_host_is_refused(tmp_path, host):
    proc = _launch(tmp_path, "-n", "2", "--host", host, REPORT_ENV)

    assert proc.returncode == 2
    assert "non-loopback" in proc.stderr
    assert "unauthenticated and runs any graph" in proc.stderr
    assert "--allow-non-loopback" in proc.stderr
    assert f"Received: host='{host}'" in proc.stderr
    assert not list(tmp_path.iterdir())


def test_loopback_names_are_accepted(tmp_path):
    proc = _launch(tmp_path, "-n", "1", "--host", "localhost", REPORT_ENV)

    assert proc.returncode == 0, proc.stderr
    assert json.loads(_results(tmp_path, 1)[0]["tf_config"])["cluster"]["worker"][0].startswith(
        "localhost:"
    )


def test_help_describes_the_contract():
    proc = subprocess.run([*LAUNCHER, "--help"], capture_output=True, text=True)

    assert proc.returncode == 0
    for needle in ["TF_CONFIG", "--allow-non-loopback", "exit status", "SlurmClusterResolver",
                   "LOCAL_RANK", "--nnodes", "--max-restarts", "--log-dir", "P+1+g", "--preload"]:
        assert needle in proc.stdout


def test_the_launcher_imports_neither_tensorflow_nor_keras_comm(tmp_path):
    # What the console script runs: `from keras_comm_run.cli import main`.
    code = (
        "import sys; from keras_comm_run.cli import main; "
        "print(sorted(m for m in sys.modules if m.split('.')[0] in "
        "('tensorflow', 'keras', 'keras_comm', 'numpy')))"
    )
    proc = subprocess.run(
        [sys.executable, "-P", "-c", code], env=cluster_env(tmp_path),
        capture_output=True, text=True, timeout=60,
    )

    assert proc.returncode == 0, proc.stderr
    assert proc.stdout == "[]\n"


def test_old_module_name_reexports_the_launcher():
    import keras_comm_run

    for name in keras_comm_run.__all__:
        assert getattr(launch, name) is getattr(keras_comm_run, name)


# ---------------------------------------------------------------------------
# The harness and a real TensorFlow job.
# ---------------------------------------------------------------------------


def test_run_cluster_check_reports_failure_with_output(tmp_path):
    result = run_cluster(MISBEHAVE, 2, "--fail-rank", "1", timeout=30, preload=False)

    assert result.returncode == 3
    with pytest.raises(AssertionError, match=r"(?s)launcher exited 3.*rank 1 failing now"):
        result.check()


def test_run_cluster_timeout_fails_check():
    result = run_cluster(MISBEHAVE, 2, timeout=1.5, preload=False)

    assert result.returncode == launch.EXIT_TIMEOUT
    with pytest.raises(AssertionError, match=r"(?s)launcher exited 124.*timed out after 1.5 s"):
        result.check()


def test_write_result_converts_arrays_and_names_the_rank(tmp_path, monkeypatch):
    np = pytest.importorskip("numpy")
    monkeypatch.setenv("KERAS_COMM_TEST_OUT", str(tmp_path))
    monkeypatch.setenv("KERAS_COMM_RANK", "3")

    write_result({"x": np.float32(1.5), "y": np.arange(3)})

    assert json.loads((tmp_path / "rank3.json").read_text()) == {"x": 1.5, "y": [0, 1, 2]}
    assert [p.name for p in tmp_path.iterdir()] == ["rank3.json"]


def test_tensorflow_all_reduce_over_loopback():
    # Workers started as new interpreters, the launcher's default.
    result = run_cluster("launcher/tf_all_reduce.py", 2, timeout=120, preload=False).check()

    want = {"num_replicas": 2, "sum_ones": 2.0, "sum_ids": 3.0}
    # Rank 1 used the coordination service 3 s after the chief's script had
    # ended: the exit barrier kept the chief (its host) alive.
    assert result.results == [want, {**want, "late": "still here"}]


# ---------------------------------------------------------------------------
# Environment, GPU pinning, output routing, restarts (no TensorFlow).
# ---------------------------------------------------------------------------

PROGRESS = str(SCRIPTS / "progress.py")
PORT_CLASH = str(SCRIPTS / "port_clash.py")


def test_torchrun_names_beside_keras_comm_names(tmp_path):
    proc = _launch(tmp_path, "-n", "2", "--gpus-per-worker", "0", REPORT_ENV)

    assert proc.returncode == 0, proc.stderr
    for r, result in enumerate(_results(tmp_path, 2)):
        assert result["RANK"] == result["LOCAL_RANK"] == result["KERAS_COMM_LOCAL_RANK"] == str(r)
        assert result["WORLD_SIZE"] == result["LOCAL_WORLD_SIZE"] == "2"
        assert result["KERAS_COMM_LOCAL_WORLD_SIZE"] == "2"
        assert result["KERAS_COMM_NODE_RANK"] == result["KERAS_COMM_RESTART_ATTEMPT"] == "0"


def test_each_worker_gets_its_share_of_the_cpus_unless_the_user_chose(tmp_path):
    cpus = cluster.available_cpus()
    env = cluster_env(tmp_path)
    env.pop(cluster.INTRAOP_THREADS_VAR, None)  # conftest sets 1 for the suite
    for workers, given, expected in [(2, None, max(1, cpus // 2)), (4, None, max(1, cpus // 4)),
                                     (2, "3", 3)]:
        if given is not None:
            env[cluster.INTRAOP_THREADS_VAR] = given
        proc = subprocess.run([*LAUNCHER, "-n", str(workers), REPORT_ENV], env=env,
                              stdin=subprocess.DEVNULL, capture_output=True, text=True, timeout=30)
        assert proc.returncode == 0, proc.stderr
        got = [r["TF_NUM_INTRAOP_THREADS"] for r in _results(tmp_path, workers)]
        assert got == [str(expected)] * workers, (workers, given, got)
    assert [cluster.intraop_threads(c, n) for c, n in [(2, 1), (2, 2), (2, 4), (8, 2), (6, 4)]] \
        == [2, 1, 1, 4, 1]


@pytest.mark.parametrize(
    "visible, argv, expected",
    [
        # One GPU per worker by default where GPUs exist.
        ("0,1,2,3", [], ["0", "1"]),
        ("3,5,7,9", ["--gpus-per-worker", "2"], ["3,5", "7,9"]),
        # 0 disables pinning: each worker inherits the launcher's list.
        ("0,1,2,3", ["--gpus-per-worker", "0"], ["0,1,2,3", "0,1,2,3"]),
        # No GPUs visible: nothing pinned, the (empty) variable is inherited.
        ("", [], ["", ""]),
    ],
    ids=["default-one-each", "two-each", "disabled", "no-gpus"],
)
def test_gpu_pinning_with_a_simulated_device_list(tmp_path, monkeypatch, visible, argv, expected):
    # CUDA_VISIBLE_DEVICES in the launcher's environment stands for the
    # machine's GPUs (the launcher reads /dev/nvidia* only when it is unset).
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", visible)
    proc = _launch(tmp_path, "-n", "2", *argv, REPORT_ENV)

    assert proc.returncode == 0, proc.stderr
    assert [r["CUDA_VISIBLE_DEVICES"] for r in _results(tmp_path, 2)] == expected


def test_more_gpus_than_visible_is_an_argument_error(tmp_path, monkeypatch):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0,1,2")
    proc = _launch(tmp_path, "-n", "2", "--gpus-per-worker", "2", REPORT_ENV)

    assert proc.returncode == 2
    assert "need 4 GPUs but 3 are visible (0,1,2)" in proc.stderr
    assert "Received: gpus_per_worker=2" in proc.stderr
    assert not list(tmp_path.iterdir())


def _read_until(proc, needle, timeout=30):
    """Reads the launcher's stdout (bytes) until `needle` appears; returns it."""
    import select

    data = b""
    deadline = time.monotonic() + timeout
    while needle not in data:
        assert time.monotonic() < deadline, f"never saw {needle!r}; got {data!r}"
        ready, _, _ = select.select([proc.stdout], [], [], 0.1)
        if ready:
            chunk = os.read(proc.stdout.fileno(), 65536)
            assert chunk, f"launcher output ended before {needle!r}; got {data!r}"
            data += chunk
    return data


def test_progress_bars_pass_through_live_chief_only_and_logs_keep_everything(tmp_path):
    go, logs = tmp_path / "go", tmp_path / "logs"
    proc = subprocess.Popen(
        [*LAUNCHER, "-n", "2", "--console-ranks", "all", "--log-dir", str(logs), PROGRESS,
         str(go)],
        env=cluster_env(tmp_path), stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE, stderr=subprocess.PIPE,
    )
    try:
        # The chief's first redraw reaches the console while the bar is
        # unfinished (no newline yet): forwarded as written, not per line.
        early = _read_until(proc, b"\r[rank 0] [bar 1/2 rank 0]")
        go.write_text("go")
        rest, stderr = proc.communicate(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    stdout = (early + rest).decode()

    assert proc.returncode == 0, stderr
    assert "\r[rank 0] [bar 2/2 rank 0]\n" in stdout
    assert "[rank 0] done rank 0\n" in stdout
    assert "[rank 1] done rank 1\n" in stdout
    # Another rank's progress bar stays off the console ...
    assert "bar 1/2 rank 1" not in stdout and "bar 2/2 rank 1" not in stdout
    # ... and every byte is in its log file.
    assert (logs / "rank1.stdout.log").read_bytes() == (
        b"\r[bar 1/2 rank 1]\b\b\r[bar 2/2 rank 1]\ndone rank 1\n"
    )
    assert (logs / "rank0.stderr.log").read_bytes() == b""


def test_console_ranks_and_all_progress(tmp_path):
    go = tmp_path / "go"
    go.write_text("go")
    proc = subprocess.run(  # bytes: text mode would turn '\r' into '\n'
        [*LAUNCHER, "-n", "2", "--console-ranks", "1", "--progress", "all", PROGRESS, str(go)],
        env=cluster_env(tmp_path), stdin=subprocess.DEVNULL, capture_output=True, timeout=30,
    )

    assert proc.returncode == 0, proc.stderr
    assert b"[rank 0]" not in proc.stdout
    assert b"\r[rank 1] [bar 1/2 rank 1]\b\b\r[rank 1] [bar 2/2 rank 1]\n" in proc.stdout
    assert b"[rank 1] done rank 1\n" in proc.stdout


def test_bad_console_ranks(tmp_path):
    proc = _launch(tmp_path, "-n", "2", "--console-ranks", "0,x", REPORT_ENV)

    assert proc.returncode == 2
    assert "--console-ranks must be" in proc.stderr


def test_hosts_flag_says_what_to_do_instead(tmp_path):
    proc = _launch(tmp_path, "-H", "host1,host2", REPORT_ENV)

    assert proc.returncode == 2
    assert "-n is required" not in proc.stderr and "required: -n" not in proc.stderr
    assert "-H/--hosts (starting workers on other hosts over ssh) is not supported" in proc.stderr
    assert "--nnodes N --node-rank K --master-addr HOST --master-port P" in proc.stderr


def test_a_stalled_job_is_restarted_then_given_up(tmp_path):
    # The workers print "ready" and then sleep: no output for 1 s is a stall.
    start = time.monotonic()
    proc = _launch(tmp_path, "-n", "2", "--max-restarts", "1", "--stall-timeout", "2", MISBEHAVE)
    elapsed = time.monotonic() - start

    assert proc.returncode == launch.EXIT_TIMEOUT, proc.stderr
    stall = "no output from any worker for 2 s (--stall-timeout); stopped 2 worker(s)."
    assert proc.stderr.count(stall) == 2, proc.stderr
    assert "restarting the job, attempt 1 of 1 (KERAS_COMM_RESTART_ATTEMPT=1)." in proc.stderr
    assert "no restarts left (--max-restarts 1)." in proc.stderr
    results = _results(tmp_path, 2)
    assert [r["attempt"] for r in results] == ["1", "1"]
    assert elapsed < 2 * (2 + STOP_BUDGET_SECONDS)
    _assert_all_gone([r["pid"] for r in results])


def test_a_failed_worker_restarts_the_job(tmp_path):
    # Without a marker of its own, rank 1 fails on every attempt: two
    # restarts, then the failure's exit code.
    proc = _launch(tmp_path, "-n", "2", "--max-restarts", "2", MISBEHAVE,
                   "--fail-rank", "1", "--exit-code", "5", timeout=60)

    assert proc.returncode == 5, proc.stderr
    assert proc.stderr.count("worker rank 1 failed (exit code 5)") == 3
    assert "attempt 2 of 2" in proc.stderr
    assert [r["attempt"] for r in _results(tmp_path, 2)] == ["2", "2"]


def test_a_port_taken_before_tensorflow_binds_it_is_retried_with_new_ports(tmp_path):
    proc = _launch(tmp_path, "-n", "2", PORT_CLASH, str(tmp_path))

    assert proc.returncode == 0, proc.stderr
    assert "a worker could not bind its port" in proc.stderr
    assert "starting again with new ports (1 of 3)" in proc.stderr
    # Not a restart: the attempt number stays 0.
    assert [r["attempt"] for r in _results(tmp_path, 2)] == ["0", "0"]


# ---------------------------------------------------------------------------
# Several nodes: rendezvous (in-process), then two launchers on this machine.
# ---------------------------------------------------------------------------


def test_rendezvous_agrees_on_nodes_and_refuses_a_duplicate_node_rank():
    import threading

    from keras_comm_run.rendezvous import rendezvous

    port = free_port_block(1)
    answers = {}

    def node(rank, workers):
        try:
            answers[rank] = rendezvous("127.0.0.1", port, 3, rank, workers, timeout=20)
        except ValueError as e:
            answers[rank] = e

    threads = [threading.Thread(target=node, args=(k, k + 1)) for k in (2, 0, 1)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)

    expected = [{"host": "127.0.0.1", "num_workers": k + 1} for k in range(3)]
    assert answers == {0: expected, 1: expected, 2: expected}

    # A second node claiming rank 1 is refused; node 2 then completes the job.
    answers.clear()
    node0 = threading.Thread(target=node, args=(0, 1))
    first = threading.Thread(target=node, args=(1, 1))
    node0.start()
    first.start()
    time.sleep(1.0)
    impostor = {}

    def claim_rank_1_again():
        try:
            rendezvous("127.0.0.1", port, 3, 1, 1, timeout=20)
        except ValueError as e:
            impostor["error"] = str(e)

    t = threading.Thread(target=claim_rank_1_again)
    t.start()
    t.join(30)
    last = threading.Thread(target=node, args=(2, 1))
    last.start()
    for t in (node0, first, last):
        t.join(30)
    assert "rendezvous refused by node 0: two nodes claim --node-rank 1" in impostor["error"]
    assert answers == {k: [{"host": "127.0.0.1", "num_workers": 1}] * 3 for k in range(3)}


def _two_nodes(tmp_path, script, *args, workers=(1, 2), timeout=120, extra=()):
    port = free_port_block(1 + sum(workers))
    procs = []
    for node_rank, n in enumerate(workers):
        procs.append(
            subprocess.Popen(
                [*LAUNCHER, "--nnodes", str(len(workers)), "--node-rank", str(node_rank),
                 "--master-addr", "127.0.0.1", "--master-port", str(port), "-n", str(n),
                 "--timeout", str(timeout), *extra, script, *args],
                env=cluster_env(tmp_path), stdin=subprocess.DEVNULL,
                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
            )
        )
    outputs = []
    try:
        for proc in procs:
            outputs.append(proc.communicate(timeout=timeout + 30))
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.communicate()
    return port, procs, outputs


def test_two_nodes_get_one_consistent_cluster(tmp_path):
    port, procs, outputs = _two_nodes(tmp_path, REPORT_ENV, timeout=60,
                                      extra=("--console-ranks", "all"))

    assert [p.returncode for p in procs] == [0, 0], outputs
    assert "[rank 0] stdout line from rank 0" in outputs[0][0]
    assert "[rank 2] stdout line from rank 2" in outputs[1][0]
    results = _results(tmp_path, 3)
    workers = [f"127.0.0.1:{port + 1 + g}" for g in range(3)]
    for g, r in enumerate(results):
        assert json.loads(r["tf_config"]) == {
            "cluster": {"worker": workers}, "task": {"type": "worker", "index": g}}
        assert r["RANK"] == str(g) and r["WORLD_SIZE"] == "3"
        node = 0 if g == 0 else 1
        assert r["KERAS_COMM_NODE_RANK"] == str(node)
        assert r["LOCAL_RANK"] == str(g - (0 if node == 0 else 1))
        assert r["LOCAL_WORLD_SIZE"] == str([1, 2][node])


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--nnodes", "2", "-n", "1", REPORT_ENV], "--master-port is required with --nnodes"),
        (["--nnodes", "2", "--node-rank", "2", "--master-port", "20000", "--rendezvous-timeout",
          "1", "-n", "1", REPORT_ENV], "Received: --node-rank 2"),
        (["--nnodes", "2", "--master-port", "20000", "--master-addr", "192.0.2.1", "-n", "1",
          REPORT_ENV], "Received: master_addr='192.0.2.1'"),
        (["--nnodes", "2", "--master-port", "20000", "--max-restarts", "1", "-n", "1", REPORT_ENV],
         "not supported with several nodes"),
    ],
    ids=["no-master-port", "node-rank-out-of-range", "non-loopback-master", "restarts"],
)
def test_bad_several_node_arguments(tmp_path, argv, message):
    proc = _launch(tmp_path, *argv)

    assert proc.returncode == 2
    assert message in proc.stderr
    assert not list(tmp_path.iterdir())


def test_two_nodes_run_a_tensorflow_all_reduce(tmp_path):
    _, procs, outputs = _two_nodes(tmp_path, str(SCRIPTS / "tf_all_reduce.py"), workers=(1, 1))

    assert [p.returncode for p in procs] == [0, 0], outputs
    want = {"num_replicas": 2, "sum_ones": 2.0, "sum_ids": 3.0}
    # Node 0's chief waited at the exit barrier for node 1's late worker.
    assert _results(tmp_path, 2) == [want, {**want, "late": "still here"}]


# ---------------------------------------------------------------------------
# A restart resumes training exactly (real TensorFlow workers).
# ---------------------------------------------------------------------------


def test_max_restarts_resumes_fit_to_the_uninterrupted_weights(tmp_path):
    # Rank 1 SIGKILLs itself at global step 18 of 24 on the first attempt;
    # the launcher restarts the job, which resumes from BackupAndRestore
    # (after step 15) and then trains the same model uninterrupted to compare.
    # The workers are forked from a launcher that preloaded TensorFlow, Keras
    # and keras_comm (run_cluster's default), so the restart forks again;
    # test_launch_slurm.py resumes exactly with new interpreters.
    started = time.monotonic()
    result = run_cluster(
        "callbacks/checkpoint_worker.py", 2, tmp_path, "plain",
        timeout=300, launcher_args=["--max-restarts", "1"],
    ).check()
    seconds = time.monotonic() - started

    assert "worker rank 1 failed (killed by SIGKILL); stopped the other 1 worker(s)." in (
        result.output)
    assert "restarting the job, attempt 1 of 1 (KERAS_COMM_RESTART_ATTEMPT=1)." in result.output
    kill = json.loads((tmp_path / "killed-plain").read_text())
    assert kill["step"] == 18
    for rank, r in enumerate(result.results):
        c = r["results"]["plain"]
        assert r["rank"] == rank and r["world"] == 2
        assert c["max_rel"] == 0.0, c
        assert c["optimizer_max_rel"] == 0.0, c
        assert c["restored"] == {"epoch": 1, "step": 3}
        assert c["trained_after_restore"] == 24 - 15
    print(f"restart test: {seconds:.1f} s for both attempts; results {result.results}")


# ---------------------------------------------------------------------------
# Stopping never reaches a process group that is no longer the job's.
# ---------------------------------------------------------------------------


def _job(commands_env, console):
    from keras_comm_run import output, supervisor

    state = output.Console.new_state()
    view = supervisor._View(
        output.Console(console, state), output.Console(console, state), True, None, "all", None
    )
    command, envs = commands_env
    return supervisor._Job(command, envs, list(range(len(envs))), view)


def test_stop_skips_the_group_of_a_worker_reaped_long_ago(tmp_path, monkeypatch):
    # Worker 0 exits at once and leaves nothing behind: its pid (its group's
    # id) is free for the kernel to reuse, so a later stop must not signal it.
    script = tmp_path / "w.py"
    script.write_text(
        "import os, sys, time\n"
        "if os.environ['RANK'] == '1': time.sleep(60)\n"
    )
    envs = [dict(os.environ, RANK=str(r)) for r in range(2)]
    console = io.StringIO()
    job = _job(([sys.executable, str(script)], envs), console)
    sent = []
    real_killpg = os.killpg

    def recording_killpg(pgid, signum):
        sent.append((pgid, signum))
        return real_killpg(pgid, signum)

    try:
        job.procs[0].wait(timeout=30)
        deadline = time.monotonic() + 5
        while time.monotonic() < deadline:  # the supervisor's poll loop, as it runs
            job.note_exits()
            time.sleep(0.05)
        monkeypatch.setattr(os, "killpg", recording_killpg)
        job.stop(signal.SIGTERM, grace=2.0)
    finally:
        monkeypatch.setattr(os, "killpg", real_killpg)
        job.stop(signal.SIGKILL, grace=0.0)
        job.drain()

    reaped, running = job.procs[0].pid, job.procs[1].pid
    assert [s for pgid, s in sent if pgid == reaped and s != 0] == []
    assert (running, signal.SIGTERM) in sent
    assert job.procs[1].returncode == -signal.SIGTERM


def test_stop_still_kills_what_an_exited_worker_left_behind(tmp_path):
    # Worker 0 exits 0 but leaves a child in its process group: the group
    # still exists (its id cannot be reused), and the job's stop kills it.
    script = tmp_path / "w.py"
    script.write_text(
        "import subprocess, sys\n"
        "child = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)'])\n"
        "print('child', child.pid, flush=True)\n"
    )
    console = io.StringIO()
    job = _job(([sys.executable, str(script)], [dict(os.environ)]), console)
    try:
        job.procs[0].wait(timeout=30)
        deadline = time.monotonic() + 10
        while "child" not in console.getvalue() and time.monotonic() < deadline:
            time.sleep(0.05)
        child = int(console.getvalue().split("child ")[1].split()[0])
        job.note_exits()
        assert _alive(child)
        job.stop(signal.SIGTERM, grace=2.0)
    finally:
        job.stop(signal.SIGKILL, grace=0.0)
        job.drain()

    _assert_all_gone([child])


def _make_two_hosts(tag):
    """Two network namespaces joined by a veth pair: 10.77.<x>.1 and .2, or None."""
    import shutil as _shutil

    if os.geteuid() != 0 or not _shutil.which("ip"):
        return None
    names = [f"kc{tag}a", f"kc{tag}b"]
    subnet = f"10.77.{tag % 250}"
    steps = [
        ["ip", "netns", "add", names[0]],
        ["ip", "netns", "add", names[1]],
        ["ip", "link", "add", f"v{tag}a", "netns", names[0], "type", "veth",
         "peer", "name", f"v{tag}b", "netns", names[1]],
        ["ip", "-n", names[0], "addr", "add", f"{subnet}.1/24", "dev", f"v{tag}a"],
        ["ip", "-n", names[1], "addr", "add", f"{subnet}.2/24", "dev", f"v{tag}b"],
        ["ip", "-n", names[0], "link", "set", f"v{tag}a", "up"],
        ["ip", "-n", names[1], "link", "set", f"v{tag}b", "up"],
        ["ip", "-n", names[0], "link", "set", "lo", "up"],
        ["ip", "-n", names[1], "link", "set", "lo", "up"],
    ]
    for step in steps:
        if subprocess.run(step, capture_output=True).returncode != 0:
            _remove_hosts(names)
            return None
    return names, [f"{subnet}.1", f"{subnet}.2"]


def _remove_hosts(names):
    for name in names:
        subprocess.run(["ip", "netns", "del", name], capture_output=True)


def test_two_network_namespaces_as_two_hosts(tmp_path):
    hosts = _make_two_hosts(os.getpid() % 10000)
    if hosts is None:
        pytest.skip("needs root and `ip netns` (network namespaces) on this machine")
    names, addresses = hosts
    procs = []
    try:
        procs += [
            subprocess.Popen(
                ["ip", "netns", "exec", name, *LAUNCHER, "--nnodes", "2", "--node-rank", str(k),
                 "--master-addr", addresses[0], "--master-port", "29500",
                 "--allow-non-loopback", "-n", "2", "--timeout", "60", REPORT_ENV],
                env=cluster_env(tmp_path), stdin=subprocess.DEVNULL,
                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
            )
            for k, name in enumerate(names)
        ]
        outputs = [p.communicate(timeout=90) for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
        _remove_hosts(names)

    assert [p.returncode for p in procs] == [0, 0], outputs
    # Node 1's address is the one node 0 saw its report come from.
    workers = [f"{addresses[0]}:29501", f"{addresses[0]}:29502",
               f"{addresses[1]}:29503", f"{addresses[1]}:29504"]
    for g, r in enumerate(_results(tmp_path, 4)):
        assert json.loads(r["tf_config"])["cluster"]["worker"] == workers
        assert (r["RANK"], r["LOCAL_RANK"], r["KERAS_COMM_NODE_RANK"]) == (
            str(g), str(g % 2), str(g // 2))


@pytest.mark.parametrize("preload", [False, True], ids=["new-interpreters", "preloaded"])
def test_a_tensorflow_worker_stops_promptly_after_its_cleanup(tmp_path, preload):
    # MWMS's coordination service installs a C-level SIGTERM handler that
    # only records the signal; the launcher's bootstrap still turns the
    # stop into SystemExit, so `finally` and atexit run, within 2 s; the
    # same in workers forked from a launcher that preloaded TensorFlow.
    result = run_cluster("launcher/tf_stop.py", 2, timeout=180, out_dir=tmp_path, preload=preload)

    assert result.returncode == 3, result.tail()
    assert "worker rank 1 failed (exit code 3); stopped the other 1 worker(s)." in result.output
    assert result.results[0]["replicas"] == 2
    failed = json.loads((tmp_path / "failed.json").read_text())["time"]
    cleaned = json.loads((tmp_path / "finally.json").read_text())["time"]
    exited = json.loads((tmp_path / "atexit.json").read_text())["time"]
    print(f"stop: finally {cleaned - failed:.2f} s, atexit {exited - failed:.2f} s after the failure")
    assert failed < cleaned <= exited < failed + 2.0
    _assert_all_gone([result.results[0]["pid"]])


def test_bootstrap_runs_scripts_and_modules_like_python(tmp_path):
    script = tmp_path / "s.py"
    script.write_text(
        "import json, os, sys\n"
        "print(json.dumps({'argv': sys.argv, 'path0': sys.path[0], 'name': __name__,\n"
        "                  'file': __file__}))\n"
    )
    from keras_comm_run import bootstrap

    proc = subprocess.run(bootstrap.command(sys.executable, [str(script), "-x", "--", "y"]),
                          capture_output=True, text=True, timeout=30)
    got = json.loads(proc.stdout)
    assert got == {"argv": [str(script), "-x", "--", "y"], "path0": str(tmp_path),
                   "name": "__main__", "file": str(script)}

    proc = subprocess.run(bootstrap.command(sys.executable, ["-m", "s", "a"]), cwd=tmp_path,
                          capture_output=True, text=True, timeout=30)
    got = json.loads(proc.stdout)
    assert got["argv"] == [str(script), "a"] and got["path0"] == str(tmp_path)
    assert got["name"] == "__main__"

    proc = subprocess.run(bootstrap.command(sys.executable, [str(tmp_path / "missing.py")]),
                          capture_output=True, text=True, timeout=30)
    assert proc.returncode != 0 and "missing.py" in proc.stderr


def test_a_hidden_progress_bar_never_breaks_the_chiefs_line():
    # Deterministic: the two forwarders fed by hand in a fixed order.
    from keras_comm_run import output

    console = io.StringIO()
    state = output.Console.new_state()
    chief, other = (
        output.Forwarder(None, output.Console(console, state), f"[rank {r}] ", redraws=r == 0)
        for r in (0, 1)
    )
    chief._feed("Epoch 1/2\n\r1/8 ==")
    other._feed("\r1/8 ==")  # hidden: must not end the chief's open bar
    chief._feed("\b\b\r8/8 ====")
    other._feed("\b\b\r8/8 ====\nplain line\n")  # shown: ends the bar first
    chief._feed(" loss: 0\n")

    assert console.getvalue() == (
        "[rank 0] Epoch 1/2\n\r[rank 0] 1/8 ==\b\b\r[rank 0] 8/8 ====\n"
        "[rank 1] plain line\n[rank 0]  loss: 0\n"
    )
