"""predict and evaluate run under the step owner's watchdog guard.

A collective that never completes in `predict` or `evaluate` raises
keras_comm's timeout error within the timeout, as in `fit`, instead of
waiting forever: both steps are made by `keras_comm.training.step`
(`make_predict_function`, `make_function`). A timeout aborts every later
collective of the process, so each case runs in its own subprocess (on 2
in-process replicas); tests/acceptance/test_reliability.py covers real workers.
"""

import json
import subprocess
import sys
import textwrap
import time

import pytest

from _cluster import REPO_DIR

TIMEOUT = 2.0

# Rank 0 all-reduces, rank 1 never joins: the collective cannot complete.
_ONE_SIDED = textwrap.dedent(
    """
    import json, os, sys, time
    import numpy as np
    import tensorflow as tf

    cpu = tf.config.list_physical_devices("CPU")[0]
    tf.config.set_logical_device_configuration(cpu, [tf.config.LogicalDeviceConfiguration()] * 2)
    import keras
    import keras_comm

    class OneSided(keras.layers.Layer):
        def call(self, x):
            # Traced per replica: only rank 0 joins. (Keras's symbolic build
            # calls layers outside any replica: nothing to communicate there.)
            if not tf.distribute.in_cross_replica_context() and keras_comm.rank() == 0:
                x = x + 0.0 * keras_comm.ops.all_reduce(x, name="one_sided")
            return x

        def compute_output_spec(self, x):
            return keras.KerasTensor(x.shape, x.dtype)

    keras_comm.set_timeout(float(sys.argv[2]))
    strategy = tf.distribute.MultiWorkerMirroredStrategy._from_local_devices(["/cpu:0", "/cpu:1"])
    with strategy.scope():
        model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(2), OneSided()])
        model.compile("sgd", "mse")
    x, y = np.ones((8, 3), "float32"), np.ones((8, 2), "float32")
    start = time.time()
    try:
        if sys.argv[1] == "predict":
            model.predict(x, batch_size=4, verbose=0)
        else:
            model.evaluate(x, y, batch_size=4, verbose=0)
        out = {"type": None}
    except Exception as e:
        out = {"type": type(e).__name__, "message": str(getattr(e, "message", e))}
    out["seconds"] = time.time() - start
    print(json.dumps(out), flush=True)
    os._exit(0)  # skip teardown: the aborted replica threads never return
    """
)


@pytest.mark.inprocess
def test_a_collective_that_cannot_complete_is_a_timeout_in_predict_and_evaluate():
    # Both cases at once: each is mostly TensorFlow's import and a wait.
    procs = {
        what: subprocess.Popen(
            [sys.executable, "-c", _ONE_SIDED, what, str(TIMEOUT)],
            cwd=REPO_DIR, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        )
        for what in ("predict", "evaluate")
    }
    deadline = time.monotonic() + 150
    for what, step in (("predict", "predict_step"), ("evaluate", "test_step")):
        proc = procs[what]
        try:
            stdout, stderr = proc.communicate(timeout=max(deadline - time.monotonic(), 1))
        except subprocess.TimeoutExpired:
            for p in procs.values():
                p.kill()
            pytest.fail(f"{what}: a collective that cannot complete hung (no timeout error)")
        assert proc.returncode == 0, stderr[-3000:]
        out = json.loads(stdout.strip().splitlines()[-1])
        assert out["type"] == "DeadlineExceededError", (what, out)
        assert out["seconds"] < TIMEOUT + 20, (what, out)
        assert out["message"].startswith(
            f"keras_comm: the model's {step} did not finish within {TIMEOUT:g} s "
            "(keras_comm's collective timeout)"
        ), (what, out)
        assert "layer 'one_sided' (all_reduce over group [0, 1]" in out["message"], (what, out)
