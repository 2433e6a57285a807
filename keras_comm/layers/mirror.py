"""Mirror layers of data parallelism: identity forward, reduced gradient backward.

Thin wrappers of `keras_comm.ops.mirror`; see there for the exact rules.
The accumulation layers own their buffers: non-trainable per-replica
weights (``synchronization="on_read"``, ``aggregation="none"``) created in
``build`` and initialised to zeros, so MWMS's broadcast of initial values
from worker 0 is harmless. Build them under ``strategy.scope()``.
"""

import keras

from keras_comm import config
from keras_comm import topology
from keras_comm.ops import mirror as mirror_ops
from keras_comm.ops._fusion import validate_fusion


def _check_group(group):
    group = topology.as_group(group)
    return None if group is None else list(group.ranks)


def _check_timeout(timeout):
    return None if timeout is None else config.validate_timeout(timeout)


def _check_bool(value, name):
    if not isinstance(value, bool):
        raise TypeError(f"`{name}` must be a bool. Received: {name}={value!r}")
    return value


def _check_steps(accumulation_steps):
    if (
        isinstance(accumulation_steps, bool)
        or not isinstance(accumulation_steps, int)
        or accumulation_steps < 1
    ):
        raise ValueError(
            "`accumulation_steps` must be an int >= 1. "
            f"Received: accumulation_steps={accumulation_steps!r}"
        )
    return accumulation_steps


def _static_shape(layer, input_shape):
    shape = tuple(input_shape)
    if any(d is None for d in shape):
        raise ValueError(
            f"Layer {layer.name!r} ({type(layer).__name__}) keeps a per-replica "
            "accumulator shaped like its input, so the input shape must be fully "
            "known (use it on parameters or fixed-size tensors, not on batches "
            f"of unknown size). Received: input_shape={shape}"
        )
    return shape


def _group_size(group):
    return len(group) if group is not None else topology.world_size()


def per_replica_weight(layer, name, shape, dtype):
    """A zeros-initialised, non-trainable weight that stays per replica."""
    with keras.name_scope(layer.name):
        variable = keras.Variable(
            initializer="zeros",
            shape=shape,
            dtype=dtype,
            trainable=False,
            autocast=False,
            aggregation="none",
            synchronization="on_read",
            name=name,
        )
    layer._track_variable(variable)  # pylint: disable=protected-access
    return variable


def _tf_variable(variable):
    # The TF (possibly distributed) variable behind a Keras variable.
    return variable.value if isinstance(variable, keras.Variable) else variable


class _Mirror(keras.layers.Layer):
    """Common arguments and config of the mirror layers."""

    def __init__(self, mean_flag=True, group=None, timeout=None, **kwargs):
        super().__init__(**kwargs)
        self.mean_flag = _check_bool(mean_flag, "mean_flag")
        self.group = _check_group(group)
        self.timeout = _check_timeout(timeout)

    def compute_output_shape(self, input_shape):
        return input_shape

    def get_config(self):
        config_ = super().get_config()
        config_.update(mean_flag=self.mean_flag, group=self.group, timeout=self.timeout)
        return config_


class _Accumulating(_Mirror):
    """A mirror layer with a per-replica ``accumulator`` shaped like its output."""

    def build(self, input_shape):
        shape = _static_shape(self, input_shape)
        self.accumulator = per_replica_weight(
            self, "accumulator", self.compute_output_shape(shape), self.variable_dtype
        )


class _MiniSteps:
    """Mixin of the layers that release their gradient every `accumulation_steps` backwards.

    Adds the ``step`` counter (built after the accumulator), the call of the
    mini-step op named by `_op`, and `accumulation_steps` in the config.
    Subclasses keep their own constructor, whose argument order differs.
    """

    def build(self, input_shape):
        super().build(input_shape)
        self.step = per_replica_weight(self, "step", (), "int64")

    def call(self, inputs):
        return self._op(
            inputs,
            _tf_variable(self.accumulator),
            _tf_variable(self.step),
            self.accumulation_steps,
            self.mean_flag,
            self.group,
            timeout=self.timeout,
            name=self.name,
        )

    def get_config(self):
        config_ = super().get_config()
        config_["accumulation_steps"] = self.accumulation_steps
        return config_


