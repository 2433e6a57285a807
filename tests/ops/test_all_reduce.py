"""AllReduce: ops tier (dense, fused, sparse) and layer tier."""

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

_REDUCE = {
    "sum": lambda xs: tf.add_n(xs),
    "prod": lambda xs: tf.reduce_prod(tf.stack(xs), 0),
    "max": lambda xs: tf.reduce_max(tf.stack(xs), 0),
    "min": lambda xs: tf.reduce_min(tf.stack(xs), 0),
}


def _distinct(r, n):
    # Distinct across ranks (no ties), mixed signs, no zeros.
    return (np.arange(1, 7, dtype=np.float64).reshape(2, 3) * (r + 1) * 0.37) - 0.5 * r


def _reference(op, group=None):
    def fn(xs):
        members = list(range(len(xs))) if group is None else sorted(group)
        y = _REDUCE[op]([xs[i] for i in members])
        return [y if r in members else xs[r] for r in range(len(xs))]

    return fn


# ---------------------------------------------------------------------------
# Ops tier, in-process replicas.
# ---------------------------------------------------------------------------


@pytest.mark.inprocess
def test_forward_closed_form(strategy, mode):
    n = strategy.num_replicas_in_sync

    def fn():
        x = tf.fill([3], tf.cast(keras_comm.rank() + 1, tf.float64))
        return [kc_ops.all_reduce(x, op) for op in ("sum", "prod", "max", "min")]

    for s, p, mx, mn in run_replicas(strategy, fn, mode=mode):
        np.testing.assert_array_equal(s, n * (n + 1) / 2)
        np.testing.assert_array_equal(p, math.factorial(n))
        np.testing.assert_array_equal(mx, n)
        np.testing.assert_array_equal(mn, 1)


@pytest.mark.inprocess
@pytest.mark.parametrize("op", ["sum", "prod", "max", "min"])
def test_gradient(strategy, mode, op):
    _gradcheck.check(strategy, lambda x: kc_ops.all_reduce(x, op), _reference(op), _distinct, mode=mode)


@pytest.mark.inprocess
@pytest.mark.parametrize("zero_ranks", [[0], [0, 1]], ids=["one_zero", "two_zeros"])
def test_prod_gradient_with_zeros(strategy, mode, zero_ranks):
    def make(r, n):
        x = _distinct(r, n)
        if r in zero_ranks:
            x[0, 1] = 0.0  # same element on the zero ranks
            x[1, r] = 0.0  # and one element only this rank zeroes
        return x

    got = _gradcheck.check(strategy, lambda x: kc_ops.all_reduce(x, "prod"), _reference("prod"), make, mode=mode)
    for _, g in got:
        assert np.all(np.isfinite(g))
    if len(zero_ranks) == 1:
        # With one zero, the zero rank's gradient there is the (nonzero)
        # product of the others; every other rank gets 0.
        assert got[0][1][0, 1] != 0.0
        assert all(g[0, 1] == 0.0 for _, g in got[1:])
    else:
        assert all(g[0, 1] == 0.0 for _, g in got)


@pytest.mark.inprocess
@pytest.mark.parametrize("op", ["max", "min"])
def test_ties_every_tied_rank_gets_full_gradient(strategy, mode, op):
    """Convention (the reference's): no splitting among tied ranks."""
    n = strategy.num_replicas_in_sync

    def make(r, n):
        x = _distinct(r, n) * (1 if op == "max" else -1)
        x[0, 0] = 100.0 if op == "max" else -100.0  # tie on every rank
        return x

    got = _gradcheck.distributed(strategy, lambda x: kc_ops.all_reduce(x, op), make, mode=mode)
    total_w = sum(_gradcheck.loss_weights(r, [2, 3]).numpy() for r in range(n))
    for r, (y, g) in enumerate(got):
        assert y[0, 0] == make(0, n)[0, 0]
        np.testing.assert_allclose(g[0, 0], total_w[0, 0], rtol=1e-12)
        # No tie elsewhere: only the winning rank (the last one: inputs grow
        # with the rank, negated for min) gets the gradient.
        expect = total_w[1, 2] if r == n - 1 else 0.0
        np.testing.assert_allclose(g[1, 2], expect, rtol=1e-12)


@pytest.mark.inprocess
@pytest.mark.parametrize("group", [[0, 2], [1, 3], [1]], ids=str)
@pytest.mark.parametrize("op", ["sum", "prod", "max"])
def test_subgroups_and_pass_through(mode, group, op):
    strategy = make_strategy(4)
    got = _gradcheck.check(
        strategy,
        lambda x: kc_ops.all_reduce(x, op, group=group),
        _reference(op, group),
        _distinct,
        mode=mode,
    )
    for r in range(4):
        if r not in group:
            np.testing.assert_array_equal(got[r][0], _distinct(r, 4))
            np.testing.assert_allclose(got[r][1], _gradcheck.loss_weights(r, [2, 3]).numpy())


