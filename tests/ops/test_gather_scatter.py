"""AllGather, ReduceScatter, CollectiveGather, CollectiveScatter: ops and layers."""

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
    # 4 rows: divisible by groups of 1, 2 and 4.
    return np.arange(12, dtype=np.float64).reshape(4, 3) * (r + 1) * 0.25 - r


def _members(xs, group):
    return list(range(len(xs))) if group is None else sorted(group)


def ref_all_gather(group=None):
    def fn(xs):
        m = _members(xs, group)
        y = tf.concat([xs[i] for i in m], 0)
        return [y if r in m else xs[r] for r in range(len(xs))]

    return fn


def ref_reduce_scatter(group=None):
    def fn(xs):
        m = _members(xs, group)
        parts = tf.split(tf.add_n([xs[i] for i in m]), len(m), 0)
        return [parts[m.index(r)] if r in m else xs[r] for r in range(len(xs))]

    return fn


def ref_collective_gather(dest, group=None):
    def fn(xs):
        m = _members(xs, group)
        y = tf.concat([xs[i] for i in m], 0)
        return [
            (y if r == dest else tf.zeros_like(y)) if r in m else xs[r] for r in range(len(xs))
        ]

    return fn


def ref_collective_scatter(src, group=None):
    def fn(xs):
        m = _members(xs, group)
        parts = tf.split(xs[src], len(m), 0)
        return [parts[m.index(r)] if r in m else xs[r] for r in range(len(xs))]

    return fn


CASES = {
    "all_gather": (lambda x: kc_ops.all_gather(x), ref_all_gather()),
    "reduce_scatter": (lambda x: kc_ops.reduce_scatter(x), ref_reduce_scatter()),
    "collective_gather_0": (lambda x: kc_ops.collective_gather(x, 0), ref_collective_gather(0)),
    "collective_gather_1": (lambda x: kc_ops.collective_gather(x, dest=1), ref_collective_gather(1)),
    "collective_scatter_0": (lambda x: kc_ops.collective_scatter(x, 0), ref_collective_scatter(0)),
    "collective_scatter_1": (lambda x: kc_ops.collective_scatter(x, src=1), ref_collective_scatter(1)),
}


@pytest.mark.inprocess
@pytest.mark.parametrize("case", sorted(CASES))
def test_against_simulation(strategy, mode, case):
    op_fn, ref_fn = CASES[case]
    _gradcheck.check(strategy, op_fn, ref_fn, _input, mode=mode)


@pytest.mark.inprocess
@pytest.mark.parametrize("group", [[0, 2], [1, 3], [1]], ids=str)
def test_subgroups(mode, group):
    strategy = make_strategy(4)
    root = group[-1]
    cases = [
        (lambda x: kc_ops.all_gather(x, group=group), ref_all_gather(group)),
        (lambda x: kc_ops.reduce_scatter(x, group=group), ref_reduce_scatter(group)),
        (lambda x: kc_ops.collective_gather(x, root, group), ref_collective_gather(root, group)),
        (lambda x: kc_ops.collective_scatter(x, root, group), ref_collective_scatter(root, group)),
    ]
    for op_fn, ref_fn in cases:
        got = _gradcheck.check(strategy, op_fn, ref_fn, _input, mode=mode)
        for r in set(range(4)) - set(group):  # non-members pass through
            np.testing.assert_array_equal(got[r][0], _input(r, 4))


@pytest.mark.inprocess
def test_closed_form(strategy, mode):
    n = strategy.num_replicas_in_sync

    def fn():
        r = keras_comm.rank()
        x = tf.fill([n, 2], tf.cast(r + 1, tf.float32))
        return (
            kc_ops.all_gather(x[:1]),
            kc_ops.reduce_scatter(x),
            kc_ops.collective_gather(x[:1], dest=n - 1),
            kc_ops.collective_scatter(x * tf.range(1.0, n + 1.0)[:, None], src=0),
        )

    for r, (ag, rs, cg, cs) in enumerate(run_replicas(strategy, fn, mode=mode)):
        np.testing.assert_array_equal(ag[:, 0], np.arange(1, n + 1))
        np.testing.assert_array_equal(rs, np.full([1, 2], n * (n + 1) / 2))
        want_cg = np.arange(1, n + 1) if r == n - 1 else np.zeros(n)
        np.testing.assert_array_equal(cg[:, 0], want_cg)
        np.testing.assert_array_equal(cs, np.full([1, 2], r + 1.0))  # rank 0's row r


