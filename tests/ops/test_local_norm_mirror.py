"""dump_local_norm inside the mirror backward (issue 17 item 3).

The mirror ops given a `local_norm` variable (the layers' ``dump_local_norm=True``)
set it, per replica, to the L2 norm of that replica's gradient before it is
reduced; the micro-step variants to the norm of the accumulated total. Each
is compared with the norm of the local gradient computed independently in
numpy from the loss's closed form, while the returned gradient stays the
reduced one.
"""

import numpy as np
import pytest
import tensorflow as tf

import keras
import keras_comm
from keras_comm import layers
from keras_comm import ops
from conftest import make_strategy
from test_mirror import _micro_dy
from test_mirror import _micro_input
from test_mirror import _micro_loss
from test_mirror import _per_replica
from test_mirror import _stepper


def _norms(strategy, variable):
    return [float(v.numpy()) for v in strategy.experimental_local_results(variable)]


@pytest.mark.inprocess
@pytest.mark.parametrize("mean", [True, False])
def test_mirror_operator_records_local_norm(strategy, mode, mean):
    n = strategy.num_replicas_in_sync
    norm = _per_replica(strategy, [], tf.float32)

    def fn(t):
        r = keras_comm.rank()
        x = tf.constant([1.0, 2.0, 3.0], tf.float64) * tf.cast(r + 1, tf.float64) + t
        with tf.GradientTape() as tape:
            tape.watch(x)
            loss = _micro_loss(ops.mirror_operator(x, mean, local_norm=norm), r, t)
        return tape.gradient(loss, x)

    got = _stepper(strategy, fn, mode)(1)
    want = sum(_micro_dy(q, 1) for q in range(n)) / (n if mean else 1)
    for r in range(n):
        np.testing.assert_allclose(got[r], want, rtol=1e-12)  # still reduced
    want_norms = [np.linalg.norm(_micro_dy(r, 1)) for r in range(n)]  # local, unreduced
    np.testing.assert_allclose(_norms(strategy, norm), want_norms, rtol=1e-6)
    assert len(set(_norms(strategy, norm))) == n  # differs per replica


@pytest.mark.inprocess
def test_mirror_operator_records_sparse_local_norm(mode):
    strategy = make_strategy(2)
    norm = _per_replica(strategy, [], tf.float32)
    idx = {0: [0, 2, 0], 1: [1, 1]}

    def fn():
        r = keras_comm.rank()
        table = tf.reshape(tf.range(8.0, dtype=tf.float64), [4, 2])
        with tf.GradientTape() as tape:
            tape.watch(table)
            rows = tf.gather(ops.mirror_operator(table, False, local_norm=norm), idx[r] if r == 0 else idx[1])
            loss = tf.reduce_sum(rows * tf.cast(r + 1, tf.float64))
        return tf.convert_to_tensor(tape.gradient(loss, table))

    _stepper(strategy, lambda t: fn(), mode)(0)
    for r, got in enumerate(_norms(strategy, norm)):
        dense = np.zeros([4, 2])
        for i in idx[r]:
            dense[i] += r + 1  # duplicate rows add up, as in the dense gradient
        np.testing.assert_allclose(got, np.linalg.norm(dense), rtol=1e-6)


@pytest.mark.inprocess
def test_micro_step_ops_record_accumulated_norm(strategy, mode):
    """The micro-step mirror and gather record the norm of the whole accumulated total."""
    n, m = strategy.num_replicas_in_sync, 3
    acc = _per_replica(strategy, [3])
    gacc = _per_replica(strategy, [3 * n])
    norm, gnorm = _per_replica(strategy, [], tf.float32), _per_replica(strategy, [], tf.float32)

    def fn(t):
        r = keras_comm.rank()
        x = tf.constant([1.0, 2.0, 3.0], tf.float64) * tf.cast(r + 1, tf.float64)
        for s in range(m):
            xs = x + s
            with tf.GradientTape() as tape:
                tape.watch(xs)
                if s < m - 1:
                    y = ops.virtual_assign_add(xs, acc)
                    g = ops.virtual_assign_add(tf.concat([xs] * n, 0), gacc)
                else:
                    y = ops.mirror_micro_step_operator(xs, acc, local_norm=norm)
                    g = ops.micro_step_all_gather(xs, gacc, local_norm=gnorm)
                loss = _micro_loss(y, r, s) + tf.reduce_sum(g) * tf.cast(r + 1, tf.float64)
            tape.gradient(loss, xs)
        return tf.constant(0.0)

    _stepper(strategy, fn, mode)(0)
    want = [np.linalg.norm(sum(_micro_dy(r, s) for s in range(m))) for r in range(n)]
    np.testing.assert_allclose(_norms(strategy, norm), want, rtol=1e-6)
    # The gather's total: m micro-batches of dy = (r + 1) everywhere, gathered shape.
    want = [np.linalg.norm(np.full(3 * n, m * (r + 1.0))) for r in range(n)]
    np.testing.assert_allclose(_norms(strategy, gnorm), want, rtol=1e-6)


