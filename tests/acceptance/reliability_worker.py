"""Failure scenarios across real worker processes (tests/acceptance/test_reliability.py).

`python reliability_worker.py MODE`, run by `run_cluster`:

* ``timeout``: `model.fit` of a model with an AllReduce layer; the last rank
  stops participating at batch 2. The others must get a translated
  DeadlineExceededError naming the layer and group within timeout + 10 s.
* ``mismatch``: checked mode; mismatched shapes, dtypes and call order each
  raise on every rank with both sides named; the cost of checked mode; last,
  an eager collective whose peer never comes (translated in eager mode).
* ``crash``: `model.fit`; rank 1 SIGKILLs itself at batch 3 (the test times
  the launcher).
* ``predict``: `model.predict` of the ``timeout`` model with a layer whose
  all-reduce only rank 0 issues. Rank 0 must get keras_comm's timeout error
  naming the predict step (predict runs under the step owner's guard).
* ``preempt STATE_DIR``: `BackupAndRestore(save_before_preemption=True)`
  under `--max-restarts 2`, one case per attempt (`PREEMPT_CASES`): a
  SIGTERM to some workers at a known step; every worker saves and exits
  143; the next attempt resumes it and records the restored step and the
  difference from an uninterrupted run. The last attempt writes the results,
  then stops a worker with two SIGTERMs (the job must end promptly).

A collective timeout aborts every later collective in the process, so each
timeout is the last collective a worker runs. A worker that wrote its result
leaves through `_cluster.finish` (no TensorFlow teardown); the ``crash`` and
``preempt`` modes' exits are under test and stay as they are.
"""

import json
import os
import signal
import sys
import time
from pathlib import Path

import numpy as np
import tensorflow as tf
import keras

import keras_comm
from keras_comm import layers
from keras_comm import ops

from _cluster import finish
from _cluster import rank as worker_rank
from _cluster import write_result

TIMEOUT = 3.0


def _wait_for_results(ranks, limit=60):
    out_dir = Path(os.environ["KERAS_COMM_TEST_OUT"])
    deadline = time.time() + limit
    while time.time() < deadline:
        if all((out_dir / f"rank{r}.json").exists() for r in ranks):
            return
        time.sleep(0.1)


def _error_record(e, since):
    return {"type": type(e).__name__, "message": str(e), "seconds": time.time() - since}


def _model():
    inputs = keras.Input((4,))
    h = keras.layers.Dense(4, name="hidden")(inputs)
    h = layers.AllReduce("sum", name="grad_sync_probe")(h)
    outputs = keras.layers.Dense(1, name="head")(h)
    model = keras.Model(inputs, outputs)
    model.compile(keras.optimizers.SGD(0.01), "mse")
    return model


def _data(n, batches):
    x = np.random.default_rng(0).normal(size=(8 * n * batches, 4)).astype("float32")
    return x, x[:, :1]


def timeout_mode(strategy, rank, n):
    with strategy.scope():
        model = _model()
    x, y = _data(n, 20)
    last_batch = {"t": time.time(), "batch": -1}

    class Stall(keras.callbacks.Callback):
        def on_train_batch_end(self, batch, logs=None):
            last_batch.update(t=time.time(), batch=batch)
            if batch == 2 and rank == n - 1:
                # Stop participating without exiting. The result goes first:
                # a peer that crashes while TensorFlow aborts its timed-out
                # ring (SIGSEGV/SIGABRT, seen in CI) makes the launcher stop
                # this worker too. Exit once the others have reported (or
                # after a minute).
                write_result({"stalled_at_batch": batch})
                finish(wait_seconds=60)

    result = {}
    try:
        model.fit(x, y, batch_size=8 * n, epochs=1, verbose=0,
                  callbacks=[Stall(), keras_comm.errors.CollectiveErrors()])
        result["error"] = None
    except tf.errors.OpError as e:
        result["error"] = _error_record(e, last_batch["t"])
    result["last_batch"] = last_batch["batch"]
    write_result(result)
    finish()


