"""A logical mesh of replicas: tensor-, expert- and data-parallel groups.

Replica ranks are laid out in a row-major array of `shape`; each axis has a
name. The group of a rank along an axis is the set of ranks that differ from
it only in that axis' coordinate. With ``Mesh((2, 2), ("data", "model"))`` on
four replicas, the "model" groups are ``[0, 1]`` and ``[2, 3]`` (tensor
parallel: they hold different shards of a weight) and the "data" groups
``[0, 2]`` and ``[1, 3]`` (data parallel: they hold the same shard and see
different samples).
"""

import numpy as np

from keras_comm import topology


def _check_axes(shape, axes):
    if isinstance(shape, int) or not hasattr(shape, "__iter__"):
        raise TypeError(
            f"`shape` must be a tuple of ints. Received: shape={shape!r}"
        )
    shape = tuple(shape)
    if not shape or any(
        isinstance(s, bool) or not isinstance(s, (int, np.integer)) or s < 1
        for s in shape
    ):
        raise ValueError(
            f"`shape` must be a non-empty tuple of ints >= 1. Received: shape={shape!r}"
        )
    if isinstance(axes, str) or not hasattr(axes, "__iter__"):
        raise TypeError(
            f"`axes` must be a tuple of axis names. Received: axes={axes!r}"
        )
    axes = tuple(axes)
    if len(axes) != len(shape) or not all(isinstance(a, str) and a for a in axes):
        raise ValueError(
            f"`axes` must hold one non-empty name per dimension of `shape` "
            f"{shape}. Received: axes={axes!r}"
        )
    if len(set(axes)) != len(axes):
        raise ValueError(f"`axes` must be distinct. Received: axes={axes!r}")
    return tuple(int(s) for s in shape), axes


