"""keras_comm.watchdog: the collective timeout without TensorFlow's per-op threads.

TensorFlow's per-op collective timeout starts threads that live for the whole
timeout. These tests measure thread counts (/proc/self/status) to show the
guarded paths start none, check which timeout each traced collective gets,
and run a real abort in a subprocess (an abort stops every later collective
of the process, so it cannot run in the test process).
"""

import json
import subprocess
import sys
import textwrap
import warnings

import keras
import numpy as np
import pytest
import tensorflow as tf

import keras_comm
from keras_comm import errors
from keras_comm import layers as kc_layers
from keras_comm import ops as kc_ops
from keras_comm import watchdog
from conftest import make_strategy
from _cluster import REPO_DIR


def _threads():
    with open("/proc/self/status") as f:
        return int(next(line for line in f if line.startswith("Threads:")).split()[1])


def _timeouts(fn):
    graph = tf.function(fn).get_concrete_function().graph
    return sorted(
        op.get_attr("timeout_seconds")
        for op in graph.get_operations()
        if op.type == "CollectiveReduceV2"
    )


@pytest.mark.inprocess
def test_guarded_steps_start_no_threads_unguarded_do():
    strategy = make_strategy(2)
    # An explicit short timeout, so the threads TF starts die soon after the test.
    unguarded = tf.function(lambda: strategy.run(lambda: kc_ops.all_reduce(tf.ones([2]), timeout=5)))
    guarded = tf.function(lambda: strategy.run(lambda: kc_ops.all_reduce(tf.ones([2]))))
    with watchdog.guard("warm-up"):
        guarded()
    unguarded()

    before = _threads()
    for _ in range(40):
        with watchdog.guard("probe"):
            guarded()
    grew_guarded = _threads() - before

    before = _threads()
    for _ in range(40):
        unguarded()
    grew_unguarded = _threads() - before

    assert grew_guarded <= 2, grew_guarded
    # TF: 2 threads per collective per replica, alive for the timeout.
    assert grew_unguarded >= 80, grew_unguarded


@pytest.mark.inprocess
def test_fit_and_eager_collectives_start_no_threads():
    strategy = make_strategy(2)
    with strategy.scope():
        model = keras.Sequential(
            [keras.Input((4,)), keras.layers.Dense(4), kc_layers.AllReduce(), keras.layers.Dense(1)]
        )
        model.compile("sgd", "mse")
    x = np.ones((160, 4), "float32")
    model.fit(x, x[:, :1], batch_size=4, epochs=1, verbose=0)
    before = _threads()
    model.fit(x, x[:, :1], batch_size=4, epochs=1, verbose=0)  # 40 steps
    for _ in range(10):
        strategy.run(lambda: kc_ops.all_reduce(tf.ones([2])))
    assert _threads() - before <= 2


@pytest.mark.inprocess
def test_which_timeout_a_traced_collective_gets():
    strategy = make_strategy(2)

    def step():
        a = kc_ops.all_reduce(tf.ones([2]))  # default timeout
        b = kc_ops.all_reduce(tf.ones([2]), timeout=7.0)  # explicit
        return a + b

    unguarded = _timeouts(lambda: strategy.run(step))
    with watchdog.guard("probe"):
        guarded = _timeouts(lambda: strategy.run(step))
    default = keras_comm.get_timeout()
    assert unguarded == sorted([default, default, 7.0, 7.0])
    assert guarded == [0.0, 0.0, 7.0, 7.0]  # 0: no TF timeout, the guard's deadline


def test_message_names_the_call_and_its_layers():
    site = watchdog.Site("the model's train_step")
    infos = [
        errors.CollectiveInfo(f"l{i}_all_reduce", f"l{i}", "all_reduce", (0, 1), 30.0, 0)
        for i in range(10)
    ]
    with watchdog.guard(site):
        for info in infos + infos[:2]:
            watchdog.note(info)
    text = watchdog.message(site, 30)
    assert text.startswith("keras_comm: the model's train_step did not finish within 30 s")
    assert "layer 'l0' (all_reduce over group [0, 1], timeout 30 s, seen on rank 0)" in text
    assert "layer 'l7'" in text and "layer 'l8'" not in text and "and 2 more" in text
    assert "set_timeout" in text and "restart the job" in text
    assert not watchdog.covers()


def test_guard_rejects_a_bad_timeout():
    with pytest.raises(ValueError, match="Received: timeout=0"):
        with watchdog.guard("x", timeout=0):
            pass
    assert not watchdog.covers()


_LONELY = textwrap.dedent(
    """
    import json, sys, time
    import tensorflow as tf
    import keras_comm
    from tensorflow.python.ops import collective_ops

    cpu = tf.config.list_physical_devices("CPU")[0]
    tf.config.set_logical_device_configuration(cpu, [tf.config.LogicalDeviceConfiguration()] * 2)

    @tf.function
    def lonely():  # a 2-member all-reduce whose second member never comes
        with tf.device("CPU:0"):
            return collective_ops.all_reduce_v2(
                tf.ones([2]), group_size=2, group_key=7, instance_key=1, name="probe_all_reduce")

    start = time.time()
    try:
        with keras_comm.watchdog.guard("the lonely step", timeout=1.5):
            lonely()
        out = {"error": None}
    except tf.errors.OpError as e:
        out = {"type": type(e).__name__, "message": e.message, "seconds": time.time() - start}
    print(json.dumps(out))
    """
)


def test_a_hung_call_is_aborted_with_deadline_exceeded():
    proc = subprocess.run(
        [sys.executable, "-c", _LONELY],
        cwd=REPO_DIR, capture_output=True, text=True, timeout=120,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert out["type"] == "DeadlineExceededError", out
    assert 1.4 < out["seconds"] < 15, out
    assert out["message"].startswith(
        "keras_comm: the lonely step did not finish within 1.5 s (keras_comm's collective timeout)"
    ), out
    assert "TensorFlow's error:" in out["message"]
    # stderr says where the host waited: the main thread in the compiled call.
    dump = proc.stderr.partition("keras_comm: thread 'MainThread' at the timeout:")[2]
    assert "in <module>" in dump and "in call_function" in dump, proc.stderr[-3000:]


@pytest.mark.inprocess
def test_calling_a_guarded_trace_outside_a_guard_warns(monkeypatch):
    strategy = make_strategy(2)
    monkeypatch.setattr(watchdog, "_warned_unguarded", False)
    step = tf.function(lambda: strategy.run(lambda: kc_ops.all_reduce(tf.ones([2]))))
    with watchdog.guard("probe"):
        step()  # traced here: no TF timeout
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with watchdog.guard("probe"):
            step()  # guarded: silent
    with pytest.warns(RuntimeWarning, match="called outside any guard"):
        step()
