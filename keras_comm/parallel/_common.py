"""The base of the model-parallel layers: mesh, axis, seed, timeout, checkpoints.

Every layer derived from `ParallelLayer` follows the batch convention of
`keras_comm.parallel._collectives` (each replica holds its own samples
outside a model-parallel region) and saves its sharded weights full-size
(`keras_comm.parallel._checkpoint`).
"""

import keras

from keras_comm import _validation
from keras_comm.layers._base import CollectiveLayer
from keras_comm.parallel import _checkpoint
from keras_comm.parallel import mesh as mesh_lib
from keras_comm.parallel._collectives import shape_only


class ParallelLayer(CollectiveLayer):
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
        super().__init__(timeout=timeout, **kwargs)
        if not isinstance(axis, str):
            raise TypeError(f"`axis` must be a mesh axis name. Received: axis={axis!r}")
        self.mesh, self.axis = mesh_lib.resolve_mesh(mesh, axis, type(self).__name__)
        if seed is not None:
            _validation.integer(seed, "seed", rule="an int or None")
        self.seed = seed

    # These layers compute (ids in, floats out): their outputs have the
    # layer's compute dtype, as for any Keras layer, not the input's.
    compute_output_spec = keras.layers.Layer.compute_output_spec

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

    def split_size(self, value, name, built=False):
        """`value`, a size split over the group, checked divisible by the group size.

        Checked at construction (``built=False``) only when a mesh gives
        the size then; at build (``built=True``) always.
        """
        n = self.group_size() if built else self.static_group_size()
        if n is not None:
            _validation.divisible(value, n, name, f"{self.axis!r} group size")
        return value

    def weight_seed(self, offset):
        return None if self.seed is None else self.seed + offset

    # Sharded weights are saved full-size and loaded as this replica's slice
    # (keras_comm.parallel._checkpoint); saving gathers, so every worker saves.
    def save_own_variables(self, store):
        _checkpoint.save_layer(self, store)

    def load_own_variables(self, store):
        _checkpoint.load_layer(self, store)

    def get_config(self):
        config = super().get_config()
        config.update(
            mesh=None if self.mesh is None else self.mesh.get_config(),
            axis=self.axis,
            seed=self.seed,
        )
        return config