@keras.saving.register_keras_serializable(package="keras_comm")
class MirrorOperator(_Mirror):
    """Marks its input as a copy of a parameter mirrored over the replicas.

    Forward: identity.
    Backward: all-reduce SUM of dy over the group, times ``1 / group_size``
    if `mean_flag` (the reference's default; ``mean_flag=False`` is the
    exact adjoint of the sum-of-losses objective). A sparse
    ``tf.IndexedSlices`` dy is all-gathered (indices and values) instead.
    See `keras_comm.ops.mirror_operator`.

    Fusion: MirrorOperator and AllReduce layers given the same `fusion`
    id > 0 (the reference's fusion attribute) send their backward
    reductions in one transfer per step (per group and dtype) in `model.fit`
    and inside `keras_comm.ops.fusion_scope`; values are unchanged. Sparse
    gradients are not fused.

    Args:
        mean_flag: divide the reduced gradient by the group size.
        group: None (all replicas) or a list of global ranks.
        fusion: int >= 0, the fusion group id (0: no fusion).
        timeout: seconds before a missing peer raises an error; None for
            `keras_comm.get_timeout()`.

    Input shape: any. Output shape: the input shape.

    Example:

    ```python
    with strategy.scope():
        layer = keras_comm.layers.MirrorOperator(mean_flag=False)
    # in strategy.run: grads of layer(w) are summed over replicas.
    ```
    """

    def __init__(self, mean_flag=True, group=None, fusion=0, timeout=None, **kwargs):
        super().__init__(mean_flag=mean_flag, group=group, timeout=timeout, **kwargs)
        self.fusion = validate_fusion(fusion)

    def call(self, inputs):
        return mirror_ops.mirror_operator(
            inputs,
            self.mean_flag,
            self.group,
            fusion=self.fusion,
            timeout=self.timeout,
            name=self.name,
        )

    def get_config(self):
        config_ = super().get_config()
        config_["fusion"] = self.fusion
        return config_


@keras.saving.register_keras_serializable(package="keras_comm")
class MirrorMiniStepOperator(_MiniSteps, _Accumulating):
    """Mirror with gradient accumulation over `accumulation_steps` mini-steps.

    Forward: identity.
    Backward: adds dy into the layer's per-replica ``accumulator`` and
    advances its ``step`` counter. Every `accumulation_steps`-th backward
    (the update step) returns the all-reduce SUM of the accumulator over the
    group (times ``1 / group_size`` if `mean_flag`) and resets it to zeros;
    the other backwards return zeros and do not communicate. The released
    gradient is the SUM over the cycle's mini-steps (not their mean).
    See `keras_comm.ops.mirror_mini_step_operator` (and how it differs from
    the reference there).

    Args:
        accumulation_steps: int >= 1.
        mean_flag: divide the reduced gradient by the group size.
        group: None (all replicas) or a list of global ranks.
        timeout: seconds, or None for `keras_comm.get_timeout()`.

    Input shape: any fully known shape (the accumulator has it).
    Output shape: the input shape.

    Weights: ``accumulator`` (input shape, layer dtype) and ``step``
    (int64 scalar), non-trainable, per replica.
    """

    _op = staticmethod(mirror_ops.mirror_mini_step_operator)

    def __init__(self, accumulation_steps, mean_flag=True, group=None, timeout=None, **kwargs):
        super().__init__(mean_flag, group, timeout, **kwargs)
        self.accumulation_steps = _check_steps(accumulation_steps)


