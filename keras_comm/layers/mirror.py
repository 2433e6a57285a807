"""Mirror layers of data parallelism: identity forward, reduced gradient backward.

Thin wrappers of `keras_comm.ops.mirror`; see there for the exact rules.
Their `mean` argument was called `mean_flag` before; that keyword and
config key are still accepted.
The accumulation layers own per-replica buffers (see
`PerReplicaAccumulator`): build them under ``strategy.scope()``.
"""

import keras

from keras_comm import _validation
from keras_comm.layers._base import CollectiveLayer
from keras_comm.layers._base import MeanGradient
from keras_comm.layers._base import MiniStepCounter
from keras_comm.layers._base import PerReplicaAccumulator
from keras_comm.layers._base import _static_shape
from keras_comm.layers._base import _tf_variable
from keras_comm.layers._base import group_size
from keras_comm.ops import mirror as mirror_ops
from keras_comm.ops._fusion import validate_fusion


class _Mirror(MeanGradient, CollectiveLayer):
    """The arguments every mirror layer takes: `mean`, `group`, `timeout`."""

    def __init__(self, mean=True, group=None, timeout=None, **kwargs):
        super().__init__(mean, True, group=group, timeout=timeout, **kwargs)


class _LocalNorm:
    """Mixin of the mirror layers that can record their local gradient norm.

    With ``dump_local_norm=True``, ``build`` creates ``local_norm``: a
    non-trainable float32 scalar kept per replica (``synchronization="on_read"``,
    ``aggregation="none"``), which the backward sets to the L2 norm of this
    replica's gradient before it is reduced (MindSpore's dump_local_norm,
    which prints it there). `keras_comm.callbacks.LocalNormLogger` adds it to
    `fit`'s logs.
    """

    def __init__(self, *args, dump_local_norm=False, **kwargs):
        super().__init__(*args, **kwargs)
        self.dump_local_norm = _validation.boolean(dump_local_norm, "dump_local_norm")
        self.local_norm = None

    def build(self, input_shape):
        parent = getattr(super(), "build", None)
        if self.dump_local_norm:
            self.local_norm = PerReplicaAccumulator._per_replica_weight(
                self, "local_norm", (), "float32"
            )
        if parent is not None:
            parent(input_shape)

    def _local_norm_variable(self):
        return None if self.local_norm is None else _tf_variable(self.local_norm)

    def get_config(self):
        config_ = super().get_config()
        config_["dump_local_norm"] = self.dump_local_norm
        return config_


@keras.saving.register_keras_serializable(package="keras_comm")
class MirrorOperator(_LocalNorm, _Mirror):
    """Marks its input as a copy of a parameter mirrored over the replicas.

    Forward: identity.
    Backward: all-reduce SUM of dy over the group, times ``1 / group_size``
    if `mean` (default: the gradient of the mean of the replicas' losses,
    as MindSpore's MirrorOperator computes it; ``mean=False`` is the exact
    adjoint for the sum of the losses). A sparse
    ``tf.IndexedSlices`` dy is all-gathered (indices and values) instead.
    See `keras_comm.ops.mirror_operator`.

    Fusion: MirrorOperator and AllReduce layers given the same `fusion`
    id > 0 send their backward
    reductions in one transfer per step (per group and dtype) in `model.fit`
    and inside `keras_comm.ops.fusion_scope`; values are unchanged. Sparse
    gradients are not fused.

    Args:
        mean: divide the reduced gradient by the group size.
        group: None (all replicas) or a list of global ranks.
        fusion: int >= 0, the fusion group id (0: no fusion).
        timeout: seconds before a missing peer raises an error; None for
            `keras_comm.get_timeout()`.
        dump_local_norm: keep the L2 norm of this replica's dy, before it
            is reduced, in the per-replica weight ``local_norm``.

    Input shape: any. Output shape: the input shape.

    Example:

    ```python
    with strategy.scope():
        layer = keras_comm.layers.MirrorOperator(mean=False)
    # in strategy.run: grads of layer(w) are summed over replicas.
    ```
    """

    def __init__(
        self, mean=True, group=None, fusion=0, timeout=None, dump_local_norm=False, **kwargs
    ):
        super().__init__(mean, group, timeout, dump_local_norm=dump_local_norm, **kwargs)
        self.fusion = validate_fusion(fusion)

    def call(self, inputs):
        return mirror_ops.mirror_operator(
            inputs,
            self.mean,
            self.group,
            fusion=self.fusion,
            local_norm=self._local_norm_variable(),
            timeout=self.timeout,
            name=self.name,
        )

    def get_config(self):
        config_ = super().get_config()
        config_["fusion"] = self.fusion
        return config_


