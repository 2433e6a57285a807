"""Virtual layers: identity forward, bookkeeping backward.

Thin wrappers of `keras_comm.ops.virtual`; see there for the exact rules.
Layers with a buffer own it (see `PerReplicaAccumulator`): build them under
``strategy.scope()``.
"""

import math

import keras

from keras_comm import _validation
from keras_comm.layers._base import CollectiveLayer
from keras_comm.layers._base import PerReplicaAccumulator
from keras_comm.layers._base import group_size
from keras_comm.ops import virtual as virtual_ops


@keras.saving.register_keras_serializable(package="keras_comm")
class VirtualAssignAdd(PerReplicaAccumulator, CollectiveLayer):
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
        super().__init__(group=group, timeout=timeout, **kwargs)

    def _accumulator_shape(self, shape):
        if self.group is None or not shape:
            return shape
        n = group_size(self.group)
        if shape[0] % n:
            raise ValueError(
                f"Layer {self.name!r} (VirtualAssignAdd) reduce-scatters over "
                f"{n} replicas: the first dimension must be divisible by {n}. "
                f"Received: input_shape={shape}"
            )
        return (shape[0] // n,) + shape[1:]

    def call(self, inputs):
        return virtual_ops.virtual_assign_add(
            inputs, self._accumulator_variable(), self.group, timeout=self.timeout, name=self.name
        )


@keras.saving.register_keras_serializable(package="keras_comm")
class VirtualAccuGrad(PerReplicaAccumulator, CollectiveLayer):
    """Replaces the input's gradient with the layer's accumulation buffer.

    Forward: identity.
    Backward: returns ``accumulator`` (dy is discarded). See
    `keras_comm.ops.virtual_accu_grad`.

    Input shape: any fully known shape. Output shape: the input shape.
    """

    def call(self, inputs):
        return virtual_ops.virtual_accu_grad(inputs, self._accumulator_variable(), name=self.name)


@keras.saving.register_keras_serializable(package="keras_comm")
class VirtualAdd(PerReplicaAccumulator, CollectiveLayer):
    """Adds the layer's accumulation buffer to the input's gradient.

    Forward: identity.
    Backward: returns ``dy + accumulator``. See `keras_comm.ops.virtual_add`.

    Input shape: any fully known shape. Output shape: the input shape.
    """

    def call(self, inputs):
        return virtual_ops.virtual_add(inputs, self._accumulator_variable(), name=self.name)


@keras.saving.register_keras_serializable(package="keras_comm")
class VirtualDiv(CollectiveLayer):
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
        self.divisor = _validation.nonzero_number(divisor, "divisor")

    def call(self, inputs):
        return virtual_ops.virtual_div(inputs, self.divisor)

    def get_config(self):
        config = super().get_config()
        config["divisor"] = self.divisor
        return config


@keras.saving.register_keras_serializable(package="keras_comm")
class GetTensorSlice(CollectiveLayer):
    """Keeps this replica's slice of a full tensor.

    Forward: splits the input into `num_slices` equal slices along `axis`
    and keeps slice ``group.index(rank) % num_slices`` (num_slices defaults
    to the group size). With a layout, MindSpore's description of a
    multi-axis sharding, the group's members form a row-major grid of shape
    `device_matrix` and input dimension i is split by the grid dimension
    ``tensor_map[i]`` (counted from the grid's last dimension; -1: kept
    whole). No communication.
    Backward: ``backward="zeros"`` (as MindSpore's GetTensorSlice) returns zeros;
    ``backward="exact"`` returns dy placed at the slice's position (the
    adjoint). See `keras_comm.ops.get_tensor_slice`.

    Args:
        axis: int, the axis to slice.
        num_slices: int >= 1, or None for the group size.
        group: None (all replicas) or a list of global ranks.
        backward: "zeros" or "exact".
        device_matrix: None, or a list of ints >= 1 whose product is the
            group size (with `tensor_map`; then `axis` and `num_slices` keep
            their defaults).
        tensor_map: None, or one int in ``[-1, len(device_matrix))`` per
            input dimension, each grid dimension used at most once.

    Input shape: any with ``shape[axis]`` divisible by the slice count (with
    a layout: every split dimension divisible by its grid dimension).
    Output shape: ``shape[axis] / num_slices`` along `axis` (with a layout:
    each split dimension divided by its grid dimension).
    """

    def __init__(
        self,
        axis=0,
        num_slices=None,
        group=None,
        backward="zeros",
        device_matrix=None,
        tensor_map=None,
        **kwargs,
    ):
        super().__init__(group=group, **kwargs)
        self.axis = _validation.integer(axis, "axis")
        self.num_slices = (
            None if num_slices is None else _validation.positive_int(num_slices, "num_slices")
        )
        self.backward = _validation.one_of(backward, ("zeros", "exact"), "backward")
        self.device_matrix = self.tensor_map = None
        if device_matrix is not None or tensor_map is not None:
            if device_matrix is None or tensor_map is None:
                raise ValueError(
                    "A layout needs both `device_matrix` and `tensor_map`. Received: "
                    f"device_matrix={device_matrix!r}, tensor_map={tensor_map!r}"
                )
            if self.axis != 0 or self.num_slices is not None:
                raise ValueError(
                    "`axis` and `num_slices` describe the one-axis slice; with a layout "
                    f"leave them at their defaults. Received: axis={axis!r}, "
                    f"num_slices={num_slices!r}"
                )
            dm, tm = virtual_ops.tensor_layout(device_matrix, tensor_map)
            if self.group is not None and math.prod(dm) != self.group.size:
                raise ValueError(
                    f"The device matrix must hold the group's {self.group.size} members. "
                    f"Received: device_matrix={list(device_matrix)!r}"
                )
            self.device_matrix, self.tensor_map = list(dm), list(tm)

    def call(self, inputs):
        return virtual_ops.get_tensor_slice(
            inputs,
            self.axis,
            self.num_slices,
            self.group,
            self.backward,
            device_matrix=self.device_matrix,
            tensor_map=self.tensor_map,
            name=self.name,
        )

    def _output_shape(self, shape):
        shape = list(shape)
        if self.device_matrix is not None:
            if len(shape) != len(self.tensor_map):
                raise ValueError(
                    f"Layer {self.name!r}: `tensor_map` needs one entry per input "
                    f"dimension. Received: tensor_map={self.tensor_map}, input_shape={tuple(shape)}"
                )
            k = len(self.device_matrix)
            for a, m in enumerate(self.tensor_map):
                if m != -1 and shape[a] is not None:
                    shape[a] //= self.device_matrix[k - 1 - m]
            return tuple(shape)
        n = self.num_slices or group_size(self.group)
        if shape[self.axis] is not None:
            shape[self.axis] //= n
        return tuple(shape)

    def get_config(self):
        config = super().get_config()
        config.update(
            axis=self.axis,
            num_slices=self.num_slices,
            backward=self.backward,
            device_matrix=self.device_matrix,
            tensor_map=self.tensor_map,
        )
        return config
