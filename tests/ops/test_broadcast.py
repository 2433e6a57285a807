"""Broadcast (exact and identity gradients) and Reduce: ops and layers."""

import math

import keras
import numpy as np
import pytest
import tensorflow as tf

import keras_comm
from keras_comm import layers as kc_layers
from keras_comm import ops as kc_ops
from conftest import make_strategy
from conftest import run_replicas
import _gradcheck


def _input(r, n):
    return np.arange(6, dtype=np.float64).reshape(2, 3) * (r + 1) * 0.5 - r


def _members(xs, group):
    return list(range(len(xs))) if group is None else sorted(group)


def ref_broadcast(root, group=None):
    def fn(xs):
        m = _members(xs, group)
        return [xs[root] if r in m else xs[r] for r in range(len(xs))]

    return fn


def _tie_convention(reduce_fn):
    """`reduce_fn` over a list, with keras_comm's gradient convention on ties.

    TF's own reduce_max/min gradient splits dy among tied entries; keras_comm
    (as MindSpore) gives each tied member all of it: ``dx_r = dy * (x_r == y)``.
    """

    def fn(xs):
        y = tf.stop_gradient(reduce_fn(tf.stack(xs), 0))
        return y + tf.add_n([tf.cast(tf.equal(x, y), x.dtype) * (x - tf.stop_gradient(x)) for x in xs])

    return fn


_REDUCE = {
    "sum": lambda xs: tf.add_n(xs),
    "prod": lambda xs: tf.reduce_prod(tf.stack(xs), 0),
    "max": _tie_convention(tf.reduce_max),
    "min": _tie_convention(tf.reduce_min),
}
# TF's own gradients, for inputs without ties (an independent check of MAX/MIN).
_REDUCE_UNTIED = dict(
    _REDUCE,
    max=lambda xs: tf.reduce_max(tf.stack(xs), 0),
    min=lambda xs: tf.reduce_min(tf.stack(xs), 0),
)


def ref_reduce(dest, group=None, op="sum", table=_REDUCE):
    def fn(xs):
        m = _members(xs, group)
        total = table[op]([xs[i] for i in m])
        return [
            (total if r == dest else tf.zeros_like(total)) if r in m else xs[r]
            for r in range(len(xs))
        ]

    return fn


def _distinct(r, n):
    # Distinct across ranks (no ties), mixed signs, no zeros.
    return (np.arange(1, 7, dtype=np.float64).reshape(2, 3) * (r + 1) * 0.37) - 0.5 * r


@pytest.mark.inprocess
@pytest.mark.parametrize("root", [0, 1])
def test_broadcast_exact(strategy, mode, root):
    got = _gradcheck.check(strategy, lambda x: kc_ops.broadcast(x, root), ref_broadcast(root), _input, mode=mode)
    for r, (_, g) in enumerate(got):
        if r != root:
            np.testing.assert_array_equal(g, 0.0)


@pytest.mark.inprocess
def test_broadcast_identity_gradient(strategy, mode):
    """The reference's convention: dy passes through (not the adjoint)."""
    n = strategy.num_replicas_in_sync
    got = _gradcheck.distributed(
        strategy, lambda x: kc_ops.broadcast(x, 1, gradient="identity"), _input, mode=mode
    )
    for r, (y, g) in enumerate(got):
        np.testing.assert_array_equal(y, _input(1, n))
        np.testing.assert_allclose(g, _gradcheck.loss_weights(r, [2, 3]).numpy(), rtol=1e-12)
    exact = _gradcheck.reference(n, ref_broadcast(1), _input)
    assert not np.allclose(exact[1][1], got[1][1])


@pytest.mark.inprocess
@pytest.mark.parametrize("dest", [0, 1])
def test_reduce(strategy, mode, dest):
    _gradcheck.check(strategy, lambda x: kc_ops.reduce(x, dest), ref_reduce(dest), _input, mode=mode)


