"""Failures: fail fast and clearly, never hang; trust nothing from outside.

Multi-process scenarios run tests/acceptance/reliability_worker.py (three
cluster launches); the rest are fast checks of the launcher's refusals,
TF_CONFIG validation, error translation and a static scan of the package.
"""

import ast
import json
import os
import signal
import subprocess
import time
from pathlib import Path

import keras
import numpy as np
import pytest
import tensorflow as tf

import keras_comm
from keras_comm import errors
from keras_comm import launch
from keras_comm import topology

from _cluster import LAUNCHER, TESTS_DIR, cluster_env, run_cluster

WORKER = "acceptance/reliability_worker.py"
TIMEOUT = 3.0  # reliability_worker.TIMEOUT
PACKAGE = Path(keras_comm.__file__).resolve().parent


# ---------------------------------------------------------------------------
# Multi-process scenarios.
# ---------------------------------------------------------------------------


@pytest.mark.multiprocess
def test_stalled_peer_in_fit_is_an_error_on_every_live_worker():
    # 3 workers; rank 2 stops participating at batch 2 of model.fit.
    start = time.monotonic()
    result = run_cluster(WORKER, 3, "timeout", timeout=120)
    elapsed = time.monotonic() - start
    assert elapsed < 100, result.tail()
    assert result.results[2] == {"stalled_at_batch": 2}, result.tail()
    for rank in (0, 1):
        r = result.results[rank]
        if r is None:
            # TF 2.21 sometimes crashes (SIGABRT "Mutex corrupt", or SIGSEGV) while
            # aborting a timed-out ring: still not a hang; the launcher names it.
            assert "worker rank" in result.output and "failed" in result.output, result.tail()
            assert result.returncode != 0
            continue
        error = r["error"]
        assert error is not None, r
        assert error["type"] == "DeadlineExceededError"
        assert error["seconds"] < TIMEOUT + 10, error
        # model.fit's steps run under keras_comm's watchdog (no per-op TF
        # timeout threads): it names the step and the layer it traced.
        assert error["message"].startswith(
            "keras_comm: the model's train_step did not finish within 3 s"
        ), error
        assert "layer 'grad_sync_probe' (all_reduce over group [0, 1, 2]" in error["message"]
        assert "timed out" in error["message"]
        assert "TensorFlow's error:" in error["message"]  # TF's text kept
    assert any(r is not None and r.get("error") for r in result.results[:2]), result.tail()


@pytest.mark.multiprocess
def test_a_collective_that_cannot_complete_in_predict_is_keras_comms_timeout_error():
    # 2 workers; only rank 0 issues one of the model's all-reduces. Rank 0
    # waits in it (no TF timeout: the step's guard covers it); rank 1 waits in
    # the strategy's own gather of the outputs, which carries TF's per-op
    # timeout (communication_options) and may fire first with TF's text.
    result = run_cluster(WORKER, 2, "predict", timeout=120)
    if result.results[0] is None:
        # As above: TF may crash while aborting a timed-out ring; not a hang.
        assert "worker rank" in result.output and "failed" in result.output, result.tail()
        return
    for rank in (0, 1):
        r = result.results[rank]
        if r is not None:
            error = r["error"]
            assert error is not None and error["type"] == "DeadlineExceededError", (rank, r)
            assert error["seconds"] < TIMEOUT + 30, (rank, error)  # includes tracing
    message = result.results[0]["error"]["message"]
    assert message.startswith("keras_comm: the model's predict_step did not finish within 3 s"), message
    assert "layer 'one_sided' (all_reduce over group [0, 1]" in message, message