@pytest.mark.inprocess
def test_gradient_check_detects_identity_backward():
    """The gradient tests above cannot pass with a local (identity) backward."""
    want = _gradcheck.reference(2, _reference("sum"), _distinct)
    local = _gradcheck.loss_weights(0, [2, 3]).numpy()
    assert not np.allclose(want[0][1], local)


@pytest.mark.inprocess
@pytest.mark.parametrize(
    "dtype, rtol", [("float32", 1e-6), ("float16", 1e-2), ("bfloat16", 2e-2)]
)
def test_float_dtypes(dtype, rtol):
    strategy = make_strategy(2)
    dt = tf.as_dtype(dtype)

    def fn():
        x = tf.cast(tf.range(1, 4), dt) * tf.cast(keras_comm.rank() + 1, dt)
        with tf.GradientTape() as tape:
            tape.watch(x)
            y = kc_ops.all_reduce(x, "sum")
            loss = tf.reduce_sum(y * tf.cast(keras_comm.rank() + 1, dt))
        return tf.cast(y, tf.float64), tf.cast(tape.gradient(loss, x), tf.float64)

    for y, g in run_replicas(strategy, fn):
        np.testing.assert_allclose(y, [3, 6, 9], rtol=rtol)
        np.testing.assert_allclose(g, [3, 3, 3], rtol=rtol)


@pytest.mark.inprocess
@pytest.mark.parametrize("dtype", ["int32", "int64"])
def test_int_forward(mode, dtype):
    strategy = make_strategy(4)

    def fn():
        x = tf.cast(tf.range(3) + keras_comm.rank(), dtype)
        return [kc_ops.all_reduce(x, op) for op in ("sum", "max", "min", "prod")]

    for s, mx, mn, p in run_replicas(strategy, fn, mode=mode):
        np.testing.assert_array_equal(s, [6, 10, 14])
        np.testing.assert_array_equal(mx, [3, 4, 5])
        np.testing.assert_array_equal(mn, [0, 1, 2])
        np.testing.assert_array_equal(p, [0, 24, 120])


# ---------------------------------------------------------------------------
# Fusion: a nest in one transfer per dtype.
# ---------------------------------------------------------------------------


def _count_ops(fn, op_type):
    graph = tf.function(fn).get_concrete_function().graph
    return sum(1 for op in graph.get_operations() if op.type == op_type)


@pytest.mark.inprocess
@pytest.mark.parametrize("op", ["sum", "prod", "max"])
def test_fused_nest_matches_separate(strategy, mode, op):
    n = strategy.num_replicas_in_sync
    shapes = [(2, 3), (4,), (1, 2, 2)]

    def make(r, n):
        flat = _distinct(r, n).ravel()
        return np.concatenate([flat, flat[:4] * 1.3 + 0.1, flat[:4] * -0.7])

    def split(x):
        a, b, c = tf.split(x, [6, 4, 4])
        return {"a": tf.reshape(a, shapes[0]), "bc": [b, tf.reshape(c, shapes[2])]}

    def op_fn(x):
        y = kc_ops.all_reduce(split(x), op)
        return tf.concat([tf.reshape(y["a"], [-1]), y["bc"][0], tf.reshape(y["bc"][1], [-1])], 0)

    _gradcheck.check(strategy, op_fn, _reference(op), make, mode=mode)
    del n


@pytest.mark.inprocess
def test_fused_nest_is_one_collective_per_dtype_each_way():
    strategy = make_strategy(2)

    def step():
        xs = [tf.ones([3], tf.float32), tf.ones([2, 2], tf.float32), tf.ones([5], tf.float64)]
        with tf.GradientTape() as tape:
            tape.watch(xs)
            ys = kc_ops.all_reduce(xs)
            loss = tf.add_n([tf.cast(tf.reduce_sum(y), tf.float64) for y in ys])
        return tape.gradient(loss, xs)

    count = _count_ops(lambda: strategy.run(step), "CollectiveReduceV2")
    # 2 dtypes x (forward + backward) x 2 replicas.
    assert count == 2 * 2 * 2


@pytest.mark.inprocess
@pytest.mark.parametrize("op", ["sum", "max"])
def test_gradient_through_tf_cond(strategy, op):
    # The collective sits in a tf.cond branch; its gradient is built in the
    # cond's gradient graph (the ordering token must be captured through the
    # enclosing function, not as an eager tensor).
    def op_fn(x):
        return tf.cond(tf.reduce_sum(x) > -1e9, lambda: kc_ops.all_reduce(x, op), lambda: x)

    _gradcheck.check(strategy, op_fn, _reference(op), _distinct, mode="function")


