"""`HostAllGather` / `HostReduceScatter` layers: collectives on the host CPU."""

import keras

from keras_comm import topology
from keras_comm.layers.point_to_point import _timeout
from keras_comm.ops import host as host_ops
from keras_comm.ops.reduce_op import ReduceOp


class _HostLayer(keras.layers.Layer):
    def __init__(self, group=None, timeout=None, **kwargs):
        super().__init__(**kwargs)
        self.group = topology.as_group(group)
        self.timeout = _timeout(timeout)

    def _group(self):
        return None if self.group is None else list(self.group.ranks)

    def get_config(self):
        config_ = super().get_config()
        config_.update(group=self._group(), timeout=self.timeout)
        return config_


@keras.saving.register_keras_serializable(package="keras_comm")
class HostAllGather(_HostLayer):
    """All-gather along axis 0, run on the worker's CPU.

    On TensorFlow the collective is placed on the worker's host CPU when the
    replica is an accelerator and the only replica of its worker; when the
    replica is a CPU (CPU-only machines) or several local replicas share the
    host CPU, it runs on the replica's device and is exactly `AllGather`.
    See `keras_comm.ops.host_all_gather`.

    Forward: concat of every member's input on axis 0. Backward:
    HostReduceScatter SUM of dy (own slice of the sum).

    Args:
        group: member ranks, or None for the world. Non-members pass through.
        timeout: seconds before DeadlineExceeded.

    Input shape: ``(d0, ...)``. Output shape: ``(n * d0, ...)`` with n the
    group size, known only when the layer runs (None symbolically).
    """

    def call(self, inputs):
        return host_ops.host_all_gather(inputs, self._group(), timeout=self.timeout, name=self.name)

    def compute_output_shape(self, input_shape):
        n = None if self.group is None else self.group.size
        d0 = input_shape[0]
        return ((None if n is None or d0 is None else n * d0),) + tuple(input_shape[1:])


@keras.saving.register_keras_serializable(package="keras_comm")
class HostReduceScatter(_HostLayer):
    """Reduce-scatter (SUM) along axis 0, run on the worker's CPU.

    Placement as `HostAllGather`; on CPU replicas it is exactly
    `ReduceScatter`. Forward: sum over the group, split axis 0 in n, keep own
    slice. Backward: HostAllGather of dy. Only op="sum" (the reference's
    backward supports only SUM).

    Args:
        op: "sum" or `keras_comm.ops.ReduceOp.SUM`.
        group: member ranks, or None for the world. Non-members pass through.
        timeout: seconds before DeadlineExceeded.

    Input shape: ``(d0, ...)``, d0 divisible by n. Output: ``(d0 / n, ...)``.
    """

    def __init__(self, op="sum", group=None, timeout=None, **kwargs):
        super().__init__(group=group, timeout=timeout, **kwargs)
        self.op = ReduceOp.from_value(op)
        if self.op is not ReduceOp.SUM:
            raise ValueError(
                f"`op` must be 'sum': the reference defines HostReduceScatter's "
                f"backward only for SUM. Received: op={op!r}"
            )

    def call(self, inputs):
        return host_ops.host_reduce_scatter(
            inputs, self.op, self._group(), timeout=self.timeout, name=self.name
        )

    def compute_output_shape(self, input_shape):
        n = None if self.group is None else self.group.size
        d0 = input_shape[0]
        return ((None if n is None or d0 is None else d0 // n),) + tuple(input_shape[1:])

    def get_config(self):
        config_ = super().get_config()
        config_.update(op=self.op.value)
        return config_