@pytest.mark.multiprocess
def test_mismatched_calls_are_named_on_both_ranks_and_eager_timeout():
    result = run_cluster(WORKER, 2, "mismatch", timeout=150).check()
    expected = {
        "shape": "rank 0: layer ar all_reduce Add, float32[2] | "
                 "rank 1: layer ar all_reduce Add, float32[3]",
        "dtype": "rank 0: layer ar_op all_reduce Add, float32[2] | "
                 "rank 1: layer ar_op all_reduce Add, float64[2]",
        "order": "rank 0: layer ar all_reduce Add, float32[2] | "
                 "rank 1: layer ar_max all_reduce Max, float32[2]",
    }
    for rank, r in enumerate(result.results):
        for scenario, sides in expected.items():
            error = r[scenario]["error"]
            assert error is not None, (rank, scenario, r[scenario])
            assert error["type"] == "InvalidArgumentError"
            assert "keras_comm: ranks called mismatched collectives" in error["message"]
            assert sides in error["message"], (rank, scenario, error["message"])
        # The check runs before the collective: the process still works.
        assert r["matching"] == {"error": None, "value": [[3.0, 3.0]]}
        cost = r["seconds_per_collective"]
        assert cost["checked"] < 20 * cost["unchecked"] + 0.05, cost
    error = result.results[0]["eager_timeout"]["error"]
    assert error["type"] == "DeadlineExceededError"
    assert error["seconds"] < TIMEOUT + 10
    assert (
        "keras_comm: collective of layer 'eager_probe' (all_reduce over group [0, 1], "
        "timeout 3 s, seen on rank 0) timed out" in error["message"]
    ), error["message"]


@pytest.mark.multiprocess
def test_sigkilled_worker_stops_the_job_naming_the_rank(tmp_path):
    start = time.monotonic()
    result = run_cluster(WORKER, 2, "crash", timeout=120, out_dir=tmp_path)
    end = time.time()
    assert time.monotonic() - start < 110
    assert result.returncode == 128 + 9, result.tail()
    assert "keras-comm-run: worker rank 1 failed (killed by SIGKILL)" in result.output
    assert result.results == [None, None]  # fit never finished anywhere
    killed_at = json.loads((tmp_path / "killed_at.json").read_text())["time"]
    # Launcher exit, measured from the kill (includes output draining).
    assert end - killed_at < 30, end - killed_at


# ---------------------------------------------------------------------------
# Launcher and TF_CONFIG: untrusted input from outside.
# ---------------------------------------------------------------------------


def _launch(tmp_path, *argv):
    return subprocess.run(
        [*LAUNCHER, *argv], env=cluster_env(tmp_path), stdin=subprocess.DEVNULL,
        capture_output=True, text=True, timeout=30,
    )


SCRIPT = str(TESTS_DIR / "launcher" / "report_env.py")


@pytest.mark.parametrize(
    "argv, message",
    [
        (["-n", "0", SCRIPT], "-n must be >= 1"),
        (["-n", "x", SCRIPT], "invalid int value"),
        (["-n", "2", "--timeout", "-1", SCRIPT], "--timeout must be > 0"),
        (["-n", "2", "--base-port", "65535", SCRIPT], "--base-port must be 0"),
        (["-n", "2", "/no/such/script.py"], "script must be an existing file"),
        (["-n", "2"], "a script (or -m module) to run is required"),
        (["-n", "2", "--host", "8.8.8.8", SCRIPT], "refusing to run the TensorFlow cluster"),
        (["-n", "2", "--host", "no such host", SCRIPT], "`host` must be"),
    ],
)
def test_launcher_rejects_bad_arguments(tmp_path, argv, message):
    proc = _launch(tmp_path, *argv)
    assert proc.returncode == launch.EXIT_USAGE, proc.stderr
    assert message in proc.stderr
    assert not list(tmp_path.glob("rank*.json"))  # nothing was started


def test_launcher_defaults_to_loopback_and_refuses_public_bind_in_python():
    assert launch.run.__kwdefaults__["host"] == "127.0.0.1"
    assert launch.run.__kwdefaults__["allow_non_loopback"] is False
    with pytest.raises(launch.LaunchError, match="unauthenticated"):
        launch.run([SCRIPT], 1, host="8.8.8.8")
    # The explicit opt-in passes the check (nothing is started here).
    assert launch._check_host("8.8.8.8", allow_non_loopback=True) == ["8.8.8.8"]


