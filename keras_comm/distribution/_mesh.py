"""A `keras.distribution.DeviceMesh` over the replicas of a TensorFlow job.

On TensorFlow keras_comm runs one model replica per device of a
`tf.distribute.MultiWorkerMirroredStrategy`: ``num_replicas_in_sync``
replicas, numbered worker-major (worker ``t``'s ``i``-th local device is
replica ``t * devices_per_worker + i``). A mesh names those replicas by
their TensorFlow device names, `list_devices()` gives them in rank order,
and the mesh's devices, read row-major, must be exactly that list: the
mesh's ``k``-th device is replica ``k``.
"""

import keras
import numpy as np
import tensorflow as tf

from keras_comm import topology


def list_devices(strategy=None):
    """The devices of every replica of the job, in rank order.

    Pass the result to `keras.distribution.DeviceMesh(devices=...)`. With
    one worker, Keras's own `keras.distribution.list_devices()` names the
    same devices (``"cpu:0"``, ...) and is accepted too.

    Args:
        strategy: the job's strategy (default: the current one).

    Returns:
        A list of TensorFlow device names, one per replica, e.g.
        ``"/job:worker/replica:0/task:1/device:CPU:0"`` for worker 1's
        first replica.
    """
    strategy = strategy or tf.distribute.get_strategy()
    local = list(getattr(strategy.extended, "worker_devices", ()) or ["/device:CPU:0"])
    workers = topology.worker_count(strategy)
    if workers == 1:
        return [tf.DeviceSpec.from_string(d).to_string() for d in local]
    out = []
    for task in range(workers):
        for d in local:
            spec = tf.DeviceSpec.from_string(d).replace(job="worker", replica=0, task=task)
            out.append(spec.to_string())
    return out


def _short_name(device):
    spec = tf.DeviceSpec.from_string(device)
    return f"{(spec.device_type or 'cpu').lower()}:{spec.device_index or 0}"


def check_mesh(device_mesh, strategy, what):
    """Checks that `device_mesh` spans exactly the job's replicas, in rank order.

    Raises:
        ValueError: the mesh has more or fewer devices than the job has
            replicas, or its devices are not the job's in rank order.
    """
    world = strategy.num_replicas_in_sync
    devices = [str(d) for d in np.reshape(np.asarray(device_mesh.devices), -1)]
    if len(devices) != world:
        raise ValueError(
            f"{what}: the device mesh {tuple(device_mesh.shape)} spans {len(devices)} "
            f"devices, but the job has {world} replica(s) in sync; on TensorFlow a "
            "mesh must span exactly the replicas of the MultiWorkerMirroredStrategy "
            "(`keras_comm.distribution.list_devices()`). "
            f"Received: shape={tuple(device_mesh.shape)}"
        )
    expected = list_devices(strategy)
    canonical = [tf.DeviceSpec.from_string(d).to_string() for d in devices]
    if canonical == expected:
        return
    if topology.worker_count(strategy) == 1 and [_short_name(d) for d in devices] == [
        _short_name(d) for d in expected
    ]:
        return
    raise ValueError(
        f"{what}: the device mesh must list the job's replicas in rank order, "
        f"as `keras_comm.distribution.list_devices()` gives them: {expected}. "
        f"Received: devices={devices}"
    )


def check_distribution(distribution, strategy):
    """Checks a `keras.distribution` distribution against the job.

    Raises:
        TypeError: a distribution other than `DataParallel` / `ModelParallel`.
        ValueError: a mesh that is not the job's replicas, or a
            `batch_dim_name` the mesh lacks.
    """
    if not isinstance(
        distribution, (keras.distribution.DataParallel, keras.distribution.ModelParallel)
    ):
        raise TypeError(
            "keras_comm honours keras.distribution.DataParallel and ModelParallel on "
            f"TensorFlow. Received: distribution={distribution!r}"
        )
    mesh = distribution.device_mesh
    what = type(distribution).__name__
    check_mesh(mesh, strategy, what)
    batch = distribution.batch_dim_name
    if batch is not None and batch not in tuple(mesh.axis_names):
        raise ValueError(
            f"{what}: `batch_dim_name` must be an axis of the device mesh "
            f"{tuple(mesh.axis_names)}. Received: batch_dim_name={batch!r}"
        )