@pytest.mark.inprocess
@pytest.mark.parametrize("op", ["sum", "prod", "max", "min"])
def test_reduce_op_forward_closed_form(strategy, mode, op):
    n = strategy.num_replicas_in_sync
    want = {"sum": n * (n + 1) / 2, "prod": math.factorial(n), "max": n, "min": 1}[op]

    def fn():
        return kc_ops.reduce(tf.fill([3], tf.cast(keras_comm.rank() + 1, tf.float64)), n - 1, op=op)

    for r, y in enumerate(run_replicas(strategy, fn, mode=mode)):
        np.testing.assert_array_equal(y, [want] * 3 if r == n - 1 else [0, 0, 0])


@pytest.mark.inprocess
@pytest.mark.parametrize("dest", [0, 1])
@pytest.mark.parametrize("op", ["sum", "prod", "max", "min"])
def test_reduce_op_gradient(strategy, mode, op, dest):
    """Checked against TF's own reduce_* gradients (no ties here)."""
    _gradcheck.check(
        strategy,
        lambda x: kc_ops.reduce(x, dest, op=op),
        ref_reduce(dest, op=op, table=_REDUCE_UNTIED),
        _distinct,
        mode=mode,
    )


@pytest.mark.inprocess
@pytest.mark.parametrize("op", ["max", "min"])
def test_reduce_ties_every_tied_rank_gets_full_gradient(strategy, mode, op):
    n = strategy.num_replicas_in_sync
    sign = 1 if op == "max" else -1

    def make(r, n):
        x = _distinct(r, n) * sign
        x[0, 0] = 100.0 * sign  # tie on every rank
        x[1, 1] = 100.0 * sign if r in (0, n - 1) else 0.0  # tie on two ranks
        return x

    got = _gradcheck.check(strategy, lambda x: kc_ops.reduce(x, 1, op=op), ref_reduce(1, op=op), make, mode=mode)
    w_dest = _gradcheck.loss_weights(1, [2, 3]).numpy()
    for r, (_, g) in enumerate(got):
        np.testing.assert_allclose(g[0, 0], w_dest[0, 0], rtol=1e-12)
        np.testing.assert_allclose(g[1, 1], w_dest[1, 1] if r in (0, n - 1) else 0.0, rtol=1e-12)


@pytest.mark.inprocess
@pytest.mark.parametrize("zero_ranks", [[0], [0, 1]], ids=["one_zero", "two_zeros"])
def test_reduce_prod_gradient_with_zeros(strategy, mode, zero_ranks):
    def make(r, n):
        x = _distinct(r, n)
        if r in zero_ranks:
            x[0, 1] = 0.0  # same element on the zero ranks
            x[1, r] = 0.0  # and one element only this rank zeroes
        return x

    got = _gradcheck.check(strategy, lambda x: kc_ops.reduce(x, 1, op="prod"), ref_reduce(1, op="prod"), make, mode=mode)
    for _, g in got:
        assert np.all(np.isfinite(g))
    if len(zero_ranks) == 1:
        # One zero: only the zero rank's gradient there is nonzero.
        assert got[0][1][0, 1] != 0.0
        assert all(g[0, 1] == 0.0 for _, g in got[1:])
    else:
        assert all(g[0, 1] == 0.0 for _, g in got)


@pytest.mark.inprocess
def test_closed_form(strategy, mode):
    n = strategy.num_replicas_in_sync

    def fn():
        x = tf.fill([2], tf.cast(keras_comm.rank() + 1, tf.float32))
        return kc_ops.broadcast(x, root=n - 1), kc_ops.reduce(x, dest=n - 1)

    for r, (b, s) in enumerate(run_replicas(strategy, fn, mode=mode)):
        np.testing.assert_array_equal(b, [n, n])
        np.testing.assert_array_equal(s, [n * (n + 1) / 2] * 2 if r == n - 1 else [0, 0])