@pytest.mark.parametrize(
    "text, message",
    [
        ("{", "not valid JSON"),
        ("[1]", "must be a JSON object"),
        ('{"task": {"type": "worker", "index": 0}}', 'needs "cluster"'),
        ('{"cluster": {"worker": []}, "task": {}}', "non-empty list"),
        ('{"cluster": {"worker": ["a"]}, "task": {}}', '"host:port"'),
        ('{"cluster": {"worker": ["a:1"]}}', 'needs "task"'),
        ('{"cluster": {"worker": ["a:1"]}, "task": {"type": "chief", "index": 0}}',
         "must be one of ['worker']"),
        ('{"cluster": {"worker": ["a:1", "b:2"]}, "task": {"type": "worker", "index": 2}}',
         "int in 0..1"),
        ('{"cluster": {"worker": ["a:1"]}, "task": {"type": "worker", "index": "0"}}',
         "int in 0..0"),
    ],
)
def test_malformed_tf_config_is_a_clear_error(text, message):
    with pytest.raises(ValueError, match="TF_CONFIG") as info:
        topology.validate_tf_config(text)
    assert message in str(info.value)
    assert "Received: TF_CONFIG=" in str(info.value)


def test_tf_config_from_environment(monkeypatch):
    monkeypatch.delenv("TF_CONFIG", raising=False)
    assert topology.validate_tf_config() is None
    good = launch.tf_config(["127.0.0.1:1", "127.0.0.1:2"], 1)
    monkeypatch.setenv("TF_CONFIG", json.dumps(good))
    assert topology.validate_tf_config() == good
    monkeypatch.setenv("TF_CONFIG", '{"cluster": ')
    with pytest.raises(ValueError, match="not valid JSON"):
        topology.validate_tf_config()


# ---------------------------------------------------------------------------
# Settings and error translation (no cluster).
# ---------------------------------------------------------------------------


def test_timeout_is_finite_by_default_and_validated():
    assert 0 < keras_comm.get_timeout() < float("inf")
    for bad in (0, -1, float("inf"), float("nan")):
        with pytest.raises(ValueError, match="Received: seconds="):
            keras_comm.set_timeout(bad)
    with pytest.raises(TypeError, match="Received: seconds="):
        keras_comm.set_timeout("10")
    options = keras_comm.communication_options()
    assert options.timeout_seconds == keras_comm.get_timeout()


def test_check_calls_setting():
    assert keras_comm.get_check_calls() is False
    with pytest.raises(TypeError, match="Received: enabled=1"):
        keras_comm.set_check_calls(1)
    keras_comm.set_check_calls(True)
    try:
        assert keras_comm.get_check_calls() is True
    finally:
        keras_comm.set_check_calls(False)


def test_translate_names_layer_and_group_from_node_name():
    errors.record(errors.CollectiveInfo("probe_layer_all_gather", "probe_layer",
                                        "all_gather", (0, 2), 7.0, 2))
    original = tf.errors.DeadlineExceededError(
        None, None,
        "Collective has timed out during execution.\n\t [[{{node "
        "functional/probe_layer_1/probe_layer_all_gather_3}}]] [Op:__inference_f_9]",
    )
    new = errors.translate(original)
    assert isinstance(new, tf.errors.DeadlineExceededError)
    assert new.message.startswith(
        "keras_comm: collective of layer 'probe_layer' (all_gather over group [0, 2], "
        "timeout 7 s, seen on rank 2) timed out"
    )
    assert "Collective has timed out during execution." in new.message
    assert errors.translate(new) is new  # once only
    unrelated = tf.errors.InvalidArgumentError(None, None, "bad shape")
    assert errors.translate(unrelated) is unrelated
    assert errors.translate(ValueError("x")).args == ("x",)

    with pytest.raises(tf.errors.DeadlineExceededError, match="probe_layer") as info:
        with errors.collective_errors():
            raise original
    assert info.value.__cause__ is original


# ---------------------------------------------------------------------------
# Nothing deserialises untrusted input.
# ---------------------------------------------------------------------------

_FORBIDDEN_MODULES = {"pickle", "cPickle", "_pickle", "marshal", "shelve", "dill", "cloudpickle"}
_FORBIDDEN_CALLS = {"eval", "exec", "compile", "__import__"}