class Mesh:
    """Replicas arranged on named axes, for model and data parallelism.

    Args:
        shape: tuple of ints, the mesh shape; its product must equal the
            number of replicas in sync when the mesh is used.
        axes: tuple of distinct axis names, one per dimension (e.g.
            ``("data", "model")``).

    Raises:
        TypeError / ValueError: malformed `shape` or `axes`.

    Example:

    >>> mesh = keras_comm.parallel.Mesh(shape=(2, 2), axes=("data", "model"))
    >>> mesh.groups("model")
    [Group([0, 1]), Group([2, 3])]
    >>> mesh.group("data", rank=1)
    Group([1, 3])
    """

    def __init__(self, shape, axes):
        self._shape, self._axes = _check_axes(shape, axes)
        self._ranks = np.arange(int(np.prod(self._shape))).reshape(self._shape)

    @classmethod
    def from_groups(cls, groups, axes=("data", "model")):
        """A 2-D mesh whose `axes[1]` groups are `groups` (given explicitly).

        Group i is row i of the mesh; the `axes[0]` groups gather the ranks
        at the same position of every group.

        Raises:
            ValueError: groups of different sizes, overlapping groups, or
                groups that do not cover ``0 .. world - 1``.
        """
        groups = [topology.as_group(g, name="groups") for g in groups]
        if not groups:
            raise ValueError("`groups` must not be empty. Received: groups=[]")
        sizes = {g.size for g in groups}
        if len(sizes) != 1:
            raise ValueError(
                "`groups` must all have the same size. "
                f"Received: groups={[list(g.ranks) for g in groups]}"
            )
        seen = {}
        for g in groups:
            for r in g.ranks:
                if r in seen:
                    raise ValueError(
                        f"`groups` overlap: rank {r} is in {list(seen[r].ranks)} "
                        f"and {list(g.ranks)}. "
                        f"Received: groups={[list(g.ranks) for g in groups]}"
                    )
                seen[r] = g
        world = len(seen)
        if sorted(seen) != list(range(world)):
            raise ValueError(
                f"`groups` must cover ranks 0..{world - 1} exactly. "
                f"Received: groups={[list(g.ranks) for g in groups]}"
            )
        mesh = cls((len(groups), sizes.pop()), axes)
        mesh._ranks = np.array([list(g.ranks) for g in groups])
        return mesh

    @property
    def shape(self):
        return self._shape

    @property
    def axes(self):
        return self._axes

    @property
    def size(self):
        """Number of replicas the mesh spans."""
        return int(self._ranks.size)

    def axis_size(self, axis):
        return self._shape[self._axis_index(axis)]

    def _axis_index(self, axis):
        if axis not in self._axes:
            raise ValueError(
                f"`axis` must be one of the mesh axes {self._axes}. Received: axis={axis!r}"
            )
        return self._axes.index(axis)

    def check_world(self, world_size):
        """Raises ValueError unless the mesh spans exactly `world_size` replicas."""
        if self.size != world_size:
            raise ValueError(
                f"The mesh shape {self._shape} spans {self.size} replicas, but "
                f"{world_size} replica(s) are in sync: the product of `shape` "
                f"must equal the world size. Received: shape={self._shape}"
            )

    def coordinates(self, rank):
        """The mesh coordinates of global `rank`, one per axis."""
        where = np.argwhere(self._ranks == rank)
        if not len(where):
            raise ValueError(
                f"`rank` must be in 0..{self.size - 1}. Received: rank={rank}"
            )
        return tuple(int(c) for c in where[0])

    def groups(self, axis):
        """All groups along `axis` (a partition of the mesh's ranks)."""
        i = self._axis_index(axis)
        moved = np.moveaxis(self._ranks, i, -1).reshape(-1, self._shape[i])
        return [topology.Group([int(r) for r in row]) for row in moved]

    def group(self, axis, rank=None):
        """The group along `axis` containing `rank` (default: the calling replica).

        Raises:
            ValueError: the mesh does not span the world (with `rank=None`).
        """
        if rank is None:
            self.check_world(topology.world_size())
            rank = topology.rank()
        for g in self.groups(axis):
            if rank in g:
                return g
        raise ValueError(f"`rank` must be in 0..{self.size - 1}. Received: rank={rank}")

    def other_axes_group(self, axis, rank=None):
        """Ranks sharing `rank`'s `axis` coordinate (all other axes vary).

        For a weight sharded along `axis`, these replicas hold the same shard:
        its data-parallel group.
        """
        if rank is None:
            self.check_world(topology.world_size())
            rank = topology.rank()
        i = self._axis_index(axis)
        c = self.coordinates(rank)[i]
        return topology.Group(
            [int(r) for r in np.take(self._ranks, c, axis=i).reshape(-1)]
        )

    def get_config(self):
        config = {"shape": list(self._shape), "axes": list(self._axes)}
        if not np.array_equal(self._ranks.reshape(-1), np.arange(self.size)):
            config["ranks"] = self._ranks.tolist()
        return config

    @classmethod
    def from_config(cls, config):
        if "ranks" in config:
            return cls.from_groups(config["ranks"], config["axes"])
        return cls(config["shape"], config["axes"])

    def __eq__(self, other):
        return (
            isinstance(other, Mesh)
            and other._axes == self._axes
            and np.array_equal(other._ranks, self._ranks)
        )

    def __hash__(self):
        return hash((self._axes, self._ranks.tobytes()))

    def __repr__(self):
        return f"Mesh(shape={self._shape}, axes={self._axes})"


def resolve_mesh(mesh, axis, what):
    """`(mesh, axis)` for a layer: None means a 1-D mesh over the whole world.

    `mesh` may be a `Mesh`, its config dict, a list of rank lists (explicit
    groups along `axis`, see `Mesh.from_groups`) or None.
    """
    if mesh is None:
        return None, axis
    if isinstance(mesh, Mesh):
        out = mesh
    elif isinstance(mesh, dict):
        out = Mesh.from_config(mesh)
    elif isinstance(mesh, (list, tuple)):
        out = Mesh.from_groups(mesh, axes=("data", axis))
    else:
        raise TypeError(
            f"{what}: `mesh` must be a keras_comm.parallel.Mesh, a list of "
            f"groups or None. Received: mesh={mesh!r}"
        )
    out._axis_index(axis)
    return out, axis


def runtime_mesh(mesh, axis):
    """The mesh to use now: `mesh`, or a 1-D mesh over the current world."""
    world = topology.world_size()
    if mesh is None:
        return Mesh((world,), (axis,))
    mesh.check_world(world)
    return mesh
