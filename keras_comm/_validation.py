"""Argument checks shared by keras_comm's ops, layers, callbacks and launcher.

Each check returns the value it accepts (normalised where said) and
otherwise raises in Keras's words: the argument's name, the rule, and
``Received: name=value``. A wrong type raises TypeError and a value out of
range ValueError, except for counts (`positive_int`), which raise
ValueError for both, as Keras does for ``units``.

Standard library only: the launcher imports this module without
TensorFlow or Keras.
"""

import math


def _is_int(value):
    # bool is an int subclass, but `True` is never meant as a count or rank.
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value):
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def boolean(value, name):
    """`value` if it is a bool; TypeError otherwise."""
    if not isinstance(value, bool):
        raise TypeError(f"`{name}` must be a bool. Received: {name}={value!r}")
    return value


def integer(value, name, minimum=None, rule=None):
    """`value` if it is an int (and >= `minimum` when given).

    Args:
        value: the argument.
        name: its name, for the message.
        minimum: the smallest accepted value, or None for any int.
        rule: the rule to state instead of "an int >= minimum", e.g. why
            negative values are refused.

    Raises:
        TypeError: not an int.
        ValueError: below `minimum`.
    """
    if rule is None:
        rule = "an int" if minimum is None else f"an int >= {minimum}"
    if not _is_int(value):
        raise TypeError(f"`{name}` must be {rule}. Received: {name}={value!r}")
    if minimum is not None and value < minimum:
        raise ValueError(f"`{name}` must be {rule}. Received: {name}={value!r}")
    return int(value)


def positive_int(value, name):
    """`value` if it is an int >= 1 (a count); ValueError otherwise."""
    if not _is_int(value) or value < 1:
        raise ValueError(f"`{name}` must be an int >= 1. Received: {name}={value!r}")
    return int(value)


def accumulation_steps(value, name="accumulation_steps"):
    """The number of mini-steps whose gradients are summed: an int >= 1."""
    return positive_int(value, name)


def positive_number(value, name):
    """`value` if it is a number > 0; ValueError otherwise."""
    if not _is_number(value) or not value > 0:
        raise ValueError(f"`{name}` must be a number > 0. Received: {name}={value!r}")
    return value


def nonzero_number(value, name):
    """`value` if it is a number other than 0; ValueError otherwise."""
    if not _is_number(value) or value == 0:
        raise ValueError(f"`{name}` must be a non-zero number. Received: {name}={value!r}")
    return value


def timeout(value, name="timeout"):
    """`value` as a float number of seconds, finite and > 0.

    A finite timeout is what turns a missing peer into an error instead of
    a hang, so None and infinity are refused here.

    Raises:
        TypeError: not a number.
        ValueError: not finite, or <= 0.
    """
    if not _is_number(value):
        raise TypeError(f"`{name}` must be a number of seconds. Received: {name}={value!r}")
    if not math.isfinite(value) or value <= 0:
        raise ValueError(
            f"`{name}` must be a finite number of seconds > 0, so that a missing "
            f"peer raises an error instead of hanging. Received: {name}={value!r}"
        )
    return float(value)


def optional_timeout(value, name="timeout"):
    """None (the package default, `keras_comm.get_timeout()`) or a `timeout`."""
    return None if value is None else timeout(value, name)


def rank(value, name):
    """`value` if it is a global replica rank: an int >= 0."""
    if not _is_int(value):
        raise TypeError(f"`{name}` must be an int global rank. Received: {name}={value!r}")
    if value < 0:
        raise ValueError(f"`{name}` must be a global rank >= 0. Received: {name}={value!r}")
    return int(value)


def rank_in(value, ranks, name, group_name="group"):
    """A `rank` that is one of `ranks` (a group's members) when `ranks` is not None."""
    value = rank(value, name)
    if ranks is not None and value not in ranks:
        raise ValueError(
            f"`{name}` must be a member of `{group_name}` {list(ranks)}. "
            f"Received: {name}={value!r}"
        )
    return value


def ranks(value, name="group"):
    """A group's members: a non-empty sequence of distinct ranks, sorted.

    Returns:
        The ranks as a sorted tuple of ints.

    Raises:
        TypeError: not a sequence of ints.
        ValueError: empty, negative or repeated ranks.
    """
    if isinstance(value, (str, bytes)) or not hasattr(value, "__iter__"):
        raise TypeError(
            f"`{name}` must be a list of global ranks, a keras_comm.Group or "
            f"None. Received: {name}={value!r}"
        )
    value = list(value)
    for r in value:
        if not _is_int(r):
            raise TypeError(
                f"`{name}` must contain int ranks. Received: {name}={value!r} (element {r!r})"
            )
    if not value:
        raise ValueError(f"`{name}` must not be empty. Received: {name}=[]")
    if any(r < 0 for r in value):
        raise ValueError(f"`{name}` ranks must be >= 0. Received: {name}={value!r}")
    if len(set(value)) != len(value):
        repeated = sorted({r for r in value if value.count(r) > 1})
        raise ValueError(
            f"`{name}` must not repeat a rank (repeated: {repeated}). "
            f"Received: {name}={value!r}"
        )
    return tuple(sorted(int(r) for r in value))


def one_of(value, choices, name):
    """`value` if it is one of `choices`; ValueError otherwise."""
    if not isinstance(value, str) or value not in choices:
        raise ValueError(
            f"`{name}` must be one of {list(choices)}. Received: {name}={value!r}"
        )
    return value


def divisible(value, divisor, name, what):
    """`value` if `divisor` divides it; `what` names the divisor (e.g. "group size")."""
    if value % divisor:
        raise ValueError(
            f"`{name}` must be divisible by the {what} {divisor}. Received: {name}={value}"
        )
    return value


def shape(value, name="shape"):
    """A tensor shape: a sequence of ints >= 0 or None, as a tuple.

    Raises:
        TypeError: None, a string or not a sequence.
        ValueError: an entry that is not an int >= 0 or None.
    """
    if value is None or isinstance(value, (str, bytes)) or not hasattr(value, "__iter__"):
        raise TypeError(
            f"`{name}` must be a tensor shape, a list of ints or None. "
            f"Received: {name}={value!r}"
        )
    value = tuple(value)
    for d in value:
        if d is not None and (not _is_int(d) or d < 0):
            raise ValueError(
                f"`{name}` entries must be ints >= 0 or None. Received: {name}={value!r}"
            )
    return value


def renamed(kwargs, old, new, value, default, check=None):
    """The value of an argument renamed from `old` to `new`.

    Calls and configs written before the rename pass `old`; it arrives in
    `kwargs`, from which it is removed. Passing both names is an error.

    Args:
        kwargs: the caller's remaining keyword arguments (modified).
        old, new: the argument's old and new names.
        value: the value passed as `new`.
        default: `new`'s default, telling whether `new` was passed.
        check: optional check ``check(value, name)`` of the value, run under
            the name the caller used.
    """
    name = new
    if old in kwargs:
        if value != default:
            raise TypeError(
                f"`{old}` is the old name of `{new}`; pass only `{new}`. "
                f"Received: {new}={value!r}, {old}={kwargs[old]!r}"
            )
        name, value = old, kwargs.pop(old)
    return value if check is None else check(value, name)