def test_package_source_has_no_pickle_marshal_or_eval():
    problems = []
    for path in sorted(PACKAGE.rglob("*.py")):
        tree = ast.parse(path.read_text(), filename=str(path))
        for node in ast.walk(tree):
            where = f"{path.relative_to(PACKAGE.parent)}:{getattr(node, 'lineno', '?')}"
            if isinstance(node, ast.Import):
                names = {a.name.split(".")[0] for a in node.names}
            elif isinstance(node, ast.ImportFrom):
                names = {(node.module or "").split(".")[0]}
            else:
                names = set()
            if names & _FORBIDDEN_MODULES:
                problems.append(f"{where} imports {sorted(names & _FORBIDDEN_MODULES)}")
            if isinstance(node, ast.Call):
                fn = node.func
                name = fn.id if isinstance(fn, ast.Name) else getattr(fn, "attr", None)
                if isinstance(fn, ast.Name) and name in _FORBIDDEN_CALLS:
                    problems.append(f"{where} calls {name}()")
                if name in ("load", "loads") and isinstance(fn, ast.Attribute) and \
                        getattr(fn.value, "id", None) in ("yaml", "np", "numpy"):
                    problems.append(f"{where} calls {fn.value.id}.{name}()")
    assert not problems, problems
    assert len(list(PACKAGE.rglob("*.py"))) > 20  # the scan saw the package


# ---------------------------------------------------------------------------
# A preemption notice (SIGTERM) saves a backup first: in one process here,
# on real workers in test_preemption_backup_on_real_workers.
# ---------------------------------------------------------------------------


@pytest.mark.inprocess
def test_sigterm_saves_a_backup_then_stops_and_the_restart_is_exact(tmp_path):
    from conftest import make_strategy
    from _shared import SigtermAt, resume_dataset, resume_model

    strategy = make_strategy(2)
    reference = resume_model(strategy)
    reference.fit(resume_dataset(4, 4), epochs=2, verbose=0)
    before = signal.getsignal(signal.SIGTERM)
    # 4 steps per epoch. A notice during global step g is taken at the next
    # boundary (g + 1 steps done): every worker saves after step g + 2.
    cases = {"mid-step": ((0, 1), "ckpt-0-3"), "between-epochs": ((0, None), "ckpt-1-1"),
             "last-step": ((1, 2), "ckpt-2-0")}
    for name, (at, saved) in cases.items():
        backup_dir = str(tmp_path / name)
        model = resume_model(strategy)
        backup = keras_comm.callbacks.BackupAndRestore(
            backup_dir, save_freq=False, save_before_preemption=True)
        with pytest.raises(SystemExit) as info:
            model.fit(resume_dataset(4, 4), epochs=2, verbose=0,
                      callbacks=[backup, SigtermAt(backup, *at)])
        assert info.value.code == 143, name
        assert signal.getsignal(signal.SIGTERM) == before, name  # handed back
        assert sorted(p for p in os.listdir(backup_dir) if p.startswith("ckpt")) == [
            f"{saved}.json", f"{saved}.weights.h5"], name

        model = resume_model(strategy)
        backup = keras_comm.callbacks.BackupAndRestore(backup_dir, save_before_preemption=True)
        model.fit(resume_dataset(4, 4), epochs=2, verbose=0, callbacks=[backup])
        epoch, step = (int(p) for p in saved.split("-")[1:])
        assert backup.restored == {"epoch": epoch, "step": step}, name
        for a, b in zip(model.get_weights(), reference.get_weights()):
            assert np.array_equal(a, b), name  # difference 0.0
        assert signal.getsignal(signal.SIGTERM) == before, name


