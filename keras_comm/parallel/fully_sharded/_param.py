"""Per-parameter state of a `FullyShard` layer: how each weight is split and reduced.

[Note: flat shards] A weight of shape ``s`` (``size = prod(s)`` elements)
split over ``n`` replicas is flattened, padded with zeros to ``n * k``
elements where ``k = ceil(size / n)`` (at least 1: a shard is a variable of
its own), and cut into ``n`` contiguous pieces of ``k``: replica ``i`` holds
elements ``[i*k, (i+1)*k)``. The layout and its packing are
`keras_comm.variables.packing`'s.
"""


import dataclasses
import enum
import math

import keras
import tensorflow as tf

from keras_comm import _validation
from keras_comm import ops
from keras_comm.parallel import sharded_weights
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
class FlatShardSpec(sharded_weights.ShardSpec):
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


class Hidden:
    """Holds the inner layer and private state out of Keras's and TF's tracking.

    A tracked inner layer would put its (unallocated) variables into the
    model's weights and its own entry into checkpoints.
    """

    def __init__(self, layer, initial):
        self.layer = layer
        self.initial = initial
        self.pending = None
        self.structure = None
        self.num_variables = None
        self.takes_training = False
        self.acc = {}
        self.count = None
        self.gathered = None  # full trainable values held by `gathered`


def weight_name(inner, variable):
    path = variable.path
    prefix = inner.name + "/"
    if path.startswith(prefix):
        path = path[len(prefix):]
    return path.replace("/", "_")


def reduce_over_other_axes(spec, grad, name):
    """Replica context: the shard gradient is summed over the shard group
    already; sum it over the replicas holding the same shard."""
    group = spec.data_group()
    if group.size == 1 or grad is None:
        return grad
    return ops.all_reduce(grad, group=group, name=f"{name}_shard_grad")


class Accumulation(enum.Enum):
    """How a `FullyShard` layer's gradients are accumulated over micro-batches.

    SHARDED: reduce-scatter every micro-batch; accumulate 1/N shards.
    LOCAL: accumulate the full local gradient; reduce-scatter once per update.
    """

    SHARDED = "sharded"
    LOCAL = "local"

    @classmethod
    def from_value(cls, value):
        if isinstance(value, cls):
            return value
        _validation.one_of(value, [m.value for m in cls], "accumulation")
        return cls(value)


def is_float(dtype):
    return tf.as_dtype(keras.backend.standardize_dtype(dtype)).is_floating
