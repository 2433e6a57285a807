"""Flat shards and packed buffers: the layouts collectives move variables in.

No communication here: pure arithmetic, and TensorFlow/numpy re-layouts that
a caller feeds to one collective.

[Note: flat shards] A variable with ``numel`` elements split over ``N``
replicas is flattened, zero-padded to ``N * s`` elements with
``s = shard_size(numel, N) = ceil(numel / N)``, and cut into ``N``
contiguous pieces: replica ``r`` holds elements ``[r * s, (r + 1) * s)``.
Any shape splits over any group size, with at most ``N - 1`` padding
elements, which stay zero under training (their gradient is zero, and so is
every optimizer's update of a zero weight with a zero gradient). A layout
that must give every replica at least one element (a `FullyShard` weight,
whose shard is a Keras variable) passes ``minimum=1``.

[Note: member-major packing] Several variables travel together in one
buffer of ``N * S`` elements (``S = sum(s_i)``), laid out member-major:
chunk ``r`` holds replica ``r``'s shard of every variable, in variable
order. A reduce-scatter of the packed buffer hands each replica exactly its
shards, and an all-gather of every replica's ``S`` elements rebuilds it.
"""

import dataclasses
import math

import numpy as np
import tensorflow as tf


def _check_positive_int(value, name):
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"`{name}` must be an int >= 1. Received: {name}={value!r}")


# --- Sizes (pure) ----------------------------------------------------------------


def shard_size(numel, num_shards, minimum=0):
    """Elements per shard of a variable with `numel` elements: ``max(minimum, ceil(numel / N))``."""
    _check_positive_int(num_shards, "num_shards")
    if isinstance(numel, bool) or not isinstance(numel, int) or numel < 0:
        raise ValueError(f"`numel` must be an int >= 0. Received: numel={numel!r}")
    return max(minimum, -(-numel // num_shards))


def padded_size(numel, num_shards, minimum=0):
    """`numel` rounded up to a whole number of shards."""
    return shard_size(numel, num_shards, minimum) * num_shards


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
        num_shards: the number of replicas sharing the variables.
        minimum: the fewest elements a shard holds (1 for a `FullyShard`
            weight, whose shard is a variable of its own).
    """

    sizes: tuple
    num_shards: int
    minimum: int = 0

    def __post_init__(self):
        _check_positive_int(self.num_shards, "num_shards")
        object.__setattr__(self, "sizes", tuple(int(n) for n in self.sizes))
        for n in self.sizes:
            shard_size(n, self.num_shards)  # validates n

    @property
    def shard_sizes(self):
        """Elements each replica holds per variable."""
        return tuple(shard_size(n, self.num_shards, self.minimum) for n in self.sizes)

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
        return Layout(self.sizes[start:stop], self.num_shards, self.minimum)


# --- Flat shards (TensorFlow) -------------------------------------------------------


def flatten_padded(x, numel, num_shards, dtype=None, minimum=0):
    """`x` flattened, cast to `dtype`, zero-padded to a whole number of shards."""
    flat = tf.reshape(x, [-1])
    if dtype is not None:
        flat = tf.cast(flat, dtype)
    pad = padded_size(numel, num_shards, minimum) - numel
    if pad:
        flat = tf.concat([flat, tf.zeros([pad], flat.dtype)], 0)
    return flat


def pack(tensors, layout, dtype=None):
    """Packs full-size tensors into the member-major ``[N * S]`` buffer."""
    n = layout.num_shards
    columns = [
        tf.reshape(flatten_padded(t, numel, n, dtype, layout.minimum), [n, s])
        for t, numel, s in zip(tensors, layout.sizes, layout.shard_sizes)
    ]
    packed = tf.concat(columns, axis=1) if len(columns) > 1 else columns[0]
    return tf.reshape(packed, [layout.packed_size])


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


# --- Flat shards (numpy, host side) ----------------------------------------------


def slice_flat(full, num_shards, index, minimum=1):
    """Replica `index`'s piece of the numpy array `full` (flattened, padded)."""
    flat = np.reshape(np.asarray(full), -1)
    k = shard_size(int(flat.size), int(num_shards), minimum)
    flat = np.pad(flat, (0, k * num_shards - flat.size))
    return flat[index * k : (index + 1) * k]


def unflatten(gathered, shape):
    """The full array from the concatenation of every replica's piece."""
    size = math.prod(shape)
    return np.reshape(np.asarray(gathered)[:size], shape)


# --- Concatenation: several tensors through one collective ------------------------


def concat_flat(values, dtype):
    """Flattens `values` (statically shaped) into one vector of `dtype`.

    Returns ``(vector, sizes)``, the layout `split_flat` inverts.
    """
    sizes = [int(v.shape.num_elements()) for v in values]
    flat = tf.concat([tf.reshape(tf.cast(v, dtype), [-1]) for v in values], axis=0)
    return flat, sizes


def split_flat(flat, sizes, shapes, dtypes):
    """The pieces of a `concat_flat` vector, reshaped and cast back."""
    return [
        tf.cast(tf.reshape(piece, shape), dtype)
        for piece, shape, dtype in zip(tf.split(flat, sizes), shapes, dtypes)
    ]


def packed(values, reduce):
    """``reduce`` applied once to all `values` (one dtype), split back.

    One value is reduced as is; several are flattened and concatenated,
    reduced, and each slice reshaped to its value's shape. Shapes may be
    dynamic.
    """
    if len(values) == 1:
        return [reduce(values[0])]
    flat = reduce(tf.concat([tf.reshape(v, [-1]) for v in values], 0))
    pieces = tf.split(flat, [tf.size(v) for v in values])
    return [tf.reshape(p, tf.shape(v)) for p, v in zip(pieces, values)]


def packed_gather(values, gather, n):
    """``gather`` (an all-gather over n members) applied once to all `values`.

    Member m's block of the gathered vector is the concatenation of its
    flattened values; value i's result is every member's piece i, stacked
    along axis 0 in member order, which is what gathering it alone gives.
    """
    if len(values) == 1:
        return [gather(values[0])]
    sizes = [tf.size(v) for v in values]
    flat = gather(tf.concat([tf.reshape(v, [-1]) for v in values], 0))
    blocks = tf.split(tf.reshape(flat, [n, -1]), sizes, axis=1)
    return [
        tf.reshape(b, tf.concat([[n * tf.shape(v)[0]], tf.shape(v)[1:]], 0))
        for b, v in zip(blocks, values)
    ]


def packed_scatter(values, scatter, n):
    """``scatter`` (a reduce-scatter SUM over n members) applied once to all `values`.

    Each value is laid out as ``[n, rest]`` (row m: the slice member m
    keeps); the rows are concatenated across values (member-major), so
    member m's slice of the packed vector holds its slice of every value.
    """
    if len(values) == 1:
        return [scatter(values[0])]
    rows = [tf.reshape(v, [n, -1]) for v in values]
    mine = scatter(tf.reshape(tf.concat(rows, 1), [-1]))
    pieces = tf.split(mine, [tf.shape(r)[1] for r in rows])
    return [
        tf.reshape(p, tf.concat([[tf.shape(v)[0] // n], tf.shape(v)[1:]], 0))
        for p, v in zip(pieces, values)
    ]
