"""Argument checks of the ops (pure Python: no TensorFlow).

The checks every tier shares (ints, bools, counts, ranks, choices) live in
`keras_comm._validation`; these are the ops' own: roots and axes against a
group or a rank, divisibility of a dimension, tags. Each names the argument,
states the rule and ends with ``Received: name=value``. `what` is the prefix
naming the op (and its layer) in messages about the op as a whole.
"""

from keras_comm import _validation


def what(fn_name, name=None):
    """The op's name in error messages: ``keras_comm.ops.fn (layer 'name')``."""
    if name:
        return f"keras_comm.ops.{fn_name} (layer {name!r})"
    return f"keras_comm.ops.{fn_name}"


def check_tag(tag, arg="tag"):
    """Returns `tag` if it is an int >= 0 (negative tags are keras_comm's own)."""
    return _validation.integer(
        tag, arg, minimum=0,
        rule="an int >= 0 (negative tags are reserved for keras_comm's exchanges)",
    )


def member_index(group, rank, arg, what_):
    """The index in `group` of the global `rank` given as argument `arg`.

    For root / dest / src arguments, which must name a member.
    """
    if isinstance(rank, bool) or not isinstance(rank, int):
        raise TypeError(f"{what_}: `{arg}` must be an int global rank. Received: {arg}={rank!r}")
    if rank not in group:
        raise ValueError(
            f"{what_}: `{arg}` must be a global rank in the group "
            f"{list(group.ranks)}. Received: {arg}={rank!r}"
        )
    return group.index(rank)


def normalize_axis(axis, rank, arg, what_):
    """`axis` in ``[-rank, rank)`` as a non-negative axis."""
    _validation.integer(axis, arg)
    if not -rank <= axis < rank:
        raise ValueError(
            f"{what_}: `{arg}` must be in [{-rank}, {rank}) for an input of rank "
            f"{rank}. Received: {arg}={axis}"
        )
    return axis % rank


def check_known_rank(shape, what_, arg="x"):
    """Raises unless `shape` (a TensorShape) has a known rank >= 1."""
    if shape.rank is None or shape.rank == 0:
        raise ValueError(
            f"{what_}: `{arg}` must have a known rank >= 1. Received: {arg}.shape={shape}"
        )


def check_divisible(shape, axis, n, what_, arg="x"):
    """Raises if dimension `axis` of `shape` is static and not a multiple of `n`.

    A scalar has no dimension to split; an unknown rank passes (checked when
    the op runs).
    """
    if shape.rank == 0:
        raise ValueError(f"{what_}: `{arg}` must have rank >= 1. Received: {arg}.shape={shape}")
    if shape.rank is None:
        return
    dim = shape[axis]
    if dim is not None and dim % n:
        raise ValueError(
            f"{what_}: dimension {axis} of `{arg}` must be divisible by the group "
            f"size {n}. Received: {arg}.shape={shape}"
        )


def mean_argument(mean, mean_flag, default):
    """The `mean` argument, also accepted under its former name `mean_flag`.

    `mean` (divide the reduced gradient by the group size) is the word the
    layers and ParallelOptimizer use; the ops took MindSpore's `mean_flag`
    before, and calls using it keep working. Passing both is an error.
    """
    if mean_flag is None:
        return _validation.boolean(mean, "mean")
    if mean != default:
        raise TypeError(
            "`mean_flag` is the old name of `mean`; pass only `mean`. "
            f"Received: mean={mean!r}, mean_flag={mean_flag!r}"
        )
    return _validation.boolean(mean_flag, "mean_flag")
