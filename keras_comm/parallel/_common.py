"""Argument checks and batch exchange shared by the model-parallel layers.

The batch convention of every layer here: under `model.fit` each replica
holds its own slice of the global batch (data parallel), while a
tensor-parallel layer needs the same input on all members of its model
group. So a layer entering a model-parallel region all-gathers the batch over
the group (each member then computes its shard for the group's samples), and
the layer leaving it reduce-scatters along the batch (each member keeps the
rows of its own samples). Plain Keras layers before and after see ordinary
per-replica batches; members of one group must hold equally many samples.
"""

import keras
import tensorflow as tf

from keras_comm import config
from keras_comm import ops
from keras_comm import topology
from keras_comm.parallel import mesh as mesh_lib


def check_positive_int(value, name):
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(
            f"`{name}` must be a positive int. Received: {name}={value!r}"
        )
    return value


def check_divisible(value, n, name, group_what):
    if value % n:
        raise ValueError(
            f"`{name}` must be divisible by the {group_what} size {n}. "
            f"Received: {name}={value}"
        )


def check_timeout(timeout):
    return None if timeout is None else config.validate_timeout(timeout)


class ParallelLayer(keras.layers.Layer):
    """Base of the model-parallel layers: mesh, axis, seed and timeout.

    Args:
        mesh: a `keras_comm.parallel.Mesh`, a list of groups (explicit
            `axis` groups, see `Mesh.from_groups`) or None (one group: the
            whole world).
        axis: the mesh axis the layer is split over.
        seed: int seed of the full weights' initializers (None: derived from
            each weight's path, the same on every worker).
        timeout: seconds; None for `keras_comm.get_timeout()`.
    """

    def __init__(self, mesh=None, axis="model", seed=None, timeout=None, **kwargs):
        super().__init__(**kwargs)
        if not isinstance(axis, str):
            raise TypeError(f"`axis` must be a mesh axis name. Received: axis={axis!r}")
        if seed is not None and (isinstance(seed, bool) or not isinstance(seed, int)):
            raise TypeError(f"`seed` must be an int or None. Received: seed={seed!r}")
        self.mesh, self.axis = mesh_lib.resolve_mesh(mesh, axis, type(self).__name__)
        self.seed = seed
        self.timeout = check_timeout(timeout)

    def static_group_size(self):
        """The group size if known at construction (a mesh was given), else None."""
        return None if self.mesh is None else self.mesh.axis_size(self.axis)

    def group_size(self):
        """The group size now (the world size when `mesh` is None)."""
        return mesh_lib.runtime_mesh(self.mesh, self.axis).axis_size(self.axis)

    def group(self):
        """The calling replica's group (rank 0's when tracing shapes only)."""
        rank = 0 if shape_only() else None
        return mesh_lib.runtime_mesh(self.mesh, self.axis).group(self.axis, rank)

    def weight_seed(self, offset):
        return None if self.seed is None else self.seed + offset

    def get_config(self):
        config = super().get_config()
        config.update(
            mesh=None if self.mesh is None else self.mesh.get_config(),
            axis=self.axis,
            seed=self.seed,
            timeout=self.timeout,
        )
        return config


def shape_only():
    """True when Keras traces a layer for shapes in cross-replica context.

    Keras's symbolic build (`model.fit`, `compute_output_spec`) calls layers
    on placeholder tensors outside any replica. There is no "this replica"
    and nothing may be communicated, so the layers use local stand-ins with
    the same output shapes (`tile`, slices) and rank 0's group.
    """
    return (
        tf.distribute.has_strategy()
        and tf.distribute.in_cross_replica_context()
        and tf.distribute.get_strategy().num_replicas_in_sync > 1
    )


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