@pytest.mark.inprocess
@pytest.mark.parametrize("n", [2, 3, 4])
def test_all_gather_mean_flag_scales_gradient(mode, n):
    # 3 replicas: 1/3 is not a float32 number, so a scale that passed
    # through float32 would show here.
    strategy = make_strategy(n)
    got = _gradcheck.distributed(strategy, lambda x: kc_ops.all_gather(x, mean=True), _input, mode=mode)
    want = _gradcheck.reference(n, ref_all_gather(), _input)
    for (y, g), (y_ref, g_ref) in zip(got, want):
        np.testing.assert_allclose(y, y_ref, rtol=1e-12)
        np.testing.assert_allclose(g, g_ref / n, rtol=1e-9)


@pytest.mark.inprocess
@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16", "int32", "int64"])
def test_dtypes_forward(dtype):
    strategy = make_strategy(2)

    def fn():
        x = tf.cast(tf.fill([2, 2], keras_comm.rank() + 1), dtype)
        outs = (
            kc_ops.all_gather(x),
            kc_ops.reduce_scatter(x),
            kc_ops.collective_gather(x),
            kc_ops.collective_scatter(x, src=1),
        )
        return [tf.cast(o, tf.float64) for o in outs]

    for r, (ag, rs, cg, cs) in enumerate(run_replicas(strategy, fn)):
        np.testing.assert_array_equal(ag[:, 0], [1, 1, 2, 2])
        np.testing.assert_array_equal(rs, [[3, 3]])
        np.testing.assert_array_equal(cg[:, 0], [1, 1, 2, 2] if r == 0 else [0] * 4)
        np.testing.assert_array_equal(cs, [[2, 2]])


def test_outside_strategy_is_one_rank_case():
    x = tf.reshape(tf.range(6.0), [3, 2])
    for fn in (kc_ops.all_gather, kc_ops.reduce_scatter, kc_ops.collective_gather, kc_ops.collective_scatter):
        np.testing.assert_array_equal(fn(x), x)


@pytest.mark.parametrize(
    "call, error, text",
    [
        (lambda: kc_ops.reduce_scatter(tf.ones([2]), op="max"), ValueError, "Received: op='max'"),
        (lambda: kc_ops.all_gather(tf.ones([])), ValueError, "Received: x.shape=()"),
        (lambda: kc_ops.collective_gather(tf.ones([2]), dest=1), ValueError, "Received: dest=1"),
        (lambda: kc_ops.collective_scatter(tf.ones([2]), src=-1), ValueError, "Received: src=-1"),
        (lambda: kc_ops.collective_scatter(tf.ones([2]), src="0"), TypeError, "Received: src='0'"),
        (lambda: kc_ops.all_gather(tf.constant([True])), TypeError, "x.dtype=bool"),
    ],
)
def test_bad_arguments(call, error, text):
    with pytest.raises(error) as info:
        call()
    assert text in str(info.value)


@pytest.mark.inprocess
def test_indivisible_axis_names_layer_and_shape():
    strategy = make_strategy(4)
    layer = kc_layers.ReduceScatter(name="my_rs")
    with pytest.raises(ValueError) as info:
        run_replicas(strategy, lambda: layer(tf.ones([6, 2])))
    msg = str(info.value)
    assert "my_rs" in msg and "divisible by the group size 4" in msg and "(6, 2)" in msg
    with pytest.raises(ValueError, match="divisible by the group size 2"):
        run_replicas(strategy, lambda: kc_ops.collective_scatter(tf.ones([3]), 1, group=[1, 2]))