@keras.saving.register_keras_serializable(package="keras_comm")
class MirrorMicroStepOperator(_Accumulating):
    """Mirror at the end of pipeline micro-steps.

    Forward: identity.
    Backward: ``total = accumulator + dy``; the accumulator is reset; returns
    the all-reduce SUM of ``total`` over the group (times ``1 / group_size``
    if `mean_flag`), or ``total`` unreduced when `optimizer_shard` (a
    sharded optimizer reduce-scatters it). Earlier micro-batches' gradients
    reach ``accumulator`` through `keras_comm.ops.virtual_assign_add(x,
    layer.accumulator)`; with no such writer this layer is a
    `MirrorOperator`. See `keras_comm.ops.mirror_micro_step_operator`.

    Args:
        mean_flag: divide the reduced gradient by the group size.
        group: None (all replicas) or a list of global ranks.
        optimizer_shard: skip the all-reduce, return the local total.
        timeout: seconds, or None for `keras_comm.get_timeout()`.

    Input shape: any fully known shape. Output shape: the input shape.
    """

    def __init__(self, mean_flag=True, group=None, optimizer_shard=False, timeout=None, **kwargs):
        super().__init__(mean_flag, group, timeout, **kwargs)
        self.optimizer_shard = _check_bool(optimizer_shard, "optimizer_shard")

    def call(self, inputs):
        return mirror_ops.mirror_micro_step_operator(
            inputs,
            _tf_variable(self.accumulator),
            self.mean_flag,
            self.group,
            self.optimizer_shard,
            timeout=self.timeout,
            name=self.name,
        )

    def get_config(self):
        config_ = super().get_config()
        config_["optimizer_shard"] = self.optimizer_shard
        return config_


class _StepAllGather(_Accumulating):
    def _full_shape(self, input_shape):
        shape = tuple(input_shape)
        if not shape:
            raise ValueError(
                f"Layer {self.name!r} ({type(self).__name__}) gathers along axis 0 and "
                f"needs an input of rank >= 1. Received: input_shape={shape}"
            )
        n = _group_size(self.group)
        return (None if shape[0] is None else shape[0] * n,) + shape[1:]

    def compute_output_shape(self, input_shape):
        return self._full_shape(input_shape)


@keras.saving.register_keras_serializable(package="keras_comm")
class MiniStepAllGather(_MiniSteps, _StepAllGather):
    """All-gathers a parameter shard; accumulates its gradient over mini-steps.

    Forward: concatenation of every group member's input along axis 0.
    Backward: adds dy (the gathered shape) into the ``accumulator``; every
    `accumulation_steps`-th backward returns the reduce-scatter SUM of it
    (this member's shard, times ``1 / group_size`` if `mean_flag`) and
    resets it; other backwards return zeros, without communication. With
    ``accumulation_steps=1`` this is the all-gather's own backward.
    See `keras_comm.ops.mini_step_all_gather`.

    Args:
        mean_flag: divide the reduced gradient by the group size.
        group: None (all replicas) or a list of global ranks.
        accumulation_steps: int >= 1.
        timeout: seconds, or None for `keras_comm.get_timeout()`.

    Input shape: ``(d0, ...)``, fully known.
    Output shape: ``(d0 * group_size, ...)``; the group size is the world
    size when `group` is None, read at build time (the accumulator has the
    output shape, so a model built for N replicas keeps N-replica weights).
    """

    _op = staticmethod(mirror_ops.mini_step_all_gather)

    def __init__(self, mean_flag=True, group=None, accumulation_steps=1, timeout=None, **kwargs):
        super().__init__(mean_flag, group, timeout, **kwargs)
        self.accumulation_steps = _check_steps(accumulation_steps)


@keras.saving.register_keras_serializable(package="keras_comm")
class MicroStepAllGather(_StepAllGather):
    """All-gathers a parameter shard; reduces the micro-steps' accumulated gradient.

    Forward: concatenation of every group member's input along axis 0.
    Backward: ``total = accumulator + dy``, the accumulator is reset, and
    the reduce-scatter SUM of ``total`` is returned (this member's shard,
    times ``1 / group_size`` if `mean_flag`). See
    `keras_comm.ops.micro_step_all_gather`.

    Args:
        mean_flag: divide the reduced gradient by the group size.
        group: None (all replicas) or a list of global ranks.
        timeout: seconds, or None for `keras_comm.get_timeout()`.

    Input shape: ``(d0, ...)``, fully known.
    Output shape: ``(d0 * group_size, ...)``.
    """

    def call(self, inputs):
        return mirror_ops.micro_step_all_gather(
            inputs,
            _tf_variable(self.accumulator),
            self.mean_flag,
            self.group,
            timeout=self.timeout,
            name=self.name,
        )


__all__ = [
    "MiniStepAllGather",
    "MicroStepAllGather",
    "MirrorMicroStepOperator",
    "MirrorMiniStepOperator",
    "MirrorOperator",
]
