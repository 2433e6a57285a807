"""`ReduceOp`: the reductions keras_comm collectives support."""

import enum


class ReduceOp(enum.Enum):
    """How `all_reduce` combines the group members' tensors, elementwise.

    Strings are converted once, at the API boundary, with `from_value`;
    layers serialize ``op.value``.
    """

    SUM = "sum"
    PROD = "prod"
    MAX = "max"
    MIN = "min"

    @classmethod
    def from_value(cls, value, name="op"):
        """Returns the `ReduceOp` for a `ReduceOp` or a case-insensitive string.

        Args:
            value: a `ReduceOp`, or one of "sum", "prod", "max", "min".
            name: the argument name used in error messages.

        Raises:
            TypeError: if `value` is neither a `ReduceOp` nor a string.
            ValueError: if `value` names no reduction.
        """
        if isinstance(value, cls):
            return value
        if not isinstance(value, str):
            raise TypeError(
                f"`{name}` must be a keras_comm.ops.ReduceOp or one of "
                f"{[m.value for m in cls]}. Received: {name}={value!r}"
            )
        try:
            return cls(value.lower())
        except ValueError:
            raise ValueError(
                f"`{name}` must be one of {[m.value for m in cls]}. "
                f"Received: {name}={value!r}"
            ) from None