class _OneSided(keras.layers.Layer):
    """An all-reduce only rank 0 issues: a collective that cannot complete."""

    def call(self, x):
        # Keras's symbolic build calls layers outside any replica.
        if not tf.distribute.in_cross_replica_context() and keras_comm.rank() == 0:
            x = x + 0.0 * ops.all_reduce(x, name="one_sided")
        return x

    def compute_output_spec(self, x):
        return keras.KerasTensor(x.shape, x.dtype)


def predict_mode(strategy, rank, n):
    with strategy.scope():
        model = _model()
        model = keras.Sequential([model, _OneSided()])
    x, _ = _data(n, 2)
    start = time.time()
    try:
        model.predict(x, batch_size=8 * n, verbose=0)
        result = {"error": None}
    except tf.errors.OpError as e:
        result = {"error": _error_record(e, start)}
    write_result(result)
    finish()


def _attempt(fn, since=None):
    start = time.time() if since is None else since
    try:
        out = fn()
        return {"error": None, "value": [np.asarray(t).tolist() for t in tf.nest.flatten(out)]}
    except tf.errors.OpError as e:
        return {"error": _error_record(e, start)}


def mismatch_mode(strategy, rank, n):
    keras_comm.set_timeout(30)  # Mismatches must not need the timeout.
    result = {}

    # Cost of checked mode: the same step (4 small all-reduces) both ways.
    def timed_step(checked, steps=30):
        keras_comm.set_check_calls(checked)
        ls = [layers.AllReduce("sum", name=f"cost_{checked}_{i}") for i in range(4)]

        def replica_fn():
            x = tf.ones([256])
            for layer in ls:
                x = layer(x) / n
            return x

        step = tf.function(lambda: strategy.run(replica_fn))
        step()
        start = time.perf_counter()
        for _ in range(steps):
            step()
        return (time.perf_counter() - start) / steps / len(ls)

    result["seconds_per_collective"] = {
        "unchecked": timed_step(False), "checked": timed_step(True)
    }

    keras_comm.set_check_calls(True)
    ar = layers.AllReduce("sum", name="ar")
    ar_max = layers.AllReduce("max", name="ar_max")

    def swapped():
        x = tf.ones([2]) * (rank + 1)
        if rank == 0:
            return ar(x), ar_max(x)
        b = ar_max(x)
        return ar(x), b

    scenarios = {
        "shape": lambda: ar(tf.ones([2 + rank])),
        # The layer's dtype policy would cast; the ops function does not.
        "dtype": lambda: ops.all_reduce(
            tf.ones([2], tf.float32 if rank == 0 else tf.float64), name="ar_op"
        ),
        "order": swapped,
        # After the errors above, a matching call must still work.
        "matching": lambda: ar(tf.ones([2]) * (rank + 1)),
    }
    for name, fn in scenarios.items():
        result[name] = _attempt(tf.function(lambda fn=fn: strategy.run(fn)))

    # Last: an eager collective whose peer never calls it.
    keras_comm.set_check_calls(False)
    layer = layers.AllReduce("sum", name="eager_probe", timeout=TIMEOUT)
    if rank == 0:
        result["eager_timeout"] = _attempt(lambda: strategy.run(lambda: layer(tf.ones([2]))))
    else:
        _wait_for_results([0])
    write_result(result)
    finish()


def crash_mode(strategy, rank, n):
    with strategy.scope():
        model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(1)])
        model.compile(keras.optimizers.SGD(0.01), "mse")
    x, y = _data(n, 200)

    class Crash(keras.callbacks.Callback):
        def on_train_batch_end(self, batch, logs=None):
            if batch == 3 and rank == 1:
                out = Path(os.environ["KERAS_COMM_TEST_OUT"])
                (out / "killed_at.json").write_text(json.dumps({"time": time.time()}))
                os.kill(os.getpid(), signal.SIGKILL)

    model.fit(x, y, batch_size=8 * n, epochs=50, verbose=0, callbacks=[Crash()])
    write_result({"finished": True})  # Never reached by a correct launcher.


# attempt -> (ranks signalled, where: (epoch, batch) begin or (epoch, None) =
# that epoch's end). 6 steps per epoch, ZeRO-1 with accumulation windows of
# 2: a notice during global step g is taken at the next boundary, the save
# is after step g + 2, moved to the end of its window if inside one.
PREEMPT_STEPS, PREEMPT_EPOCHS = 6, 2
PREEMPT_CASES = {
    0: ((1,), (0, 1)),        # a non-chief, mid-step: g=1 -> 3 -> window end 4
    1: ((0, 1), (0, None)),   # every worker (a launcher's stop), between epochs: 6 -> 8
}


