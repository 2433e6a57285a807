"""`AllGather`, `ReduceScatter`, `CollectiveGather` and `CollectiveScatter` layers."""

import keras

from keras_comm.layers._base import CollectiveLayer
from keras_comm.layers._base import MeanGradient
from keras_comm.ops.gather_scatter import all_gather
from keras_comm.ops.gather_scatter import collective_gather
from keras_comm.ops.gather_scatter import collective_scatter
from keras_comm.ops.gather_scatter import reduce_scatter
from keras_comm.ops.reduce_op import ReduceOp
from keras_comm.ops._fusion import validate_fusion


def _axis0_unknown(shape):
    # Axis 0 is multiplied or divided by the group size, which is only known
    # when the layer runs (and non-members keep their input shape).
    shape = tuple(shape)
    return (None,) + shape[1:]


def sum_only(op, layer):
    """`op` as a `ReduceOp`, which must be SUM: a reduce-scatter's backward is
    an all-gather, the adjoint of a sum only."""
    reduce_op = ReduceOp.from_value(op)
    if reduce_op is not ReduceOp.SUM:
        raise ValueError(
            f"{layer} supports only op='sum' (its gradient is an all-gather). "
            f"Received: op={op!r}"
        )
    return reduce_op


@keras.saving.register_keras_serializable(package="keras_comm")
class AllGather(MeanGradient, CollectiveLayer):
    """Concatenates every group member's input along axis 0, on every member.

    Forward: ``concat([x_0, ..., x_{n-1}], axis=0)``. Backward: reduce-scatter
    SUM of dy (this member's slice of the summed gradient), the exact
    adjoint; times 1/n if `mean` (the gradient of the mean of the replicas'
    losses). See `keras_comm.ops.all_gather`.

    Args:
        mean: scale the gradient by 1/group size (`mean_flag`, its former
            name, is still accepted).
        group: None (all replicas) or a list of global ranks.
        timeout: seconds; None for `keras_comm.get_timeout()`.
        fusion: int >= 0, the fusion group id (0: no fusion): gathers with
            one id travel as one transfer per step (per group and dtype),
            and so do their backward reduce-scatters.

    Input shape: ``(d0, ...)``, the same on every member.
    Output shape: ``(n * d0, ...)`` (reported as ``(None, ...)``);
    non-members of `group` get their input back.
    """

    def __init__(self, mean=False, group=None, timeout=None, fusion=0, **kwargs):
        super().__init__(mean, False, group=group, timeout=timeout, **kwargs)
        self.fusion = validate_fusion(fusion)

    _output_shape = staticmethod(_axis0_unknown)

    def call(self, inputs):
        return all_gather(
            inputs, self.mean, self.group, fusion=self.fusion, timeout=self.timeout, name=self.name
        )

    def get_config(self):
        cfg = super().get_config()
        cfg["fusion"] = self.fusion
        return cfg


@keras.saving.register_keras_serializable(package="keras_comm")
class ReduceScatter(CollectiveLayer):
    """Sums the input over the group; member i keeps slice i of axis 0.

    Forward: ``(sum_r x_r)[i*k:(i+1)*k]``, ``k = d0 / n``. Backward: all-gather
    of dy (exact adjoint). See `keras_comm.ops.reduce_scatter`.

    Args:
        op: only "sum" (`ReduceOp.SUM`).
        group: None (all replicas) or a list of global ranks.
        timeout: seconds; None for `keras_comm.get_timeout()`.
        fusion: int >= 0, the fusion group id (0: no fusion), as in
            `AllGather`.

    Input shape: ``(d0, ...)`` with d0 divisible by the group size (checked
    when the layer runs, naming the layer and the shape).
    Output shape: ``(d0 / n, ...)`` (reported as ``(None, ...)``).

    Raises:
        ValueError: `op` is not SUM.
    """

    def __init__(self, op="sum", group=None, timeout=None, fusion=0, **kwargs):
        super().__init__(group=group, timeout=timeout, **kwargs)
        self.op = sum_only(op, "ReduceScatter")
        self.fusion = validate_fusion(fusion)

    _output_shape = staticmethod(_axis0_unknown)

    def call(self, inputs):
        return reduce_scatter(
            inputs, self.op, self.group, fusion=self.fusion, timeout=self.timeout, name=self.name
        )

    def get_config(self):
        cfg = super().get_config()
        cfg["op"] = self.op.value
        cfg["fusion"] = self.fusion
        return cfg


@keras.saving.register_keras_serializable(package="keras_comm")
class CollectiveGather(CollectiveLayer):
    """Concatenates every member's input along axis 0 at member `dest`.

    Forward: the concatenation at `dest`, zeros of the same shape on the
    other members. Backward: broadcast dy from `dest`, each member keeps its
    own slice (exact adjoint). See `keras_comm.ops.collective_gather`.

    Args:
        dest: GLOBAL rank of the destination; must be in `group`.
        group: None (all replicas) or a list of global ranks.
        timeout: seconds; None for `keras_comm.get_timeout()`.
        fusion: int >= 0, the fusion group id (0: no fusion): gathers with
            one id travel as one transfer per step (per group and dtype),
            and so do their backward reduce-scatters.

    Input shape: ``(d0, ...)``, the same on every member.
    Output shape: ``(n * d0, ...)`` (reported as ``(None, ...)``).
    """

    def __init__(self, dest=0, group=None, timeout=None, **kwargs):
        super().__init__(group=group, timeout=timeout, **kwargs)
        self.dest = self._group_member(dest, "dest")

    _output_shape = staticmethod(_axis0_unknown)

    def call(self, inputs):
        return collective_gather(inputs, self.dest, self.group, timeout=self.timeout, name=self.name)

    def get_config(self):
        cfg = super().get_config()
        cfg["dest"] = self.dest
        return cfg


@keras.saving.register_keras_serializable(package="keras_comm")
class CollectiveScatter(CollectiveLayer):
    """Splits `src`'s input along axis 0; group member i receives slice i.

    Forward: ``x_src[i*k:(i+1)*k]``, ``k = d0 / n`` (other members' inputs
    only give shape and dtype). Backward: dy gathered at `src`, zeros on
    the other members (exact adjoint). See `keras_comm.ops.collective_scatter`.

    Args:
        src: GLOBAL rank of the source; must be in `group`.
        group: None (all replicas) or a list of global ranks.
        timeout: seconds; None for `keras_comm.get_timeout()`.

    Input shape: ``(d0, ...)`` with d0 divisible by the group size.
    Output shape: ``(d0 / n, ...)`` (reported as ``(None, ...)``).
    """

    def __init__(self, src=0, group=None, timeout=None, **kwargs):
        super().__init__(group=group, timeout=timeout, **kwargs)
        self.src = self._group_member(src, "src")

    _output_shape = staticmethod(_axis0_unknown)

    def call(self, inputs):
        return collective_scatter(inputs, self.src, self.group, timeout=self.timeout, name=self.name)

    def get_config(self):
        cfg = super().get_config()
        cfg["src"] = self.src
        return cfg