@pytest.mark.multiprocess
def test_preemption_backup_on_real_workers(tmp_path):
    # One launch, three attempts (--max-restarts 2); reliability_worker.PREEMPT_CASES:
    # worker 1 signalled mid-step, then both workers between epochs (as a
    # launcher's stop does; either may lead), then two SIGTERMs to worker 1.
    result = run_cluster(WORKER, 2, "preempt", tmp_path / "state", timeout=600,
                         out_dir=tmp_path / "out", launcher_args=["--max-restarts", "2"])
    end = time.time()
    output = result.output
    assert output.count("restarting the job") == 2, result.tail()
    saved = {0: "ckpt-0-4", 1: "ckpt-1-2"}
    for rank, r in enumerate(result.results):
        assert r is not None and r["attempt"] == 2, (rank, result.tail())
        for case, name in saved.items():
            resumed = r["resumed"][str(case)]
            # Only the agreed step's backup, complete (weights and record).
            assert [f for f in resumed["files"] if f.startswith("ckpt")] == [
                f"{name}.json", f"{name}.weights.h5"], (rank, case, resumed)
            epoch, step = (int(p) for p in name.split("-")[1:])
            assert resumed["restored"] == {"epoch": epoch, "step": step}, (rank, case)
            assert resumed["max_abs_diff"] == 0.0, (rank, case, resumed)
    # Every worker said what it saved, in each case.
    for name in saved.values():
        epoch, step = name.split("-")[1:]
        text = f"every worker saved the backup of epoch {epoch}, step {step}"
        assert output.count(text) == 2, (text, result.tail())
    assert output.count("stopping with exit status 143. Run the job again") == 4
    assert "SIGTERM to worker 1)" in output  # case 0's leader, named on both workers
    # Last: two SIGTERMs to worker 1 stop it at once (no backup); the job ends
    # promptly (its peer is stopped by the launcher, 5 s grace at most).
    assert result.returncode == 143, result.tail()
    assert "no restarts left" in output
    signalled = json.loads((tmp_path / "state" / "signalled2_rank1.json").read_text())["time"]
    assert end - signalled < 20, end - signalled
    assert not (tmp_path / "state" / "double").exists() or not any(
        p.name.endswith(".json") and p.name.startswith("ckpt")
        for p in (tmp_path / "state" / "double").iterdir())


class _FakeStore:
    """The coordination service's key-value store, in one process."""

    def __init__(self):
        import threading

        self.values, self.cv = {}, threading.Condition()

    def insert(self, key, value):
        with self.cv:
            if key in self.values:
                raise tf.errors.AlreadyExistsError(None, None, key)
            self.values[key] = value
            self.cv.notify_all()

    def get(self, key, timeout_seconds=None):
        with self.cv:
            if not self.cv.wait_for(lambda: key in self.values, timeout_seconds):
                raise tf.errors.DeadlineExceededError(None, None, key)
            return self.values[key]


def test_preemption_agreement_leader_follower_and_a_dead_peer(capfd):
    from keras_comm.callbacks import _preemption

    # Two workers, both signalled: the first insert leads, the other follows
    # (through its watcher thread), and both save after the leader's step + 1.
    store = _FakeStore()
    watches = [_preemption.Watch(object(), store=store, task=t, num_workers=2) for t in (0, 1)]
    for w in watches:
        w._prefix = watches[0]._prefix  # one per fit, the same on every worker
        w._watcher = __import__("threading").Thread(target=w._watch, daemon=True)
        w._watcher.start()
        w.noticed.set()
    watches[1].before_step(5)  # leads: waits until both watchers acknowledged
    assert store.values[watches[1]._key("step")] == "6 1"
    watches[0].before_step(4)  # refused: it follows
    for w in watches:
        w._watcher.join(5)
        assert (w.target, w.leader) == (6, 1)
        assert not w.due(5) and w.due(6)
    for w in watches:
        w.close()

    # A peer that died never acknowledges: the leader stops within the
    # collective timeout, saying why, instead of waiting forever.
    previous = keras_comm.get_timeout()
    keras_comm.set_timeout(0.5)
    try:
        watch = _preemption.Watch(object(), store=_FakeStore(), task=0, num_workers=2)
        watch.noticed.set()
        start = time.monotonic()
        with pytest.raises(SystemExit) as info:
            watch.before_step(3)
        assert time.monotonic() - start < 5
    finally:
        keras_comm.set_timeout(previous)
    assert info.value.code == 143
    err = capfd.readouterr().err
    assert "worker(s) [0, 1] did not acknowledge the step to save at within 0.5 s" in err
    assert "No preemption backup was saved; stopping (exit status 143)." in err


def test_save_before_preemption_arguments(tmp_path):
    with pytest.raises(ValueError, match="needs `save_before_preemption=True`.*Received: save_freq=False"):
        keras_comm.callbacks.BackupAndRestore(str(tmp_path), save_freq=False)
    with pytest.raises(TypeError, match="Received: save_before_preemption=1"):
        keras_comm.callbacks.BackupAndRestore(str(tmp_path), save_before_preemption=1)
    keras_comm.callbacks.BackupAndRestore(str(tmp_path), save_freq=False, save_before_preemption=True)
