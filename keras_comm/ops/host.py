"""Host-side collectives: `host_all_gather` and `host_reduce_scatter`.

They run the collective on the host (CPU) instead of the accelerator, e.g.
to keep large, rarely used tensors off the device network (MindSpore:
_HostAllGather, _HostReduceScatter). Here the collective is placed on the worker's CPU,
``/job:.../task:i/device:CPU:0``, when that CPU serves exactly one replica
(one accelerator per worker): the tensor is copied to host memory, gathered
or reduced over the CPU ring (gRPC), and the result copied back to the
replica's device.

Honest limits:

* If the replica already is a CPU (CPU-only machines, the in-process test
  replicas), the collective runs on that CPU: exactly `all_gather` /
  `reduce_scatter`.
* TF's collectives cannot put two members of one collective on the same
  device, so when several local replicas share one host CPU (several GPUs
  per worker) the collective stays on the replicas' own devices (NCCL): the
  same values, without the host placement.
"""

import tensorflow as tf

from keras_comm import topology
from keras_comm.ops import _checks
from keras_comm.ops import _collective
from keras_comm.ops import _differentiable as D
from keras_comm.ops.reduce_op import ReduceOp


def host_device(device):
    """The host CPU a replica on `device` should run host collectives on."""
    spec = tf.DeviceSpec.from_string(device or "")
    if (spec.device_type or "CPU").upper() == "CPU":
        return device
    try:
        shared = _collective._local_replica_count() > 1  # pylint: disable=protected-access
    except RuntimeError:  # no strategy: nothing shares the host
        shared = False
    if shared:
        return device
    return spec.replace(device_type="CPU", device_index=0).to_string()


def _host_call(call):
    host = host_device(call.device)
    if host == call.device:
        return call
    replica = topology.Replica(call.replica.rank, call.replica.world_size, host)
    return _collective.Call(replica, call.group, call.timeout, call.name)


def _on_host(primitive, x, call):
    """Runs ``primitive(x, host_call)`` on the host; the result on the replica."""
    host = _host_call(call)
    with tf.device(host.device):
        y = primitive(tf.identity(x), host)
    with tf.device(call.device):
        return tf.identity(y)


def host_all_gather(x, group=None, *, timeout=None, name=None):
    """Concatenates every member's `x` along axis 0, on the host CPU.

    Forward: ``concat([x_0, ..., x_{n-1}], axis=0)`` (group order), computed
    on the worker's CPU (see the module notes for when it is not). Backward:
    `host_reduce_scatter` SUM of dy: the sum over members of dy, own slice.
    The exact adjoint. Non-members return `x` and pass their
    gradient through.

    Args:
        x: the same shape on every member (rank >= 1).
        group: member ranks; None = the world.
        timeout: seconds before DeadlineExceeded.
        name: op name (the layer's name).
    """
    what = _checks.what("host_all_gather", name)
    x = tf.convert_to_tensor(x)
    if x.shape.rank == 0:
        raise ValueError(f"{what}: `x` must have rank >= 1. Received: x.shape=()")
    call = _collective.resolve(group, timeout, name)

    def forward(x):
        return _on_host(D.all_gather, x, call)

    def backward(dy, x, y):
        _checks.check_divisible(dy.shape, 0, call.size, what, arg="dy")
        return _on_host(D.reduce_scatter, dy, call)

    return D.collective(x, call, forward, backward)


def host_reduce_scatter(x, op="sum", group=None, *, timeout=None, name=None):
    """Sums `x` over the group on the host CPU; each member keeps its slice.

    Forward: ``sum_i x_i``, split in n along axis 0, member k keeps slice k;
    computed on the worker's CPU (see the module notes). Backward:
    `host_all_gather` of dy. The exact adjoint.

    Only SUM is supported (no other reduction has a backward here); other
    ops are rejected when the op is called.

    Args:
        x: same shape on every member; axis 0 divisible by the group size.
        op: "sum" or `ReduceOp.SUM`.
        group: member ranks; None = the world. Non-members return `x`.
        timeout: seconds before DeadlineExceeded.
        name: op name (the layer's name).
    """
    what = _checks.what("host_reduce_scatter", name)
    op = ReduceOp.from_value(op)
    if op is not ReduceOp.SUM:
        raise ValueError(
            f"{what}: only op='sum' has a backward. Received: op={op.value!r}"
        )
    x = tf.convert_to_tensor(x)
    call = _collective.resolve(group, timeout, name)
    if not call.trivial:
        _checks.check_divisible(x.shape, 0, call.size, what)

    def forward(x):
        return _on_host(D.reduce_scatter, x, call)

    def backward(dy, x, y):
        return _on_host(D.all_gather, dy, call)

    return D.collective(x, call, forward, backward)


__all__ = ["host_all_gather", "host_reduce_scatter"]
