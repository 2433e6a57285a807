"""Workers agree on what to restore: the chief decides, everyone checks.

Each worker reads its own view of `backup_dir`; a directory that is not
really shared (or a file still being copied) would resume the workers at
different steps, visible only later as a collective timeout or as silently
wrong weights. Two small all-gathers make that impossible: the chief's
choice is broadcast, and every worker's outcome of loading it is gathered,
so either all restore the same backup or all raise together.
"""

import numpy as np
import tensorflow as tf

from keras_comm import config
from keras_comm import topology

#: `broadcast_choice`'s answer when the chief found backups but none usable.
UNUSABLE = "unusable"

# Why a worker could not load the chief's choice (gathered as numbers).
OK, MISSING, MISMATCH, LOAD_FAILED, SAVE_FAILED = 0, 1, 2, 3, 4
REASONS = {
    MISSING: "the file is missing from its view of backup_dir",
    MISMATCH: "its copy of the file differs from the chief's (size or checksum)",
    LOAD_FAILED: "loading the file failed",
    SAVE_FAILED: "saving the backup failed",
}


def _all_gather(strategy, row):
    """Every replica's `row` (ints), in replica order; a collective."""
    if strategy.num_replicas_in_sync == 1:
        return np.asarray([row], np.int64)
    value = tf.constant([row], tf.int64)
    options = tf.distribute.experimental.CommunicationOptions(
        timeout_seconds=config.get_timeout()
    )

    def replica_fn():
        ctx = tf.distribute.get_replica_context()
        return ctx.all_gather(value, axis=0, options=options)

    with strategy.scope():
        out = tf.function(lambda: strategy.run(replica_fn))()
    return strategy.experimental_local_results(out)[0].numpy()


def broadcast_choice(strategy, entry, unusable):
    """The chief's choice, on every worker.

    Args:
        strategy: the model's strategy.
        entry: on the chief, the backup it chose (a dict with ``epoch``,
            ``step``, ``size``, ``crc32``) or None; ignored elsewhere.
        unusable: on the chief, True when backups exist but none is intact.

    Returns:
        None (start from scratch), `UNUSABLE`, or ``(epoch, step, size,
        crc32)`` with size -1 when the backup has no checksum.
    """
    if unusable:
        row = [2, 0, 0, 0, 0]
    elif entry is None:
        row = [0, 0, 0, 0, 0]
    else:
        size = -1 if entry["size"] is None else entry["size"]
        crc = -1 if entry["crc32"] is None else entry["crc32"]
        row = [1, entry["epoch"], entry["step"], size, crc]
    flag, epoch, step, size, crc = (int(x) for x in _all_gather(strategy, row)[0])
    if flag == 2:
        return UNUSABLE
    if flag == 0:
        return None
    return epoch, step, size, crc


def gather_failures(strategy, failure):
    """Every replica's failure to load the chosen backup.

    Args:
        strategy: the model's strategy.
        failure: None, or ``(reason code, message)`` for this worker.

    Returns:
        ``[(replica, message)]`` for the replicas that failed (this
        worker's own message for its replicas, the reason for the others).
    """
    code = OK if failure is None else failure[0]
    codes = _all_gather(strategy, [code])[:, 0]
    local = set(_local_replicas(strategy, len(codes)))
    return [
        (r, failure[1] if r in local and failure is not None else REASONS[int(c)])
        for r, c in enumerate(codes)
        if c != OK
    ]


def _local_replicas(strategy, num_replicas):
    if num_replicas == 1:
        return [0]
    task = topology.task_id(strategy)
    per_worker = len(strategy.extended.worker_devices)
    return range(task * per_worker, (task + 1) * per_worker)