@pytest.mark.inprocess
def test_timeout_reaches_collectives():
    strategy = make_strategy(2)
    layers = [
        kc_layers.AllGather(timeout=4.0),
        kc_layers.ReduceScatter(timeout=4.0),
        kc_layers.CollectiveGather(timeout=4.0),
        kc_layers.CollectiveScatter(timeout=4.0),
    ]

    def step():
        x = tf.ones([2, 2])
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
    assert timeouts == {4.0}


# ---------------------------------------------------------------------------
# Layers.
# ---------------------------------------------------------------------------

LAYERS = [
    (kc_layers.AllGather, {"mean": True, "group": [0, 1], "timeout": 9.0}),
    (kc_layers.ReduceScatter, {"op": "sum", "group": None, "timeout": None}),
    (kc_layers.CollectiveGather, {"dest": 1, "group": [1, 0], "timeout": None}),
    (kc_layers.CollectiveScatter, {"src": 2, "group": None, "timeout": 3}),
]


@pytest.mark.parametrize("cls, kwargs", LAYERS, ids=lambda v: getattr(v, "__name__", ""))
def test_layer_config_round_trip(cls, kwargs):
    layer = cls(**kwargs)
    cfg = layer.get_config()
    clone = cls.from_config(cfg)
    assert clone.get_config() == cfg
    for key in kwargs:
        assert key in cfg


@pytest.mark.parametrize(
    "make, error, text",
    [
        (lambda: kc_layers.ReduceScatter(op="max"), ValueError, "Received: op='max'"),
        (lambda: kc_layers.AllGather(mean_flag=1), TypeError, "Received: mean_flag=1"),
        (lambda: kc_layers.CollectiveGather(dest=2, group=[0, 1]), ValueError, "Received: dest=2"),
        (lambda: kc_layers.CollectiveScatter(src=-1), ValueError, "Received: src=-1"),
        (lambda: kc_layers.CollectiveScatter(src=None), TypeError, "Received: src=None"),
        (lambda: kc_layers.AllGather(group=[0, 0]), ValueError, "Received: group=[0, 0]"),
        (lambda: kc_layers.AllGather(timeout=-1), ValueError, "Received: timeout=-1"),
    ],
)
def test_layer_bad_arguments(make, error, text):
    with pytest.raises(error) as info:
        make()
    assert text in str(info.value)


def test_layers_in_models_and_save_load(tmp_path):
    x = np.arange(8, dtype="float32").reshape(4, 2)
    for cls in (kc_layers.AllGather, kc_layers.ReduceScatter, kc_layers.CollectiveGather, kc_layers.CollectiveScatter):
        seq = keras.Sequential([keras.Input((2,)), keras.layers.Dense(3), cls()])
        inp = keras.Input((2,))
        func = keras.Model(inp, cls()(keras.layers.Dense(3)(inp)))
        for model in (seq, func):
            assert tuple(model.layers[-1].output.shape) == (None, 3)
            path = tmp_path / f"{cls.__name__}_{model.name}.keras"
            model.save(path)
            loaded = keras.models.load_model(path)
            assert isinstance(loaded.layers[-1], cls)
            np.testing.assert_allclose(loaded.predict(x, verbose=0), model.predict(x, verbose=0))


@pytest.mark.inprocess
def test_sharded_training_step(mode):
    """ReduceScatter then AllGather: the gradient of a replicated computation."""
    strategy = make_strategy(2)
    rs, ag = kc_layers.ReduceScatter(), kc_layers.AllGather()

    def step():
        r = tf.cast(keras_comm.rank() + 1, tf.float32)
        x = tf.ones([4, 1]) * r
        with tf.GradientTape() as tape:
            tape.watch(x)
            y = ag(rs(x))  # = sum of x over replicas, on every replica
            loss = tf.reduce_sum(y) * r
        return y, tape.gradient(loss, x)

    for y, g in run_replicas(strategy, step, mode=mode):
        np.testing.assert_array_equal(y, np.full([4, 1], 3.0))
        np.testing.assert_array_equal(g, np.full([4, 1], 3.0))  # sum of loss weights