@pytest.mark.inprocess
@pytest.mark.parametrize("group", [[0, 2], [1, 3], [1]], ids=str)
def test_subgroups(mode, group):
    strategy = make_strategy(4)
    root = group[-1]
    for op_fn, ref_fn in (
        (lambda x: kc_ops.broadcast(x, root, group), ref_broadcast(root, group)),
        (lambda x: kc_ops.reduce(x, root, group), ref_reduce(root, group)),
        (lambda x: kc_ops.reduce(x, root, group, op="prod"), ref_reduce(root, group, "prod")),
        (lambda x: kc_ops.reduce(x, root, group, op="max"), ref_reduce(root, group, "max")),
    ):
        got = _gradcheck.check(strategy, op_fn, ref_fn, _input, mode=mode)
        for r in set(range(4)) - set(group):
            np.testing.assert_array_equal(got[r][0], _input(r, 4))


@pytest.mark.inprocess
@pytest.mark.parametrize("dtype", ["float16", "bfloat16", "float32", "int32", "int64"])
def test_dtypes_forward(dtype):
    strategy = make_strategy(2)

    def fn():
        x = tf.cast(tf.fill([3], keras_comm.rank() + 1), dtype)
        return tf.cast(kc_ops.broadcast(x, 1), tf.float64), tf.cast(kc_ops.reduce(x, 0), tf.float64)

    for r, (b, s) in enumerate(run_replicas(strategy, fn)):
        np.testing.assert_array_equal(b, [2, 2, 2])
        np.testing.assert_array_equal(s, [3, 3, 3] if r == 0 else [0, 0, 0])


@pytest.mark.parametrize(
    "call, error, text",
    [
        (lambda: kc_ops.broadcast(tf.ones([1]), root=1), ValueError, "Received: root=1"),
        (lambda: kc_ops.broadcast(tf.ones([1]), gradient="mean"), ValueError, "Received: gradient='mean'"),
        (lambda: kc_ops.reduce(tf.ones([1]), dest=2), ValueError, "Received: dest=2"),
        (lambda: kc_ops.reduce(tf.ones([1]), dest=0.0), TypeError, "Received: dest=0.0"),
        (lambda: kc_ops.reduce(tf.ones([1]), op="mean"), ValueError, "Received: op='mean'"),
        (lambda: kc_ops.reduce(tf.ones([1]), op=1), TypeError, "Received: op=1"),
    ],
)
def test_bad_arguments(call, error, text):
    with pytest.raises(error) as info:
        call()
    assert text in str(info.value)


@pytest.mark.inprocess
def test_root_outside_group_in_strategy():
    strategy = make_strategy(4)
    with pytest.raises(ValueError, match=r"group \[1, 3\]. Received: root=0"):
        run_replicas(strategy, lambda: kc_ops.broadcast(tf.ones([1]), 0, group=[1, 3]))


@pytest.mark.inprocess
def test_timeout_reaches_collectives():
    strategy = make_strategy(2)
    layers = [kc_layers.Broadcast(timeout=6.0), kc_layers.Reduce(timeout=6.0)]

    def step():
        x = tf.ones([2])
        with tf.GradientTape() as tape:
            tape.watch(x)
            loss = tf.add_n([tf.reduce_sum(layer(x)) for layer in layers])
        return tape.gradient(loss, x)

    graph = tf.function(lambda: strategy.run(step)).get_concrete_function().graph
    timeouts = {
        op.get_attr("timeout_seconds")
        for op in graph.get_operations()
        if op.type.startswith("Collective")
    }
    assert timeouts == {6.0}