# ---------------------------------------------------------------------------
# Sparse.
# ---------------------------------------------------------------------------


@pytest.mark.inprocess
def test_indexed_slices_with_different_row_counts(strategy, mode):
    n = strategy.num_replicas_in_sync

    def fn():
        r = keras_comm.rank()
        rows = r + 1  # rank r holds r+1 rows: counts differ
        indices = tf.range(rows, dtype=tf.int64) % 3
        values = tf.cast(tf.reshape(tf.range(rows * 2), [rows, 2]) + 10 * r, tf.float32)
        s = tf.IndexedSlices(values, indices, tf.constant([3, 2], tf.int64))
        out = kc_ops.all_reduce(s)
        return tf.convert_to_tensor(out), tf.shape(out.indices)[0]

    want = np.zeros([3, 2])
    for r in range(n):
        vals = np.arange((r + 1) * 2).reshape(r + 1, 2) + 10 * r
        for i in range(r + 1):
            want[i % 3] += vals[i]
    for dense, count in run_replicas(strategy, fn, mode=mode):
        np.testing.assert_allclose(dense, want)
        assert count == n * (n + 1) // 2


@pytest.mark.inprocess
def test_sparse_upstream_gradient_stays_sparse(strategy, mode):
    n = strategy.num_replicas_in_sync

    def fn():
        r = keras_comm.rank()
        x = tf.ones([5, 2], tf.float64) * tf.cast(r + 1, tf.float64)
        with tf.GradientTape() as tape:
            tape.watch(x)
            y = kc_ops.all_reduce(x)
            loss = tf.reduce_sum(tf.gather(y, [r % 5, 4]) * tf.cast(r + 1, tf.float64))
        g = tape.gradient(loss, x)
        return tf.constant(isinstance(g, tf.IndexedSlices)), tf.convert_to_tensor(g)

    want = np.zeros([5, 2])
    for r in range(n):
        want[r % 5] += r + 1
        want[4] += r + 1
    for sparse, g in run_replicas(strategy, fn, mode=mode):
        assert sparse
        np.testing.assert_allclose(g, want)


# ---------------------------------------------------------------------------
# Errors, timeouts, one-rank case.
# ---------------------------------------------------------------------------


def test_outside_strategy_is_identity():
    x = tf.constant([1.0, 2.0])
    for op in ("sum", "prod", "max", "min"):
        np.testing.assert_array_equal(kc_ops.all_reduce(x, op), x)
    with tf.GradientTape() as tape:
        tape.watch(x)
        y = kc_ops.all_reduce(x)
    np.testing.assert_array_equal(tape.gradient(y, x), [1.0, 1.0])
    nest = kc_ops.all_reduce({"a": x, "b": [tf.ones([2], tf.int32)]})
    np.testing.assert_array_equal(nest["b"][0], [1, 1])


@pytest.mark.parametrize(
    "kwargs, error, text",
    [
        ({"op": "mean"}, ValueError, "Received: op='mean'"),
        ({"op": 3}, TypeError, "Received: op=3"),
        ({"group": [0, 0]}, ValueError, "repeated"),
        ({"group": [1]}, ValueError, "outside the world of 1"),
    ],
)
def test_bad_arguments(kwargs, error, text):
    with pytest.raises(error) as info:
        kc_ops.all_reduce(tf.ones([2]), **kwargs)
    assert text in str(info.value)


def test_bad_dtype_and_sparse_op():
    with pytest.raises(TypeError, match="Received: x.dtype=bool"):
        kc_ops.all_reduce(tf.constant([True]))
    s = tf.IndexedSlices(tf.ones([1, 2]), tf.constant([0]), tf.constant([3, 2]))
    with pytest.raises(ValueError, match="op='sum'. Received: op='max'"):
        kc_ops.all_reduce(s, "max")


@pytest.mark.inprocess
def test_group_outside_world_in_strategy():
    strategy = make_strategy(2)
    with pytest.raises(ValueError, match=r"ranks \[2\] outside the world of 2"):
        run_replicas(strategy, lambda: kc_ops.all_reduce(tf.ones([1]), group=[0, 2]))


def _timeouts_in_graph(strategy, fn):
    graph = tf.function(lambda: strategy.run(fn)).get_concrete_function().graph
    return [
        op.get_attr("timeout_seconds")
        for op in graph.get_operations()
        if op.type.startswith("Collective")
    ]


