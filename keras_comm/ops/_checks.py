"""Argument checks shared by the ops (pure Python: no TensorFlow).

Each check names the argument, states the rule and ends with
``Received: name=value``, and returns the normalized value. `what` is the
prefix naming the op (and its layer) in messages that concern the op rather
than one argument.
"""


def what(fn_name, name=None):
    """The op's name in error messages: ``keras_comm.ops.fn (layer 'name')``."""
    if name:
        return f"keras_comm.ops.{fn_name} (layer {name!r})"
    return f"keras_comm.ops.{fn_name}"


def _is_int(value):
    return isinstance(value, int) and not isinstance(value, bool)


def check_int(value, arg):
    """Returns `value` if it is an int (not a bool); TypeError otherwise."""
    if not _is_int(value):
        raise TypeError(f"`{arg}` must be an int. Received: {arg}={value!r}")
    return value


def check_bool(value, arg):
    """Returns `value` if it is a bool; TypeError otherwise."""
    if not isinstance(value, bool):
        raise TypeError(f"`{arg}` must be a bool. Received: {arg}={value!r}")
    return value


def check_choice(value, arg, choices):
    """Returns `value` if it is one of `choices`; ValueError otherwise."""
    if value not in choices:
        raise ValueError(f"`{arg}` must be one of {tuple(choices)}. Received: {arg}={value!r}")
    return value


def check_positive_int(value, arg):
    """Returns `value` if it is an int >= 1; ValueError otherwise."""
    if not _is_int(value) or value < 1:
        raise ValueError(f"`{arg}` must be an int >= 1. Received: {arg}={value!r}")
    return value


def check_rank(value, arg):
    """Returns `value` if it is a global rank (an int >= 0)."""
    if not _is_int(value):
        raise TypeError(f"`{arg}` must be an int global rank. Received: {arg}={value!r}")
    if value < 0:
        raise ValueError(f"`{arg}` must be a global rank >= 0. Received: {arg}={value!r}")
    return int(value)


def check_tag(tag, arg="tag"):
    """Returns `tag` if it is an int >= 0 (negative tags are keras_comm's own)."""
    if not _is_int(tag):
        raise TypeError(f"`{arg}` must be an int >= 0. Received: {arg}={tag!r}")
    if tag < 0:
        raise ValueError(
            f"`{arg}` must be >= 0 (negative tags are reserved for keras_comm's "
            f"exchanges). Received: {arg}={tag!r}"
        )
    return int(tag)


def member_index(group, rank, arg, what_):
    """The index in `group` of the global `rank` given as argument `arg`.

    For root / dest / src arguments, which must name a member.
    """
    if not _is_int(rank):
        raise TypeError(f"{what_}: `{arg}` must be an int global rank. Received: {arg}={rank!r}")
    if rank not in group:
        raise ValueError(
            f"{what_}: `{arg}` must be a global rank in the group "
            f"{list(group.ranks)}. Received: {arg}={rank!r}"
        )
    return group.index(rank)


def normalize_axis(axis, rank, arg, what_):
    """`axis` in ``[-rank, rank)`` as a non-negative axis."""
    check_int(axis, arg)
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
