"""AllSwap: variable-size exchange."""

import os

import keras
import numpy as np
import pytest
import tensorflow as tf

from keras_comm import layers as L
from keras_comm import ops
import _gradcheck
from conftest import make_strategy, run_replicas
import p2p_worker as cases


@pytest.mark.inprocess
@pytest.mark.parametrize("with_recv", [True, False], ids=["recv_sizes", "derived"])
def test_all_swap_gradcheck(strategy, mode, with_recv):
    n = strategy.num_replicas_in_sync
    op_fn, ref_fn, make = cases.all_swap_case(n, with_recv=with_recv)
    got = _gradcheck.check(strategy, op_fn, ref_fn, make, mode=mode)
    sizes = cases.swap_sizes(n)
    for r in range(n):
        assert got[r][0].shape[0] == sum(sizes[i][r] for i in range(n))


@pytest.mark.inprocess
def test_all_swap_subgroup():
    strategy = make_strategy(4)
    op_fn, ref_fn, make = cases.all_swap_case(4, group=[1, 3])
    _gradcheck.check(strategy, op_fn, ref_fn, make)


@pytest.mark.inprocess
def test_all_swap_int32_forward():
    strategy = make_strategy(2)

    def fn():
        from keras_comm import rank
        r = rank()
        x = tf.constant([[10 * r], [10 * r + 1]], tf.int32)
        return ops.all_swap(x, [1, 1] if r == 0 else [2, 0])

    got = run_replicas(strategy, fn)
    np.testing.assert_array_equal(got[0], [[0], [10], [11]])
    np.testing.assert_array_equal(got[1], [[1]])


@pytest.mark.inprocess
def test_wrong_recv_sizes_is_a_runtime_error():
    strategy = make_strategy(2)
    with pytest.raises(tf.errors.InvalidArgumentError, match="recv_sizes"):
        run_replicas(strategy, lambda: ops.all_swap(tf.ones([2, 1]), [1, 1], [2, 0]))


@pytest.mark.inprocess
def test_static_size_errors():
    strategy = make_strategy(2)
    with pytest.raises(ValueError, match=r"must be a 1-D list of 2 sizes"):
        run_replicas(strategy, lambda: ops.all_swap(tf.ones([2, 1]), [1, 1, 0]))
    with pytest.raises(ValueError, match=r"sum\(send_sizes\)=3 rows"):
        run_replicas(strategy, lambda: ops.all_swap(tf.ones([2, 1]), [1, 2]))


def test_layer_config_and_world_of_one(tmp_path):
    layer = L.AllSwap(group=[0, 1], timeout=3)
    assert L.AllSwap.from_config(layer.get_config()).get_config() == layer.get_config()
    x = keras.Input((2,))
    s = keras.Input((1,), dtype="int32", batch_size=1)
    y = L.AllSwap()([x, keras.ops.reshape(s, (1,))])
    model = keras.Model([x, s], y)
    assert model.output_shape == (None, 2)
    path = os.path.join(tmp_path, "m.keras")
    model.save(path)
    loaded = keras.models.load_model(path)
    xs = np.arange(6, dtype="float32").reshape(3, 2)
    np.testing.assert_array_equal(loaded([xs, np.array([[3]], "int32")]), xs)
    with pytest.raises(ValueError, match="timeout=-1"):
        L.AllSwap(timeout=-1)
    with pytest.raises(ValueError, match="called on"):
        L.AllSwap()(keras.Input((2,)))