@pytest.mark.inprocess
def test_timeout_reaches_collectives():
    strategy = make_strategy(2)
    layer = kc_layers.AllReduce(timeout=7.5)

    def step():
        x = tf.ones([2])
        with tf.GradientTape() as tape:
            tape.watch(x)
            y = layer(x)
        return tape.gradient(y, x)

    timeouts = _timeouts_in_graph(strategy, step)
    assert timeouts and set(timeouts) == {7.5}
    default = _timeouts_in_graph(strategy, lambda: kc_ops.all_reduce(tf.ones([2])))
    assert set(default) == {keras_comm.get_timeout()}


@pytest.mark.inprocess
def test_op_names_carry_layer_name():
    strategy = make_strategy(2)
    layer = kc_layers.AllReduce(name="my_reduce")
    graph = tf.function(lambda: strategy.run(lambda: layer(tf.ones([2])))).get_concrete_function().graph
    names = [op.name for op in graph.get_operations() if op.type == "CollectiveReduceV2"]
    assert names and all("my_reduce" in name for name in names)


# ---------------------------------------------------------------------------
# Layer tier.
# ---------------------------------------------------------------------------


def test_layer_config_round_trip():
    layer = kc_layers.AllReduce("MAX", group=[2, 0], fusion=3, timeout=12, name="ar")
    cfg = layer.get_config()
    assert cfg["op"] == "max" and cfg["group"] == [0, 2] and cfg["fusion"] == 3
    assert cfg["timeout"] == 12.0
    clone = kc_layers.AllReduce.from_config(cfg)
    assert clone.op is kc_ops.ReduceOp.MAX and clone.group == keras_comm.Group([0, 2])


@pytest.mark.parametrize(
    "kwargs, error, text",
    [
        ({"op": "avg"}, ValueError, "Received: op='avg'"),
        ({"fusion": -1}, ValueError, "Received: fusion=-1"),
        ({"fusion": 1.5}, TypeError, "Received: fusion=1.5"),
        ({"timeout": 0}, ValueError, "Received: timeout=0"),
        ({"group": []}, ValueError, "Received: group=[]"),
        ({"group": [1, 1]}, ValueError, "Received: group=[1, 1]"),
    ],
)
def test_layer_bad_arguments(kwargs, error, text):
    with pytest.raises(error) as info:
        kc_layers.AllReduce(**kwargs)
    assert text in str(info.value)


def test_layer_in_models_and_save_load(tmp_path):
    seq = keras.Sequential([keras.Input((3,)), keras.layers.Dense(4), kc_layers.AllReduce("sum")])
    inp = keras.Input((3,))
    out = kc_layers.AllReduce("max", fusion=1)(keras.layers.Dense(2)(inp))
    func = keras.Model(inp, out)
    x = np.arange(6, dtype="float32").reshape(2, 3)
    for model in (seq, func):
        path = tmp_path / f"{model.name}.keras"
        model.save(path)
        loaded = keras.models.load_model(path)
        np.testing.assert_allclose(loaded.predict(x, verbose=0), model.predict(x, verbose=0))
    assert isinstance(loaded.layers[-1], kc_layers.AllReduce)
    assert loaded.layers[-1].fusion == 1


def test_layer_list_input_and_mixed_precision():
    inp = [keras.Input((3,)), keras.Input((2,))]
    out = kc_layers.AllReduce()(inp)
    assert [tuple(o.shape) for o in out] == [(None, 3), (None, 2)]
    layer = kc_layers.AllReduce(dtype="mixed_float16")
    y = layer(tf.ones([2, 3]))
    assert y.dtype == tf.float16


@pytest.mark.inprocess
def test_layer_training_step_under_strategy(mode):
    """Data-parallel dense layer whose output is all-reduced: weights agree."""
    strategy = make_strategy(2)
    with strategy.scope():
        dense = keras.layers.Dense(2, kernel_initializer="ones", use_bias=False)
        dense.build((None, 3))
        reduce = kc_layers.AllReduce("sum")

    def step():
        r = tf.cast(keras_comm.rank() + 1, tf.float32)
        x = tf.ones([1, 3]) * r
        with tf.GradientTape() as tape:
            y = reduce(dense(x))
            loss = tf.reduce_sum(y) * r
        return tape.gradient(loss, dense.kernel)

    grads = run_replicas(strategy, step, mode=mode)
    # L = sum_r r' * sum(W^T (x_1 + x_2)) with r' = r+1: dL/dx_r per replica
    # objective; replica r's grad = (sum_s s') * x_r = 3 * r' * ones.
    for r, g in enumerate(grads):
        np.testing.assert_allclose(g, np.full([3, 2], 3.0 * (r + 1)))
