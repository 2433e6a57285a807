"""`HostAllGather` / `HostReduceScatter` layers: collectives on the host CPU."""

import keras

from keras_comm.layers._base import CollectiveLayer
from keras_comm.layers.gather_scatter import sum_only
from keras_comm.ops import host as host_ops


def _axis0(shape, group, scale):
    # Axis 0 times (or divided by) the group size, known here only when the
    # group is given.
    shape = tuple(shape)
    d0 = shape[0]
    return ((None if group is None or d0 is None else scale(d0, group.size)),) + shape[1:]


@keras.saving.register_keras_serializable(package="keras_comm")
class HostAllGather(CollectiveLayer):
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

    def __init__(self, group=None, timeout=None, **kwargs):
        super().__init__(group=group, timeout=timeout, **kwargs)

    def call(self, inputs):
        return host_ops.host_all_gather(inputs, self.group, timeout=self.timeout, name=self.name)

    def _output_shape(self, shape):
        return _axis0(shape, self.group, lambda d0, n: n * d0)


@keras.saving.register_keras_serializable(package="keras_comm")
class HostReduceScatter(CollectiveLayer):
    """Reduce-scatter (SUM) along axis 0, run on the worker's CPU.

    Placement as `HostAllGather`; on CPU replicas it is exactly
    `ReduceScatter`. Forward: sum over the group, split axis 0 in n, keep own
    slice. Backward: HostAllGather of dy. Only op="sum": the backward, an
    all-gather, is the adjoint of a SUM only.

    Args:
        op: "sum" or `keras_comm.ops.ReduceOp.SUM`.
        group: member ranks, or None for the world. Non-members pass through.
        timeout: seconds before DeadlineExceeded.

    Input shape: ``(d0, ...)``, d0 divisible by n. Output: ``(d0 / n, ...)``.
    """

    def __init__(self, op="sum", group=None, timeout=None, **kwargs):
        super().__init__(group=group, timeout=timeout, **kwargs)
        self.op = sum_only(op, "HostReduceScatter")

    def call(self, inputs):
        return host_ops.host_reduce_scatter(
            inputs, self.op, self.group, timeout=self.timeout, name=self.name
        )

    def _output_shape(self, shape):
        return _axis0(shape, self.group, lambda d0, n: d0 // n)

    def get_config(self):
        config = super().get_config()
        config["op"] = self.op.value
        return config