@keras.saving.register_keras_serializable(package="keras_comm")
class MirrorMiniStepOperator(MiniStepCounter, _Mirror):
    """Mirror with gradient accumulation over `accumulation_steps` mini-steps.

    Forward: identity.
    Backward: adds dy into the layer's per-replica ``accumulator`` and
    advances its ``step`` counter. Every `accumulation_steps`-th backward
    (the update step) returns the all-reduce SUM of the accumulator over the
    group (times ``1 / group_size`` if `mean`) and resets it to zeros;
    the other backwards return zeros and do not communicate. The released
    gradient is the SUM over the cycle's mini-steps (not their mean).
    See `keras_comm.ops.mirror_mini_step_operator`.

    Args:
        accumulation_steps: int >= 1.
        mean: divide the reduced gradient by the group size.
        group: None (all replicas) or a list of global ranks.
        timeout: seconds, or None for `keras_comm.get_timeout()`.

    Input shape: any fully known shape (the accumulator has it).
    Output shape: the input shape.

    Weights: ``accumulator`` (input shape, layer dtype) and ``step``
    (int64 scalar), non-trainable, per replica.
    """

    _op = staticmethod(mirror_ops.mirror_mini_step_operator)

    def __init__(self, accumulation_steps, mean=True, group=None, timeout=None, **kwargs):
        super().__init__(mean, group, timeout, **kwargs)
        self.accumulation_steps = _validation.accumulation_steps(accumulation_steps)


@keras.saving.register_keras_serializable(package="keras_comm")
class MirrorMicroStepOperator(_LocalNorm, PerReplicaAccumulator, _Mirror):
    """Mirror at the end of pipeline micro-steps.

    Forward: identity.
    Backward: ``total = accumulator + dy``; the accumulator is reset; returns
    the all-reduce SUM of ``total`` over the group (times ``1 / group_size``
    if `mean`). With `optimizer_shard` a sharded optimizer reduces the
    gradient further over blocks of `optimizer_shard_size` group members, so
    this layer all-reduces only over the members holding the same shard (one
    per block; times ``1 / (group_size / optimizer_shard_size)`` if `mean`);
    with ``optimizer_shard_size=None`` (the whole group, as
    `keras_comm.callbacks.ParallelOptimizer` shards) it returns ``total``
    unreduced. Earlier micro-batches' gradients
    reach ``accumulator`` through `keras_comm.ops.virtual_assign_add(x,
    layer.accumulator)`; with no such writer this layer is a
    `MirrorOperator`. See `keras_comm.ops.mirror_micro_step_operator`.

    Args:
        mean: divide the reduced gradient by the number of members it is
            reduced over.
        group: None (all replicas) or a list of global ranks.
        optimizer_shard: a sharded optimizer reduces the gradient further.
        timeout: seconds, or None for `keras_comm.get_timeout()`.
        optimizer_shard_size: int >= 1 dividing the group size: the size of
            the sharded optimizer's groups; None for the whole group. Only
            with `optimizer_shard`.
        dump_local_norm: keep the L2 norm of ``total`` (the accumulated
            local gradient, before reduction) in the weight ``local_norm``.
        fusion: int >= 0, the fusion group id (0: no fusion), as in
            `MirrorOperator`.

    Input shape: any fully known shape. Output shape: the input shape.
    """

    def __init__(
        self,
        mean=True,
        group=None,
        optimizer_shard=False,
        timeout=None,
        optimizer_shard_size=None,
        dump_local_norm=False,
        fusion=0,
        **kwargs,
    ):
        super().__init__(mean, group, timeout, dump_local_norm=dump_local_norm, **kwargs)
        self.fusion = validate_fusion(fusion)
        self.optimizer_shard = _validation.boolean(optimizer_shard, "optimizer_shard")
        self.optimizer_shard_size = mirror_ops.optimizer_shard_size_argument(
            optimizer_shard, optimizer_shard_size
        )
        if self.optimizer_shard_size is not None and self.group is not None:
            mirror_ops.same_shard_ranks(self.group.ranks, 0, self.optimizer_shard_size)

    def build(self, input_shape):
        if self.optimizer_shard_size is not None:
            # The world size, when `group` is None, is known from here on.
            mirror_ops.same_shard_ranks(range(group_size(self.group)), 0, self.optimizer_shard_size)
        super().build(input_shape)

    def call(self, inputs):
        return mirror_ops.mirror_micro_step_operator(
            inputs,
            self._accumulator_variable(),
            self.mean,
            self.group,
            self.optimizer_shard,
            optimizer_shard_size=self.optimizer_shard_size,
            local_norm=self._local_norm_variable(),
            fusion=self.fusion,
            timeout=self.timeout,
            name=self.name,
        )

    def get_config(self):
        config_ = super().get_config()
        config_["optimizer_shard"] = self.optimizer_shard
        config_["optimizer_shard_size"] = self.optimizer_shard_size
        config_["fusion"] = self.fusion
        return config_


