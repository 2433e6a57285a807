"""Which block of a weight each replica holds under a `TensorLayout` (pure maths).

A `keras.distribution.TensorLayout` names, for each dimension of a weight,
the mesh axis it is split over (or None: whole). The mesh's replicas are
laid out row-major in the mesh shape (replica rank ``r`` sits at
``np.unravel_index(r, mesh_shape)``). A dimension split over axis ``a`` of
size ``n`` is cut into ``n`` equal pieces, and a replica holds the piece
numbered by its coordinate on ``a``; a dimension split over several axes
(``("batch", "model")``) is cut into the product of their sizes, numbered
row-major over those axes. A replica's *block* is its piece of every
dimension.

Two groups follow from that:

* the *gather group* of a dimension: the replicas that differ only in the
  dimension's axes. They hold the blocks that together make the whole
  dimension, ordered by rank (the row-major layout makes rank order and
  piece order agree), so one all-gather over them rebuilds it;
* the *data group*: the replicas that hold the same block (they differ only
  in the axes the layout does not use). Their gradients are summed.

Nothing here communicates; `keras_comm.distribution._variable` does.
"""

import dataclasses
import math

import numpy as np

from keras_comm import topology


@dataclasses.dataclass(frozen=True)
class Blocks:
    """How one weight is split over the mesh.

    Attributes:
        path: the weight's path (for messages).
        full_shape: the whole weight's shape.
        dim_axes: per dimension, the tuple of mesh axes it is split over
            (empty: not split).
        mesh_shape: the mesh shape.
        mesh_axes: the mesh axis names.
    """

    path: str
    full_shape: tuple
    dim_axes: tuple
    mesh_shape: tuple
    mesh_axes: tuple

    @property
    def is_split(self):
        """Whether some dimension is cut into more than one piece."""
        return any(self.pieces(d) > 1 for d in range(len(self.full_shape)))

    def pieces(self, dim):
        """How many pieces dimension `dim` is cut into."""
        return math.prod(self.mesh_shape[self.mesh_axes.index(a)] for a in self.dim_axes[dim])

    @property
    def block_shape(self):
        return tuple(s // self.pieces(d) for d, s in enumerate(self.full_shape))

    def coordinates(self, rank):
        return tuple(int(c) for c in np.unravel_index(rank, self.mesh_shape))

    def block_index(self, rank):
        """Per dimension, which piece `rank` holds."""
        coords = self.coordinates(rank)
        out = []
        for axes in self.dim_axes:
            index = 0
            for a in axes:
                i = self.mesh_axes.index(a)
                index = index * self.mesh_shape[i] + coords[i]
            out.append(index)
        return tuple(out)

    def slice(self, full, rank):
        """`rank`'s block of the array `full` (numpy or any sliceable tensor)."""
        index = self.block_index(rank)
        block = self.block_shape
        return full[tuple(slice(i * b, (i + 1) * b) for i, b in zip(index, block))]

    def _ranks_varying(self, axes, rank):
        coords = self.coordinates(rank)
        ranks = np.arange(math.prod(self.mesh_shape)).reshape(self.mesh_shape)
        index = tuple(
            slice(None) if a in axes else coords[i] for i, a in enumerate(self.mesh_axes)
        )
        return topology.Group([int(r) for r in np.reshape(ranks[index], -1)])

    def gather_group(self, dim, rank):
        """The replicas whose blocks make up dimension `dim` (rank order = piece order)."""
        return self._ranks_varying(self.dim_axes[dim], rank)

    def data_group(self, rank):
        """The replicas holding the same block as `rank`."""
        used = {a for axes in self.dim_axes for a in axes}
        return self._ranks_varying([a for a in self.mesh_axes if a not in used], rank)

    def assemble(self, block_of, concat):
        """The whole weight from the blocks: ``block_of(index) -> block``.

        `concat(parts, axis)` joins arrays (numpy's or TensorFlow's).
        """

        def build(prefix):
            dim = len(prefix)
            if dim == len(self.full_shape):
                return block_of(tuple(prefix))
            parts = [build(prefix + [i]) for i in range(self.pieces(dim))]
            return parts[0] if len(parts) == 1 else concat(parts, dim)

        return build([])

    def owner(self, index, ranks):
        """The first of `ranks` that holds the block `index`, or None."""
        for r in ranks:
            if self.block_index(r) == tuple(index):
                return r
        return None


def _layout_text(axes):
    return "(" + ", ".join(repr(a) for a in axes) + ("," if len(axes) == 1 else "") + ")"


def resolve(path, full_shape, layout_axes, mesh_shape, mesh_axes):
    """The `Blocks` of a weight, checked.

    Args:
        path: the weight's path.
        full_shape: its shape.
        layout_axes: the `TensorLayout.axes`: per dimension None, a mesh
            axis name, or a tuple of them.
        mesh_shape / mesh_axes: the mesh.

    Raises:
        ValueError: the layout has another rank than the weight, names an
            axis the mesh lacks or an axis twice (or several axes out of
            mesh order), or splits a dimension into pieces that do not
            divide it. The message names the weight and the layout.
    """
    full_shape = tuple(int(s) for s in full_shape)
    mesh_shape = tuple(int(s) for s in mesh_shape)
    mesh_axes = tuple(mesh_axes)
    layout_axes = tuple(layout_axes)
    where = f"Weight {path!r} of shape {full_shape} under layout {_layout_text(layout_axes)}"
    if len(layout_axes) != len(full_shape):
        raise ValueError(
            f"{where}: a layout must name one entry (a mesh axis or None) per "
            f"dimension of the weight. Received: {len(layout_axes)} entries for "
            f"{len(full_shape)} dimensions"
        )
    dim_axes, seen = [], set()
    for dim, entry in enumerate(layout_axes):
        axes = () if entry is None else (entry,) if isinstance(entry, str) else tuple(entry)
        for a in axes:
            if a not in mesh_axes:
                raise ValueError(
                    f"{where}: dimension {dim} is split over mesh axis {a!r}, which "
                    f"the mesh does not have (its axes: {mesh_axes}). Received: {a!r}"
                )
            if a in seen:
                raise ValueError(
                    f"{where}: mesh axis {a!r} splits more than one dimension; each "
                    f"axis may split one. Received: {_layout_text(layout_axes)}"
                )
            seen.add(a)
        if list(axes) != sorted(axes, key=mesh_axes.index):
            raise ValueError(
                f"{where}: the axes splitting one dimension must be in the mesh's "
                f"order {mesh_axes}. Received: {axes}"
            )
        dim_axes.append(axes)
    blocks = Blocks(path, full_shape, tuple(dim_axes), mesh_shape, mesh_axes)
    for dim, size in enumerate(full_shape):
        n = blocks.pieces(dim)
        if size % n:
            raise ValueError(
                f"{where}: dimension {dim} is split into {n} pieces (the size of "
                f"{dim_axes[dim]}), so it must be divisible by {n}. "
                f"Received: {path}.shape[{dim}]={size}"
            )
    return blocks
