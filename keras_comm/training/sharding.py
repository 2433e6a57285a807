"""Pure maths of sharded optimizer state: layout, padding, sizes, scaling, dispatch.

No collectives and no Keras here: `keras_comm.training.accumulate` wires
these together.

Every trainable variable with ``n`` elements is flattened and zero-padded to
``padded_size(n, N) = N * ceil(n / N)`` elements; replica ``r`` of ``N`` owns
the slice ``[r * s, (r + 1) * s)`` with ``s = shard_size(n, N)``. Several
variables travel together in one *packed* buffer of ``N * S`` elements
(``S = sum(s_i)``) laid out shard-major: chunk ``r`` holds replica ``r``'s
shard of every variable, in variable order. A reduce-scatter of the packed
buffer therefore hands each replica exactly its shards, and an all-gather of
every replica's ``S`` shard elements rebuilds the packed buffer.
"""

import dataclasses

import tensorflow as tf


def _check_positive_int(value, name):
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"`{name}` must be an int >= 1. Received: {name}={value!r}")


def shard_size(numel, num_shards):
    """Elements per shard of a variable with `numel` elements: ``ceil(numel / N)``."""
    _check_positive_int(num_shards, "num_shards")
    if isinstance(numel, bool) or not isinstance(numel, int) or numel < 0:
        raise ValueError(f"`numel` must be an int >= 0. Received: numel={numel!r}")
    return -(-numel // num_shards)


def padded_size(numel, num_shards):
    """`numel` rounded up to a multiple of `num_shards`."""
    return shard_size(numel, num_shards) * num_shards


def shard_bounds(numel, num_shards, index):
    """``(start, stop)`` of shard `index` in the padded flat variable."""
    if not 0 <= index < num_shards:
        raise ValueError(
            f"`index` must be in [0, {num_shards}). Received: index={index!r}"
        )
    s = shard_size(numel, num_shards)
    return index * s, (index + 1) * s


@dataclasses.dataclass(frozen=True)
class Layout:
    """How a list of variables is sharded over `num_shards` replicas.

    Attributes:
        sizes: elements of each variable (unpadded).
        num_shards: the number of replicas sharing the state.
    """

    sizes: tuple
    num_shards: int

    def __post_init__(self):
        _check_positive_int(self.num_shards, "num_shards")
        object.__setattr__(self, "sizes", tuple(int(n) for n in self.sizes))
        for n in self.sizes:
            shard_size(n, self.num_shards)  # validates n

    @property
    def shard_sizes(self):
        """Elements each replica holds per variable, ``ceil(n_i / N)``."""
        return tuple(shard_size(n, self.num_shards) for n in self.sizes)

    @property
    def shard_total(self):
        """Elements each replica holds over all variables (``S``)."""
        return sum(self.shard_sizes)

    @property
    def packed_size(self):
        """Elements of the packed buffer, ``N * S``."""
        return self.num_shards * self.shard_total

    def sub(self, start, stop):
        """The layout of variables ``start:stop`` alone (a bucket)."""
        return Layout(self.sizes[start:stop], self.num_shards)


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


# --- Packing (TensorFlow, no communication) ----------------------------------


def flatten_padded(x, numel, num_shards, dtype=None):
    """`x` flattened, cast to `dtype`, zero-padded to a multiple of N elements."""
    flat = tf.reshape(x, [-1])
    if dtype is not None:
        flat = tf.cast(flat, dtype)
    pad = padded_size(numel, num_shards) - numel
    if pad:
        flat = tf.concat([flat, tf.zeros([pad], flat.dtype)], 0)
    return flat


def pack(tensors, layout, dtype=None):
    """Packs full-size tensors into the shard-major ``[N * S]`` buffer."""
    n = layout.num_shards
    columns = [
        tf.reshape(flatten_padded(t, numel, n, dtype), [n, s])
        for t, numel, s in zip(tensors, layout.sizes, layout.shard_sizes)
    ]
    return tf.reshape(tf.concat(columns, axis=1), [layout.packed_size])


def unpack(packed, layout, shapes):
    """Inverse of `pack`: full tensors of `shapes` from the ``[N * S]`` buffer."""
    n = layout.num_shards
    columns = tf.split(
        tf.reshape(packed, [n, layout.shard_total]), list(layout.shard_sizes), axis=1
    )
    return [
        tf.reshape(tf.reshape(c, [-1])[:numel], shape)
        for c, numel, shape in zip(columns, layout.sizes, shapes)
    ]


def local_shards(tensors, layout, index, dtype=None):
    """Replica `index`'s shard of each full tensor (padded, flat)."""
    out = []
    for t, numel in zip(tensors, layout.sizes):
        start, stop = shard_bounds(numel, layout.num_shards, index)
        out.append(flatten_padded(t, numel, layout.num_shards, dtype)[start:stop])
    return out


def split_shards(shard_buffer, layout):
    """Splits one replica's ``[S]`` buffer into its per-variable shards."""
    return tf.split(shard_buffer, list(layout.shard_sizes))
