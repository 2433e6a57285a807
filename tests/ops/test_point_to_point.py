"""Send / Receive: in-process replicas, a two-stage pipeline, layers, errors."""

import os

import keras
import numpy as np
import pytest
import tensorflow as tf

import keras_comm
from keras_comm import layers as L
from keras_comm import ops
import _gradcheck
from conftest import make_strategy, run_replicas
import p2p_worker as cases


@pytest.mark.inprocess
def test_send_receive_gradcheck(strategy, mode):
    n = strategy.num_replicas_in_sync
    op_fn, ref_fn, make = cases.send_receive_case(n)
    got = _gradcheck.check(strategy, op_fn, ref_fn, make, mode=mode)
    # Closed form: each receiver holds its sender's input; rank 0 keeps x and
    # rank 1 gets a copy, so its gradient is w_0 + w_1 (pass-through gives w_0).
    np.testing.assert_array_equal(got[1][0], make(0, n))
    w = [_gradcheck.loss_weights(r, [2, 3]).numpy() for r in range(2)]
    np.testing.assert_allclose(got[0][1], w[0] + w[1], rtol=1e-12)


@pytest.mark.inprocess
def test_send_layer_gradient(strategy, mode):
    """Send's own rule, through the layer: dx = dy + the receiver's gradient.

    The sender uses its Send output nonlinearly (so dy depends on x) and the
    receiver squares what arrives; a Send backward that drops either term
    fails the float64 simulation.
    """
    n = strategy.num_replicas_in_sync
    recv_from = cases.p2p_routes(n)
    send_to = {s: d for d, s in recv_from.items()}
    send = L.Send(dest=send_to, tag=4, timeout=60, dtype="float64")

    def op_fn(x):
        y = send(x)
        got = ops.receive(y, recv_from, tag=4, timeout=60)
        return tf.sin(y) + got**2

    def ref_fn(xs):
        return [tf.sin(xs[r]) + xs[recv_from.get(r, r)] ** 2 for r in range(n)]

    _gradcheck.check(strategy, op_fn, ref_fn, cases._rank_input([2, 3]), mode=mode)


@pytest.mark.inprocess
@pytest.mark.parametrize("dtype", ["float16", "bfloat16", "int32"])
def test_send_receive_dtypes(dtype):
    strategy = make_strategy(2)

    def fn():
        r = keras_comm.rank()
        x = tf.cast(tf.fill([3], r + 5), dtype)
        return ops.receive(ops.send(x, 1, src=0), 0, dest=1)

    got = run_replicas(strategy, fn)
    assert got[1].dtype == np.dtype(tf.as_dtype(dtype).as_numpy_dtype)
    np.testing.assert_array_equal(got[1].astype(np.float64), [5, 5, 5])


def _pipeline_model():
    inp = keras.Input((4,))
    h = keras.layers.Dense(3, activation="tanh", name="stage1")(inp)
    h = L.Send(dest=1, src=0, tag=1)(h)
    h = L.Receive(src=0, dest=1, tag=1, shape=(None, 3))(h)
    out = keras.layers.Dense(1, name="stage2")(h)
    return keras.Model(inp, out)


@pytest.mark.inprocess
@pytest.mark.parametrize("mode", ["eager", "function"])
def test_two_stage_pipeline_gradients_match_single_process(mode):
    """Rank 0 computes h and sends it; rank 1 receives it and owns the loss."""
    strategy = make_strategy(2)
    keras.utils.set_random_seed(1)
    ref = _pipeline_model()
    weights = ref.get_weights()
    with strategy.scope():
        model = _pipeline_model()
    model.set_weights(weights)
    x = np.random.RandomState(0).randn(5, 4).astype("float32")
    target = np.random.RandomState(1).randn(5, 1).astype("float32")

    def step():
        r = keras_comm.rank()
        # Rank 0 feeds the real batch; rank 1's own input must not matter.
        xr = tf.constant(x) if r == 0 else tf.constant(x * 0 + 7.0)
        with tf.GradientTape() as tape:
            pred = model(xr)
            loss = tf.reduce_mean((pred - target) ** 2) * tf.cast(r == 1, tf.float32)
        return tape.gradient(loss, model.trainable_variables)

    per_replica = run_replicas(strategy, step, mode=mode)
    total = [sum(g[i] for g in per_replica) for i in range(len(weights))]
    with tf.GradientTape() as tape:
        loss = tf.reduce_mean((ref(x) - target) ** 2)
    want = tape.gradient(loss, ref.trainable_variables)
    for g, w in zip(total, want):
        np.testing.assert_allclose(g, w.numpy(), rtol=1e-5, atol=1e-6)
    # stage1's gradient exists only through Send/Receive: it must be non-zero.
    assert np.abs(total[0]).max() > 1e-4


class TestLayers:
    def test_config_round_trip(self):
        for layer in (L.Send(dest=1, src=0, tag=2, timeout=5),
                      L.Send({0: 1, 2: 3}),
                      L.Receive({1: 0}, tag=4, shape=(None, 3), dtype="float16")):
            clone = type(layer).from_config(layer.get_config())
            assert clone.get_config() == layer.get_config()

    def test_world_of_one_is_identity_and_saves(self, tmp_path):
        model = _pipeline_model()
        x = np.ones((2, 4), "float32")
        path = os.path.join(tmp_path, "pipe.keras")
        model.save(path)
        loaded = keras.models.load_model(path)
        np.testing.assert_allclose(loaded.predict(x, verbose=0), model.predict(x, verbose=0))
        seq = keras.Sequential([keras.Input((4,)), L.Send(1, src=0), L.Receive(0, shape=(None, 4))])
        np.testing.assert_array_equal(seq(x), x)

    @pytest.mark.parametrize(
        "make, error, text",
        [
            (lambda: L.Send(dest=-1), ValueError, "dest=-1"),
            (lambda: L.Send(dest="1"), TypeError, "dest='1'"),
            (lambda: L.Send(dest=1, tag=-2), ValueError, "tag=-2"),
            (lambda: L.Send(dest=1, src=1), ValueError, "src=1"),
            (lambda: L.Send({0: 0}), ValueError, "dest={0: 0}"),
            (lambda: L.Send({0: 1}, src=0), ValueError, "src=0"),
            (lambda: L.Send(dest=1, timeout=0), ValueError, "timeout=0"),
            (lambda: L.Receive(src=0, shape=None), TypeError, "shape=None"),
            (lambda: L.Receive(src=0, shape=(2, -1)), ValueError, "shape=(2, -1)"),
            (lambda: L.Receive(src=0, dest=[1, 1], shape=(2,)), ValueError, "dest=[1, 1]"),
        ],
    )
    def test_bad_arguments(self, make, error, text):
        with pytest.raises(error) as info:
            make()
        assert text in str(info.value) and "Received" in str(info.value)

    def test_template_shape_mismatch(self):
        with pytest.raises(ValueError, match=r"does not match shape=\(None, 5\)"):
            L.Receive(0, shape=(None, 5))(keras.Input((4,)))


@pytest.mark.inprocess
def test_trace_time_errors():
    strategy = make_strategy(4)
    with pytest.raises(ValueError, match="only meaningful in a world of 2"):
        run_replicas(strategy, lambda: ops.send(tf.ones([1]), 1))
    with pytest.raises(ValueError, match="outside the world of 4"):
        run_replicas(strategy, lambda: ops.send(tf.ones([1]), {0: 5}))


# The timeout reaching the collective is checked in tests/ops/p2p_worker.py:
# a timed-out collective aborts TF's collective executor for the whole process,
# so it must run last, in a process of its own.
