"""Virtual layers: identity forward, bookkeeping backward.

Thin wrappers of `keras_comm.ops.virtual`; see there for the exact rules.
Layers with a buffer own it: a non-trainable per-replica ``accumulator``
weight (zeros, ``synchronization="on_read"``), created in ``build``. Build
them under ``strategy.scope()``.
"""

import keras

from keras_comm.layers.mirror import _check_group
from keras_comm.layers.mirror import _check_timeout
from keras_comm.layers.mirror import _group_size
from keras_comm.layers.mirror import _static_shape
from keras_comm.layers.mirror import _tf_variable
from keras_comm.layers.mirror import per_replica_weight
from keras_comm.ops import virtual as virtual_ops


class _Buffered(keras.layers.Layer):
    def build(self, input_shape):
        shape = _static_shape(self, input_shape)
        self.accumulator = per_replica_weight(self, "accumulator", shape, self.variable_dtype)

    def compute_output_shape(self, input_shape):
        return input_shape


@keras.saving.register_keras_serializable(package="keras_comm")
class VirtualAssignAdd(_Buffered):
    """Routes the input's gradient into the layer's accumulation buffer.

    Forward: identity.
    Backward: ``accumulator += dy`` — with a `group`, ``accumulator +=
    reduce_scatter_sum(dy)`` over it (this member's shard of axis 0) — and
    returns zeros. See `keras_comm.ops.virtual_assign_add`.

    Args:
        group: None (no communication) or a list of global ranks to
            reduce-scatter over.
        timeout: seconds, or None for `keras_comm.get_timeout()`.

    Input shape: any fully known shape (axis 0 divisible by the group size
    with a group). Output shape: the input shape.
    Weights: ``accumulator``: the input shape, or its shard with a group.
    """

    def __init__(self, group=None, timeout=None, **kwargs):
        super().__init__(**kwargs)
        self.group = _check_group(group)
        self.timeout = _check_timeout(timeout)

    def build(self, input_shape):
        shape = _static_shape(self, input_shape)
        if self.group is not None and shape:
            n = _group_size(self.group)
            if shape[0] % n:
                raise ValueError(
                    f"Layer {self.name!r} (VirtualAssignAdd) reduce-scatters over "
                    f"{n} replicas: the first dimension must be divisible by {n}. "
                    f"Received: input_shape={shape}"
                )
            shape = (shape[0] // n,) + shape[1:]
        self.accumulator = per_replica_weight(self, "accumulator", shape, self.variable_dtype)

    def call(self, inputs):
        return virtual_ops.virtual_assign_add(
            inputs, _tf_variable(self.accumulator), self.group, timeout=self.timeout, name=self.name
        )

    def get_config(self):
        config = super().get_config()
        config.update(group=self.group, timeout=self.timeout)
        return config


@keras.saving.register_keras_serializable(package="keras_comm")
class VirtualAccuGrad(_Buffered):
    """Replaces the input's gradient with the layer's accumulation buffer.

    Forward: identity.
    Backward: returns ``accumulator`` (dy is discarded). See
    `keras_comm.ops.virtual_accu_grad`.

    Input shape: any fully known shape. Output shape: the input shape.
    """

    def call(self, inputs):
        return virtual_ops.virtual_accu_grad(inputs, _tf_variable(self.accumulator), name=self.name)


@keras.saving.register_keras_serializable(package="keras_comm")
class VirtualAdd(_Buffered):
    """Adds the layer's accumulation buffer to the input's gradient.

    Forward: identity.
    Backward: returns ``dy + accumulator``. See `keras_comm.ops.virtual_add`.

    Input shape: any fully known shape. Output shape: the input shape.
    """

    def call(self, inputs):
        return virtual_ops.virtual_add(inputs, _tf_variable(self.accumulator), name=self.name)


@keras.saving.register_keras_serializable(package="keras_comm")
class VirtualDiv(keras.layers.Layer):
    """Divides the gradient flowing back through it by `divisor`.

    Forward: identity (a tensor, or a tuple/list of tensors).
    Backward: ``dy / divisor`` for floating tensors; integer ones pass
    through. See `keras_comm.ops.virtual_div`.

    Args:
        divisor: a non-zero number.

    Input shape: any (or a list of shapes). Output shape: the same.
    """

    def __init__(self, divisor, **kwargs):
        super().__init__(**kwargs)
        self.divisor = virtual_ops._check_divisor(divisor)  # pylint: disable=protected-access

    def call(self, inputs):
        return virtual_ops.virtual_div(inputs, self.divisor)

    def compute_output_shape(self, input_shape):
        return input_shape

    def get_config(self):
        config = super().get_config()
        config["divisor"] = self.divisor
        return config


@keras.saving.register_keras_serializable(package="keras_comm")
class GetTensorSlice(keras.layers.Layer):
    """Keeps this replica's slice of a full tensor.

    Forward: splits the input into `num_slices` equal slices along `axis`
    and keeps slice ``group.index(rank) % num_slices`` (num_slices defaults
    to the group size). No communication.
    Backward: ``backward="zeros"`` (the reference) returns zeros;
    ``backward="exact"`` returns dy placed at the slice's position (the
    adjoint). See `keras_comm.ops.get_tensor_slice`.

    Args:
        axis: int, the axis to slice.
        num_slices: int >= 1, or None for the group size.
        group: None (all replicas) or a list of global ranks.
        backward: "zeros" or "exact".

    Input shape: any with ``shape[axis]`` divisible by the slice count.
    Output shape: ``shape[axis] / num_slices`` along `axis`.
    """

    def __init__(self, axis=0, num_slices=None, group=None, backward="zeros", **kwargs):
        super().__init__(**kwargs)
        if isinstance(axis, bool) or not isinstance(axis, int):
            raise TypeError(f"`axis` must be an int. Received: axis={axis!r}")
        if num_slices is not None and (
            isinstance(num_slices, bool) or not isinstance(num_slices, int) or num_slices < 1
        ):
            raise ValueError(
                f"`num_slices` must be an int >= 1 or None. Received: num_slices={num_slices!r}"
            )
        if backward not in ("zeros", "exact"):
            raise ValueError(
                f"`backward` must be 'zeros' or 'exact'. Received: backward={backward!r}"
            )
        self.axis = axis
        self.num_slices = num_slices
        self.group = _check_group(group)
        self.backward = backward

    def call(self, inputs):
        return virtual_ops.get_tensor_slice(
            inputs, self.axis, self.num_slices, self.group, self.backward, name=self.name
        )

    def compute_output_shape(self, input_shape):
        shape = list(input_shape)
        n = self.num_slices or _group_size(self.group)
        if shape[self.axis] is not None:
            shape[self.axis] //= n
        return tuple(shape)

    def get_config(self):
        config = super().get_config()
        config.update(
            axis=self.axis, num_slices=self.num_slices, group=self.group, backward=self.backward
        )
        return config