def _fit_model():
    inputs = keras.Input(shape=(3,), batch_size=4)
    h = keras.layers.Dense(2, name="d1", kernel_initializer="ones")(inputs)
    h = layers.MirrorOperator(dump_local_norm=True, name="mirror")(h)
    out = keras.layers.Dense(1, name="d2", kernel_initializer="ones")(h)
    return keras.Model(inputs, out)


def test_local_norm_logger_in_fit_logs():
    """fit's logs show the norm of dL/dh, computed independently with a tape."""
    model = _fit_model()
    x = np.arange(12.0, dtype="float32").reshape(4, 3) / 10.0
    y = np.ones((4, 1), "float32")
    with tf.GradientTape() as tape:
        h = model.get_layer("d1")(x)
        tape.watch(h)
        loss = keras.losses.mean_squared_error(y, model.get_layer("d2")(h))
        loss = tf.reduce_mean(loss)
    want = float(tf.norm(tape.gradient(loss, h)))
    model.compile(optimizer=keras.optimizers.SGD(0.0), loss="mse")
    seen = []
    spy = keras.callbacks.LambdaCallback(
        on_train_batch_end=lambda b, logs: seen.append(logs["local_grad_norm/mirror"])
    )
    history = model.fit(
        x, y, batch_size=4, epochs=2, verbose=0,
        callbacks=[keras_comm.callbacks.LocalNormLogger(), spy],
    )
    np.testing.assert_allclose(seen, [want, want], rtol=1e-5)
    np.testing.assert_allclose(history.history["local_grad_norm/mirror"], [want, want], rtol=1e-5)


def test_dump_local_norm_layers_config_and_weights(tmp_path):
    for cls, kwargs in (
        (layers.MirrorOperator, {}),
        (layers.MirrorMicroStepOperator, {}),
        (layers.MicroStepAllGather, {}),
    ):
        layer = cls(dump_local_norm=True, **kwargs)
        config = layer.get_config()
        assert config["dump_local_norm"] is True
        assert cls.from_config(config).get_config() == config
        config.pop("dump_local_norm")  # saved before the argument existed
        assert cls.from_config(config).dump_local_norm is False
        layer.build((2, 3))
        assert "local_norm" in [w.name for w in layer.non_trainable_weights]
    model = _fit_model()
    model.compile(optimizer="sgd", loss="mse")
    model.fit(np.ones((4, 3)), np.ones((4, 1)), verbose=0)
    path = tmp_path / "m.keras"
    model.save(path)
    loaded = keras.models.load_model(path)
    np.testing.assert_array_equal(
        loaded.get_layer("mirror").local_norm.numpy(), model.get_layer("mirror").local_norm.numpy()
    )
    assert layers.MirrorOperator().weights == []  # no weight unless asked


@pytest.mark.parametrize(
    "make, error, text",
    [
        (lambda: layers.MirrorOperator(dump_local_norm=1), TypeError, "dump_local_norm=1"),
        (
            lambda: layers.MicroStepAllGather(with_mirror_operator=True, dump_local_norm=True),
            ValueError,
            "with_mirror_operator=True, dump_local_norm=True",
        ),
    ],
)
def test_dump_local_norm_validated(make, error, text):
    with pytest.raises(error, match="Received") as info:
        make()
    assert text in str(info.value)