class _StepAllGather(PerReplicaAccumulator, _Mirror):
    """Gathers along axis 0; the accumulator has the gathered shape."""

    def _output_shape(self, shape):
        shape = tuple(shape)
        if not shape:
            raise ValueError(
                f"Layer {self.name!r} ({type(self).__name__}) gathers along axis 0 and "
                f"needs an input of rank >= 1. Received: input_shape={shape}"
            )
        n = group_size(self.group)
        return (None if shape[0] is None else shape[0] * n,) + shape[1:]


@keras.saving.register_keras_serializable(package="keras_comm")
class MiniStepAllGather(MiniStepCounter, _StepAllGather):
    """All-gathers a parameter shard; accumulates its gradient over mini-steps.

    Forward: concatenation of every group member's input along axis 0.
    Backward: adds dy (the gathered shape) into the ``accumulator``; every
    `accumulation_steps`-th backward returns the reduce-scatter SUM of it
    (this member's shard, times ``1 / group_size`` if `mean`) and
    resets it; other backwards return zeros, without communication. With
    ``shard_accumulator=True`` every backward reduce-scatters dy at once and
    adds this member's share into a shard-sized accumulator (1/n of the
    memory, one reduce-scatter per mini-step; MindSpore's
    grad_accumulation_shard); the released gradient is the same. With
    ``accumulation_steps=1`` this is the all-gather's own backward.
    See `keras_comm.ops.mini_step_all_gather`.

    Args:
        mean: divide the reduced gradient by the group size.
        group: None (all replicas) or a list of global ranks.
        accumulation_steps: int >= 1.
        timeout: seconds, or None for `keras_comm.get_timeout()`.
        shard_accumulator: accumulate the reduce-scattered shard every
            mini-step instead of the gathered gradient.
        fusion: int >= 0, the fusion group id (0: no fusion): the forward
            all-gathers and backward reduce-scatters of layers with one id
            travel as one transfer per step.

    Input shape: ``(d0, ...)``, fully known.
    Output shape: ``(d0 * group_size, ...)``; the group size is the world
    size when `group` is None, read at build time (the accumulator has the
    output shape, so a model built for N replicas keeps N-replica weights;
    with `shard_accumulator` it has the input shape).
    """

    _op = staticmethod(mirror_ops.mini_step_all_gather)

    def __init__(
        self,
        mean=True,
        group=None,
        accumulation_steps=1,
        timeout=None,
        shard_accumulator=False,
        fusion=0,
        **kwargs,
    ):
        super().__init__(mean, group, timeout, **kwargs)
        self.accumulation_steps = _validation.accumulation_steps(accumulation_steps)
        self.shard_accumulator = _validation.boolean(shard_accumulator, "shard_accumulator")
        self.fusion = validate_fusion(fusion)

    def _accumulator_shape(self, input_shape):
        if self.shard_accumulator:
            self._output_shape(input_shape)  # the rank check
            return tuple(input_shape)
        return self._output_shape(input_shape)

    def _op_kwargs(self):
        return {"shard_accumulator": self.shard_accumulator, "fusion": self.fusion}

    def get_config(self):
        config_ = super().get_config()
        config_["shard_accumulator"] = self.shard_accumulator
        config_["fusion"] = self.fusion
        return config_