def test_layer_config_and_errors():
    layer = kc_layers.Broadcast(root=2, group=[2, 3], gradient="identity", timeout=5)
    cfg = layer.get_config()
    assert (cfg["root"], cfg["group"], cfg["gradient"], cfg["timeout"]) == (2, [2, 3], "identity", 5.0)
    assert kc_layers.Broadcast.from_config(cfg).get_config() == cfg
    cfg = kc_layers.Reduce(dest=1).get_config()
    assert cfg["op"] == "sum"
    assert kc_layers.Reduce.from_config(cfg).get_config() == cfg
    cfg = kc_layers.Reduce(dest=1, op=kc_ops.ReduceOp.MAX).get_config()
    assert cfg["op"] == "max"
    assert kc_layers.Reduce.from_config(cfg).get_config() == cfg
    # A config saved before `op` existed loads as a SUM reduce.
    old = {k: v for k, v in cfg.items() if k != "op"}
    assert kc_layers.Reduce.from_config(old).op is kc_ops.ReduceOp.SUM
    with pytest.raises(ValueError, match=r"Received: op='avg'"):
        kc_layers.Reduce(op="avg")
    with pytest.raises(ValueError, match=r"Received: root=0"):
        kc_layers.Broadcast(root=0, group=[1, 2])
    with pytest.raises(ValueError, match=r"Received: gradient='sum'"):
        kc_layers.Broadcast(gradient="sum")
    with pytest.raises(TypeError, match=r"Received: dest='1'"):
        kc_layers.Reduce(dest="1")


def test_layers_in_models_and_save_load(tmp_path):
    x = np.arange(6, dtype="float32").reshape(3, 2)
    for layer_fn in (
        lambda: kc_layers.Broadcast(gradient="identity"),
        lambda: kc_layers.Reduce(),
        lambda: kc_layers.Reduce(op="prod"),
    ):
        seq = keras.Sequential([keras.Input((2,)), keras.layers.Dense(3), layer_fn()])
        inp = keras.Input((2,))
        func = keras.Model(inp, layer_fn()(keras.layers.Dense(3)(inp)))
        for model in (seq, func):
            path = tmp_path / f"{model.layers[-1].name}.keras"
            model.save(path)
            loaded = keras.models.load_model(path)
            assert loaded.layers[-1].get_config() == model.layers[-1].get_config()
            np.testing.assert_allclose(loaded.predict(x, verbose=0), model.predict(x, verbose=0))


@pytest.mark.inprocess
def test_broadcast_weights_training_step(mode):
    """Exact gradient: root's weight gets the sum of every replica's gradient."""
    strategy = make_strategy(2)
    with strategy.scope():
        dense = keras.layers.Dense(1, kernel_initializer="ones", use_bias=False)
        dense.build((None, 2))
    bcast = kc_layers.Broadcast(root=0)

    def step():
        r = tf.cast(keras_comm.rank() + 1, tf.float32)
        with tf.GradientTape() as tape:
            w = bcast(dense.kernel * r)  # root's value everywhere
            loss = tf.reduce_sum(w) * r
        return w, tape.gradient(loss, dense.kernel)

    (w0, g0), (w1, g1) = run_replicas(strategy, step, mode=mode)
    np.testing.assert_array_equal(w0, w1)
    np.testing.assert_array_equal(g0, np.full([2, 1], 3.0))  # (1 + 2) * r_root
    np.testing.assert_array_equal(g1, np.zeros([2, 1]))


@pytest.mark.inprocess
@pytest.mark.parametrize("mode", ["eager", "function"])
def test_empty_inputs_move_nothing(mode):
    # A broadcast of a [0] tensor between 2 in-process replicas crashed the
    # process (SIGSEGV in TF's CPU collective; found by test_fuzz_replicas).
    strategy = make_strategy(2)
    for shape in ([0], [2, 0]):
        out = run_replicas(
            strategy,
            lambda: (kc_layers.Broadcast(root=1)(tf.zeros(shape)),
                     kc_ops.all_reduce(tf.zeros(shape)), kc_ops.all_gather(tf.zeros(shape))),
            mode=mode,
        )
        for b, r, g in out:
            assert b.shape == r.shape == tuple(shape)
            assert g.shape == (2 * shape[0],) + tuple(shape[1:])
