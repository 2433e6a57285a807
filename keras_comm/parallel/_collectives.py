"""The collectives the model-parallel layers share: gathers and the batch exchange.

The batch convention of every layer of `keras_comm.parallel`: under
`model.fit` each replica holds its own slice of the global batch (data
parallel), while a tensor-parallel layer needs the same input on all members
of its model group. So a layer entering a model-parallel region all-gathers
the batch over the group (each member then computes its shard for the
group's samples), and the layer leaving it reduce-scatters along the batch
(each member keeps the rows of its own samples).
"""

import tensorflow as tf

from keras_comm import ops
from keras_comm import topology
from keras_comm._private import keras_api


# True when Keras traces a layer for shapes in cross-replica context (its
# symbolic build): the layers then use local stand-ins with the same output
# shapes (`tile`, slices) and rank 0's group. The same detector as the
# collectives' (see keras_api.in_symbolic_build).
shape_only = keras_api.in_symbolic_build


def my_rank():
    return 0 if shape_only() else topology.rank()


def gather_along(x, axis, group, name=None, timeout=None):
    """All-gathers `x` over `group` along `axis` (any axis)."""
    if group.size == 1:
        return tf.identity(x)
    if shape_only():
        return tf.concat([x] * group.size, axis=axis)
    if axis == 0:
        return ops.all_gather(x, group=group, timeout=timeout, name=name)
    moved = tf.experimental.numpy.moveaxis(x, axis, 0)
    gathered = ops.all_gather(moved, group=group, timeout=timeout, name=name)
    return tf.experimental.numpy.moveaxis(gathered, 0, axis)


def gather_batch(x, group, name, timeout):
    """Enter a model-parallel region: the group's samples on every member."""
    return gather_along(x, 0, group, name, timeout)


def scatter_batch_sum(x, group, name, timeout):
    """Leave it: sum the members' partial results, keep own samples' rows."""
    if group.size == 1:
        return x
    if shape_only():
        return x[: tf.shape(x)[0] // group.size]
    return ops.reduce_scatter(x, group=group, timeout=timeout, name=name)


def own_rows(x, group):
    """This member's rows of a batch gathered over `group`."""
    if group.size == 1:
        return x
    rows = tf.shape(x)[0] // group.size
    i = group.index(my_rank())
    return x[i * rows : (i + 1) * rows]