def preempt_mode(strategy, rank, n):
    from _shared import SigtermAt, resume_dataset, resume_model

    state = Path(sys.argv[2])
    state.mkdir(parents=True, exist_ok=True)
    attempt = int(os.environ.get("KERAS_COMM_RESTART_ATTEMPT", "0"))

    def fit(model, *callbacks):
        callbacks = [keras_comm.callbacks.ParallelOptimizer(accumulation_steps=2, zero_stage=1),
                     *callbacks]
        model.fit(resume_dataset(2 * n, PREEMPT_STEPS), epochs=PREEMPT_EPOCHS, verbose=0,
                  callbacks=callbacks)
        return model

    def sigterm_at(backup, ranks, at, times=1):
        """A SIGTERM at `at` on the ranks in `ranks` (recorded first), none elsewhere."""
        def record():
            (state / f"signalled{attempt}_rank{rank}.json").write_text(json.dumps(
                {"time": time.time()}))
        return [SigtermAt(backup, *at, times=times, on_send=record)] if rank in ranks else []

    reference = state / "reference.npz"
    if attempt == 0:
        weights = fit(resume_model(strategy)).get_weights()
        if rank == 0:
            np.savez(state / "reference.tmp.npz", *weights)
            os.replace(state / "reference.tmp.npz", reference)
    records = {}
    if attempt > 0:
        previous = attempt - 1
        backup_dir = state / f"case{previous}"
        files = sorted(p.name for p in backup_dir.iterdir()) if backup_dir.exists() else []
        backup = keras_comm.callbacks.BackupAndRestore(
            str(backup_dir), save_before_preemption=True, delete_checkpoint=False)
        model = fit(resume_model(strategy), backup)
        with np.load(reference) as ref:
            expected = [ref[f"arr_{i}"] for i in range(len(ref.files))]
        diff = max(float(np.abs(a - b).max()) for a, b in zip(model.get_weights(), expected))
        record = {"files": files, "restored": backup.restored, "max_abs_diff": diff}
        (state / f"resumed{previous}_rank{rank}.json").write_text(json.dumps(record))
    if attempt in PREEMPT_CASES:
        ranks, at = PREEMPT_CASES[attempt]
        backup = keras_comm.callbacks.BackupAndRestore(
            str(state / f"case{attempt}"), save_freq=False, save_before_preemption=True)
        fit(resume_model(strategy), backup, *sigterm_at(backup, ranks, at))
        raise AssertionError("fit returned after a preemption notice")
    # Last attempt: everything recorded; then two SIGTERMs to rank 1 at once.
    results = {}
    for case in PREEMPT_CASES:
        results[case] = json.loads((state / f"resumed{case}_rank{rank}.json").read_text())
    write_result({"attempt": attempt, "resumed": results})
    backup = keras_comm.callbacks.BackupAndRestore(
        str(state / "double"), save_freq=False, save_before_preemption=True)
    fit(resume_model(strategy), backup, *sigterm_at(backup, (1,), (0, 1), times=2))


def main():
    mode = sys.argv[1]
    if mode == "preempt":
        # Generous: a loaded machine must not turn a slow step into a failure
        # (the double-SIGTERM case ends through the launcher's 5 s grace).
        keras_comm.set_timeout(120)
    else:
        keras_comm.set_timeout(TIMEOUT)
    # The strategy's own collectives (fit's metric and gradient all-reduces)
    # get the same timeout.
    strategy = tf.distribute.MultiWorkerMirroredStrategy(
        communication_options=keras_comm.communication_options()
    )
    rank, n = worker_rank(), strategy.num_replicas_in_sync
    modes = {"timeout": timeout_mode, "mismatch": mismatch_mode, "crash": crash_mode,
             "predict": predict_mode, "preempt": preempt_mode}
    modes[mode](
        strategy, rank, n
    )


if __name__ == "__main__":
    main()
