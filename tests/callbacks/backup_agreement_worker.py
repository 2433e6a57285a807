"""Worker: BackupAndRestore with damaged files and with workers that see
different `backup_dir` contents.

Usage: backup_agreement_worker.py STATE_DIR. One launch:

1. A fit with `BackupAndRestore(save_freq=4, double_checkpoint=True)` is
   interrupted (an exception on every worker) before global step 9, leaving
   backups at steps 4 (epoch 0, step 4) and 8 (epoch 1, step 2).
2. Shared-directory cases: the chief copies that backup and damages one
   file (truncated to half); every worker resumes from the copy.
3. Per-worker cases: each worker gets its own directory (as when
   `backup_dir` is not really shared); the chief's copy is intact, worker
   1's differs.

Each case records, per worker, what was restored or the error raised, and
the warnings.

Run by tests/callbacks/test_checkpoint_multiprocess.py through
checkpoint_launch_worker.py, in its second launch.
"""

import shutil
import sys
import warnings
from pathlib import Path

import tensorflow as tf

from _cluster import write_result
from _strategy import strategy

import keras  # noqa: E402

import keras_comm  # noqa: E402  (after the strategy: TF_CONFIG is read once)
from _shared import InterruptAt, resume_dataset, resume_model  # noqa: E402

N = strategy.num_replicas_in_sync
RANK = int(strategy.cluster_resolver.task_id)
STEPS, EPOCHS, INTERRUPT_STEP = 6, 2, 9


def build():
    return resume_model(strategy)


def dataset():
    return resume_dataset(2 * N, STEPS)


def barrier():
    """Every worker waits here for the others (the chief's files are complete)."""

    def replica_fn():
        ctx = tf.distribute.get_replica_context()
        return ctx.all_reduce("sum", tf.constant(1.0))

    with strategy.scope():
        strategy.run(tf.function(replica_fn))


def backup(backup_dir, **kwargs):
    return keras_comm.callbacks.BackupAndRestore(
        str(backup_dir), save_freq=4, double_checkpoint=True, **kwargs
    )


def truncate(path):
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])


def resume(backup_dir):
    callback = backup(backup_dir)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            build().fit(dataset(), epochs=EPOCHS, verbose=0, callbacks=[callback])
            outcome = {"restored": callback.restored}
        except ValueError as e:
            outcome = {"error": str(e)}
    outcome["warnings"] = [
        str(w.message) for w in caught if "BackupAndRestore" in str(w.message)
    ]
    return outcome


SHARED_CASES = {
    "intact": [],
    "metadata": ["training_metadata.json"],
    "latest_record": ["ckpt-1-2.json"],
    "latest_weights": ["ckpt-1-2.weights.h5"],
    "previous_weights": ["ckpt-0-4.weights.h5"],
    "both_weights": ["ckpt-1-2.weights.h5", "ckpt-0-4.weights.h5"],
}


def worker1_view(name, directory):
    """Worker 1's differing copy of the backup for per-worker case `name`."""
    if name == "only_weights":  # no records or metadata: it cannot choose alone
        for p in directory.iterdir():
            if not p.name.endswith(".weights.h5"):
                p.unlink()
    elif name == "empty":
        shutil.rmtree(directory)
        directory.mkdir()
    elif name == "different":  # the same name, other contents
        shutil.copy(directory / "ckpt-0-4.weights.h5", directory / "ckpt-1-2.weights.h5")


def run(state_dir):
    state = Path(state_dir)
    state.mkdir(parents=True, exist_ok=True)
    pristine = state / "pristine"
    try:
        build().fit(dataset(), epochs=EPOCHS, verbose=0,
                    callbacks=[InterruptAt(INTERRUPT_STEP, STEPS), backup(pristine, delete_checkpoint=False)])
    except RuntimeError as e:
        if "interrupted" not in str(e):
            raise
    barrier()
    results = {"files": sorted(p.name for p in pristine.iterdir())}

    for name, damaged in SHARED_CASES.items():
        directory = state / f"shared-{name}"
        if RANK == 0:
            shutil.copytree(pristine, directory)
            for f in damaged:
                truncate(directory / f)
        barrier()
        results[name] = resume(directory)

    for name in ("only_weights", "empty", "different"):
        directory = state / f"own-{name}" / f"rank{RANK}"
        shutil.copytree(pristine, directory)
        if RANK == 1:
            worker1_view(name, directory)
        barrier()
        results[name] = resume(directory)

    return {"rank": RANK, "world": N, "results": results}


if __name__ == "__main__":
    write_result(run(sys.argv[1]))
