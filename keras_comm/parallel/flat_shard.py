"""Flat shards: each replica's 1/N of a weight flattened and padded (pure maths).

A weight of shape ``s`` (``size = prod(s)`` elements) split over ``n``
replicas is flattened, padded with zeros to ``n * k`` elements where
``k = ceil(size / n)``, and cut into ``n`` contiguous pieces of ``k``:
replica ``i`` holds elements ``[i*k, (i+1)*k)``. Any shape splits over any
group size; at most ``n - 1`` padding elements per weight, which stay zero
under training (their gradient is zero, and so is every optimizer's update of
a zero weight with a zero gradient, weight decay included).

The weights of one `FullyShard` move in one collective per direction,
packed member-major (`keras_comm.variables.packing`, where the layout is
written down).
"""

import dataclasses
import math

from keras_comm.parallel import sharded
from keras_comm.variables import packing

# A flat shard is a variable of its own, so it holds at least one element.
_MINIMUM = 1


def shard_size(size, num_shards):
    """Elements per replica: ``ceil(size / num_shards)``, at least 1."""
    return packing.shard_size(int(size), int(num_shards), _MINIMUM)


def padded_size(size, num_shards):
    return packing.padded_size(int(size), int(num_shards), _MINIMUM)


slice_flat = packing.slice_flat
unflatten = packing.unflatten


@dataclasses.dataclass(frozen=True)
class FlatShardSpec(sharded.ShardSpec):
    """A weight split as flat, padded pieces (see the module docstring).

    `full_shape` is the unwrapped weight's shape (what a file holds);
    `shard_shape` is ``(k,)``. `shard_axis` is 0: the axis of the flat
    pieces. The checkpoint code (`keras_comm.parallel._checkpoint`) gathers
    with `gather_replica` and rebuilds with `to_full`.
    """

    @property
    def size(self):
        return math.prod(self.full_shape)

    @property
    def shard_shape(self):
        return (shard_size(self.size, self.num_shards),)

    @property
    def padding(self):
        return padded_size(self.size, self.num_shards) - self.size

    def slice(self, full, index):
        return slice_flat(full, self.num_shards, index)

    def to_full(self, gathered):
        return unflatten(gathered, self.full_shape)


def memory_accounting(shapes, num_shards, bytes_per_element=4, slots=0):
    """Per-replica bytes of parameters, gradients and optimizer slots.

    Args:
        shapes: the unwrapped weights' shapes.
        num_shards: the group size.
        bytes_per_element: of the master weights (4 for float32).
        slots: optimizer slots per weight (Adam: 2, SGD: 0, momentum SGD: 1).

    Returns:
        ``{"unsharded": bytes, "sharded": bytes, "padding": bytes}``: what
        one replica holds without and with flat sharding (weights +
        gradient + slots), and how much of the latter is padding.
    """
    copies = 2 + slots
    full = sum(math.prod(s) for s in shapes)
    per = sum(shard_size(math.prod(s), num_shards) for s in shapes)
    pad = sum(padded_size(math.prod(s), num_shards) - math.prod(s) for s in shapes)
    return {
        "unsharded": copies * full * bytes_per_element,
        "sharded": copies * per * bytes_per_element,
        "padding": copies * pad * bytes_per_element // num_shards,
    }
