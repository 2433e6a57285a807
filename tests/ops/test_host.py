"""HostAllGather / HostReduceScatter: host-side collectives, each other's adjoint."""

import os

import keras
import numpy as np
import pytest
import tensorflow as tf

from keras_comm import layers as L
from keras_comm import ops
from keras_comm.ops import host
import _gradcheck
from conftest import make_strategy, run_replicas
import p2p_worker as cases


@pytest.mark.inprocess
@pytest.mark.parametrize("which", ["gather", "scatter"])
def test_host_gradcheck(strategy, mode, which):
    n = strategy.num_replicas_in_sync
    op_fn, ref_fn, make = cases.host_case(n, which)
    got = _gradcheck.check(strategy, op_fn, ref_fn, make, mode=mode)
    if which == "scatter":
        # Closed form: sum over ranks of (base + 100 r) = n*base + 100 n(n-1)/2.
        base = make(0, n)[:2]
        np.testing.assert_allclose(got[0][0], n * base + 100 * n * (n - 1) / 2)


@pytest.mark.inprocess
@pytest.mark.parametrize("which", ["gather", "scatter"])
@pytest.mark.parametrize("group", [[1, 3], [0, 2], [2]])
def test_host_subgroups(which, group):
    strategy = make_strategy(4)
    op_fn, ref_fn, make = cases.host_case(4, which, group=group)
    _gradcheck.check(strategy, op_fn, ref_fn, make)


@pytest.mark.inprocess
@pytest.mark.parametrize("dtype", ["float16", "bfloat16", "float32", "int32"])
def test_host_dtypes_forward(dtype):
    strategy = make_strategy(2)

    def fn():
        from keras_comm import rank
        x = tf.cast(tf.fill([2, 1], rank() + 1), dtype)
        return ops.host_reduce_scatter(ops.host_all_gather(x))

    got = run_replicas(strategy, fn)
    np.testing.assert_array_equal(got[0].astype(float), [[2], [2]])
    np.testing.assert_array_equal(got[1].astype(float), [[4], [4]])


def test_host_device_mapping():
    assert host.host_device("/job:worker/replica:0/task:1/device:CPU:0") == (
        "/job:worker/replica:0/task:1/device:CPU:0")
    assert host.host_device("/job:worker/replica:0/task:1/device:GPU:0") == (
        "/job:worker/replica:0/task:1/device:CPU:0")


def test_layers_config_save_and_errors(tmp_path):
    for layer in (L.HostAllGather(group=[0, 1], timeout=4), L.HostReduceScatter("SUM", group=[0, 1])):
        assert type(layer).from_config(layer.get_config()).get_config() == layer.get_config()
    assert L.HostReduceScatter().get_config()["op"] == "sum"
    with pytest.raises(ValueError, match="op='max'"):
        L.HostReduceScatter("max")
    with pytest.raises(ValueError, match="must be one of"):
        L.HostReduceScatter("avg")
    x = keras.Input((3,), batch_size=4)
    model = keras.Model(x, L.HostReduceScatter()(L.HostAllGather()(x)))
    path = os.path.join(tmp_path, "m.keras")
    model.save(path)
    data = np.ones((4, 3), "float32")
    np.testing.assert_array_equal(keras.models.load_model(path)(data), data)


@pytest.mark.inprocess
def test_reduce_scatter_indivisible():
    strategy = make_strategy(2)
    with pytest.raises(ValueError, match="divisible by the group size 2"):
        run_replicas(strategy, lambda: ops.host_reduce_scatter(tf.ones([3, 1])))
