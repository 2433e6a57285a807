"""Pure maths of the accumulate/shard step: buckets, scaling, when to apply.

No collectives and no Keras here: `keras_comm.training.accumulate` wires
these together. The layout of the sharded state (flat shards, padding,
member-major packing) is `keras_comm.variables.packing`, whose names are
also importable from here.
"""

from keras_comm.variables.packing import Layout  # noqa: F401
from keras_comm.variables.packing import _check_positive_int
from keras_comm.variables.packing import flatten_padded  # noqa: F401
from keras_comm.variables.packing import local_shards  # noqa: F401
from keras_comm.variables.packing import pack  # noqa: F401
from keras_comm.variables.packing import padded_size
from keras_comm.variables.packing import shard_bounds  # noqa: F401
from keras_comm.variables.packing import shard_size  # noqa: F401
from keras_comm.variables.packing import split_shards  # noqa: F401
from keras_comm.variables.packing import unpack  # noqa: F401


#: Elements (padded) per communication bucket: 4 Mi float32 = 16 MiB.
BUCKET_ELEMENTS = 1 << 22


def buckets(layout, max_elements=None):
    """Consecutive ``(start, stop)`` variable ranges of at most `max_elements`
    (default `BUCKET_ELEMENTS`) padded elements each (a larger variable is a
    bucket of its own).

    Collectives run per bucket, so a step's transient copies are a bucket's
    size, not the model's. Concatenating every bucket's shard of replica r
    gives replica r's shard of the whole layout (the order is kept).
    """
    if max_elements is None:
        max_elements = BUCKET_ELEMENTS
    _check_positive_int(max_elements, "max_elements")
    out, start, total = [], 0, 0
    for i, n in enumerate(layout.sizes):
        size = padded_size(n, layout.num_shards)
        if i > start and total + size > max_elements:
            out.append((start, i))
            start, total = i, 0
        total += size
    if layout.sizes:
        out.append((start, len(layout.sizes)))
    return out


def accumulation_scale(seen, mean=True):
    """Factor applied to a sum of `seen` micro-batch gradients.

    ``1 / seen`` for the mean of the micro-batches actually accumulated
    (`mean=True`), else 1 (their sum).
    """
    _check_positive_int(seen, "seen")
    return 1.0 / seen if mean else 1.0


def is_apply_step(pending, accumulation_steps, step_in_epoch, steps_per_epoch):
    """Whether the micro-step about to run must reduce and apply.

    Args:
        pending: micro-batches already accumulated since the last update.
        accumulation_steps: micro-batches per update.
        step_in_epoch: 0-based index of the micro-step in its epoch.
        steps_per_epoch: steps in the epoch, or None when unknown.

    Returns:
        True when this micro-step completes a window of `accumulation_steps`
        micro-batches, or is the last step of an epoch of known length (a
        partial window is then applied on its own: see `accumulation_scale`).
    """
    if pending + 1 >= accumulation_steps:
        return True
    return steps_per_epoch is not None and step_in_epoch + 1 >= steps_per_epoch
