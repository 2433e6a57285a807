"""Worker: BackupAndRestore across real processes, killed and resumed.

Usage: checkpoint_worker.py STATE_DIR CONFIG [CONFIG ...], CONFIG in
``plain`` (stock fit) and ``po1`` (ParallelOptimizer, accumulation 2,
zero_stage 1). Configurations run in order; one already finished (its
``STATE_DIR/done-<config>-rank<r>.json`` exists) is skipped. Each trains
with `keras_comm.callbacks.BackupAndRestore(save_freq=SAVE_FREQ)`; on the
first run of a configuration (no ``STATE_DIR/killed-<config>`` marker) rank 1
SIGKILLs itself before global step KILL_STEP, after writing the marker and
the kill time. A run that completes also trains the same model uninterrupted
in this cluster and records the max relative weight difference.

Run by tests/callbacks/test_checkpoint_multiprocess.py through
checkpoint_launch_worker.py, in the launches of the other checkpoint checks.
"""

import json
import os
import signal
import sys
import time
from pathlib import Path

import numpy as np
import tensorflow as tf

from _cluster import finish, write_result
from _strategy import strategy

import keras  # noqa: E402

import keras_comm  # noqa: E402  (after the strategy: TF_CONFIG is read once)
from _shared import resume_dataset, resume_model  # noqa: E402

N = strategy.num_replicas_in_sync
RANK = int(strategy.cluster_resolver.task_id)
GLOBAL_BATCH = 2 * N
STEPS = 12  # per epoch
EPOCHS = 2
SAVE_FREQ = 5  # saves after global steps 5, 10, 15 (po1: deferred to a window end)
KILL_STEP = 18  # rank 1 dies before running it: epoch 1, step 6



def optimizer_values(model):
    """The optimizer's variables as numpy; under ParallelOptimizer its slots
    hold no memory and their (full) values come from the callback's shards
    (a collective: every worker calls)."""
    from keras_comm.variables import annotations

    store = annotations.external_slots(model.optimizer)
    return [
        store.value(v) if store is not None and store.owns(v) else np.asarray(v)
        for v in model.optimizer.variables
    ]

def dataset():
    return resume_dataset(GLOBAL_BATCH, STEPS)


def build():
    return resume_model(strategy, units=8, learning_rate=0.02)


def extra_callbacks(config):
    if config == "po1":
        return [keras_comm.callbacks.ParallelOptimizer(accumulation_steps=2, zero_stage=1)]
    return []


def _wait_for_last_backup(backup_dir, seconds=60):
    """Waits until the chief's last backup before KILL_STEP is on disk.

    The chief writes that backup after the step rank 1 has just finished
    (po1: at the accumulation window's end, right before KILL_STEP); killing
    rank 1 at once races the chief's write against the launcher stopping the
    chief, and which backup is restored would depend on the machine's load.
    """
    first = KILL_STEP - SAVE_FREQ + 1
    deadline = time.time() + seconds
    while time.time() < deadline:
        for name in os.listdir(backup_dir) if backup_dir.exists() else ():
            parts = name[len("ckpt-"):-len(".json")].split("-")
            if name.startswith("ckpt-") and name.endswith(".json") and len(parts) == 2:
                if int(parts[0]) * STEPS + int(parts[1]) >= first:
                    return
        time.sleep(0.05)
    raise RuntimeError(f"no backup at or after global step {first} in {backup_dir} after {seconds} s")


class Steps(keras.callbacks.Callback):
    """Counts the steps actually trained; kills rank 1 once (see module doc)."""

    def __init__(self, marker=None, backup_dir=None):
        super().__init__()
        self.marker = marker
        self.backup_dir = backup_dir
        self.trained = 0
        self.epoch = 0

    def on_epoch_begin(self, epoch, logs=None):
        self.epoch = epoch

    def on_train_batch_begin(self, batch, logs=None):
        step = self.epoch * STEPS + batch
        if self.marker is not None and RANK == 1 and step == KILL_STEP:
            _wait_for_last_backup(self.backup_dir)
            self.marker.write_text(json.dumps({"time": time.time(), "step": step}))
            os.kill(os.getpid(), signal.SIGKILL)

    def on_train_batch_end(self, batch, logs=None):
        if logs:  # a skipped (restored) step returns no logs
            self.trained += 1


def run(config, state):
    backup = keras_comm.callbacks.BackupAndRestore(
        str(state / f"backup-{config}"), save_freq=SAVE_FREQ
    )
    marker = state / f"killed-{config}"
    steps = Steps(None if marker.exists() else marker, state / f"backup-{config}")
    model = build()
    start = time.time()
    model.fit(dataset(), epochs=EPOCHS, verbose=0,
              callbacks=[steps, *extra_callbacks(config), backup])
    seconds = time.time() - start
    resumed = [w.copy() for w in model.get_weights()]
    optimizer_state = optimizer_values(model)
    reference = build()
    ref_steps = Steps()
    reference.fit(dataset(), epochs=EPOCHS, verbose=0,
                  callbacks=[ref_steps, *extra_callbacks(config)])
    rel = max(
        float(np.abs(a - b).max() / max(np.abs(b).max(), 1e-12))
        for a, b in zip(resumed, reference.get_weights())
    )
    opt_rel = max(
        float(np.abs(a - np.asarray(b)).max() / max(np.abs(np.asarray(b)).max(), 1e-12))
        for a, b in zip(optimizer_state, optimizer_values(reference))
    )
    return {
        "max_rel": rel,
        "optimizer_max_rel": opt_rel,
        "restored": backup.restored,
        "trained_after_restore": steps.trained,
        "trained_uninterrupted": ref_steps.trained,
        "fit_seconds": seconds,
        "iterations": int(model.optimizer.iterations.numpy()),
        "backup_dir_removed": not (state / f"backup-{config}").exists(),
    }


def run_configs(state_dir, configs):
    """Runs (or reads the finished) `configs` in order; see the module doc."""
    state = Path(state_dir)
    state.mkdir(parents=True, exist_ok=True)
    results = {}
    for config in configs:
        done = state / f"done-{config}-rank{RANK}.json"
        if done.exists():
            results[config] = json.loads(done.read_text())
            continue
        results[config] = run(config, state)
        done.write_text(json.dumps(results[config]))
    return {"rank": RANK, "world": N, "results": results}


if __name__ == "__main__":
    write_result(run_configs(sys.argv[1], sys.argv[2:]))
    finish()  # _cluster.finish: skip the slow teardown
