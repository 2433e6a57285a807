"""Shared fixtures: in-process replicas on logical CPU devices.

The CPU is split into `NUM_LOGICAL_CPUS` logical devices when this file is
imported, before TensorFlow initialises its devices, so every in-process test
can run 2 or 4 replicas of a `MultiWorkerMirroredStrategy` in this process.
Multi-process tests live beside them and use `tests/_cluster.py`.
"""

import numpy as np
import pytest
import tensorflow as tf

NUM_LOGICAL_CPUS = 4


def _split_cpu():
    cpus = tf.config.list_physical_devices("CPU")
    try:
        tf.config.set_logical_device_configuration(
            cpus[0], [tf.config.LogicalDeviceConfiguration()] * NUM_LOGICAL_CPUS
        )
    except RuntimeError:
        # Devices already initialised (e.g. a plugin imported TF first): the
        # in-process fixtures will fail with a clear message instead.
        pass


_split_cpu()

_strategies = {}


def make_strategy(num_replicas):
    """A MultiWorkerMirroredStrategy over `num_replicas` local CPU devices."""
    available = len(tf.config.list_logical_devices("CPU"))
    if num_replicas > available:
        pytest.fail(
            f"{num_replicas} replicas need {num_replicas} logical CPUs; "
            f"only {available} exist (TF was initialised before conftest)."
        )
    if num_replicas not in _strategies:
        # Every in-process MWMS numbers its own collective groups from
        # 1 + _collective_key_base; strategies over different device sets
        # must not share numbers, or a second model.fit joins a group of the
        # wrong size ("joining a group with size 4, but that group has size 2").
        cls = tf.distribute.MultiWorkerMirroredStrategy
        cls._collective_key_base = 70000 + 1000 * num_replicas
        try:
            devices = [f"/cpu:{i}" for i in range(num_replicas)]
            _strategies[num_replicas] = cls._from_local_devices(devices)
        finally:
            cls._collective_key_base = 0
    return _strategies[num_replicas]


def run_replicas(strategy, fn, *args, mode="function"):
    """Runs ``fn(*args)`` on every replica; returns one numpy nest per replica.

    `fn` runs in replica context (use ``keras_comm.rank()`` inside). `mode` is
    "eager" or "function" (the whole `strategy.run` inside one tf.function).
    """
    if mode == "function":
        out = tf.function(lambda: strategy.run(fn, args=args))()
    elif mode == "eager":
        out = strategy.run(fn, args=args)
    else:
        raise ValueError(f"mode must be 'eager' or 'function'. Received: {mode!r}")
    per_replica = [
        tf.nest.map_structure(lambda v, i=i: strategy.experimental_local_results(v)[i], out)
        for i in range(strategy.num_replicas_in_sync)
    ]
    return [tf.nest.map_structure(lambda t: np.asarray(t), r) for r in per_replica]


@pytest.fixture(params=[2, 4], ids=lambda n: f"{n}replicas")
def strategy(request):
    """A 2- or 4-replica in-process MultiWorkerMirroredStrategy."""
    return make_strategy(request.param)


@pytest.fixture(params=["eager", "function"])
def mode(request):
    return request.param