@keras.saving.register_keras_serializable(package="keras_comm")
class MicroStepAllGather(_LocalNorm, _StepAllGather):
    """All-gathers a parameter shard; reduces the micro-steps' accumulated gradient.

    Forward: concatenation of every group member's input along axis 0.
    Backward: ``total = accumulator + dy``, the accumulator is reset, and
    the reduce-scatter SUM of ``total`` is returned (this member's shard,
    times ``1 / group_size`` if `mean`). With ``with_mirror_operator=True``
    a `MirrorMicroStepOperator` on the shard owns the micro-step buffer:
    this layer has no accumulator and ``total = dy``. With
    ``reduce_gradient=False`` nothing is communicated: this member's own rows
    of ``total`` are returned (MindSpore's ``do_mirror=False``; the exact
    adjoint for a group of one). See `keras_comm.ops.micro_step_all_gather`.

    Args:
        mean: divide the reduced gradient by the group size.
        group: None (all replicas) or a list of global ranks.
        timeout: seconds, or None for `keras_comm.get_timeout()`.
        reduce_gradient: reduce-scatter the gradient over the group.
        with_mirror_operator: leave the micro-step accumulation to a mirror.
        dump_local_norm: keep the L2 norm of ``total`` (gathered shape,
            before reduction) in the weight ``local_norm``; not with
            `with_mirror_operator` (the mirror records it there).
        fusion: int >= 0, the fusion group id (0: no fusion), as in
            `MiniStepAllGather`.

    Input shape: ``(d0, ...)``, fully known.
    Output shape: ``(d0 * group_size, ...)``.
    """

    def __init__(
        self,
        mean=True,
        group=None,
        timeout=None,
        reduce_gradient=True,
        with_mirror_operator=False,
        dump_local_norm=False,
        fusion=0,
        **kwargs,
    ):
        super().__init__(mean, group, timeout, dump_local_norm=dump_local_norm, **kwargs)
        self.fusion = validate_fusion(fusion)
        self.reduce_gradient = _validation.boolean(reduce_gradient, "reduce_gradient")
        self.with_mirror_operator = _validation.boolean(
            with_mirror_operator, "with_mirror_operator"
        )
        if self.with_mirror_operator and self.dump_local_norm:
            raise ValueError(
                "`dump_local_norm` records the accumulated gradient, which with "
                "`with_mirror_operator` the mirror owns: set it on the mirror. Received: "
                "with_mirror_operator=True, dump_local_norm=True"
            )

    def build(self, input_shape):
        if self.with_mirror_operator:
            self._output_shape(_static_shape(self, input_shape))  # the rank check
            self.accumulator = None
            return
        super().build(input_shape)

    def call(self, inputs):
        return mirror_ops.micro_step_all_gather(
            inputs,
            None if self.accumulator is None else self._accumulator_variable(),
            self.mean,
            self.group,
            reduce_gradient=self.reduce_gradient,
            with_mirror_operator=self.with_mirror_operator,
            local_norm=self._local_norm_variable(),
            fusion=self.fusion,
            timeout=self.timeout,
            name=self.name,
        )

    def get_config(self):
        config_ = super().get_config()
        config_["fusion"] = self.fusion
        config_["reduce_gradient"] = self.reduce_gradient
        config_["with_mirror_operator"] = self.with_mirror_operator
        return config_


__all__ = [
    "MiniStepAllGather",
    "MicroStepAllGather",
    "MirrorMicroStepOperator",
    "MirrorMiniStepOperator",
    "MirrorOperator",
]
