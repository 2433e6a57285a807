"""AlltoAll: ops and layer."""

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
    return np.arange(4 * 4 * 2, dtype=np.float64).reshape(4, 4, 2) * (r + 1) * 0.1 - r


def ref_all_to_all(split_dim, concat_dim, group=None):
    def fn(xs):
        m = list(range(len(xs))) if group is None else sorted(group)
        parts = {j: tf.split(xs[j], len(m), split_dim) for j in m}
        return [
            tf.concat([parts[j][m.index(r)] for j in m], concat_dim) if r in m else xs[r]
            for r in range(len(xs))
        ]

    return fn


@pytest.mark.inprocess
@pytest.mark.parametrize("split_dim, concat_dim", [(0, 0), (0, 1), (1, 0), (-2, -1), (2, 0)])
def test_against_simulation(strategy, mode, split_dim, concat_dim):
    n = strategy.num_replicas_in_sync
    if split_dim == 2 and n == 4:
        pytest.skip("axis 2 has 2 elements")
    _gradcheck.check(
        strategy,
        lambda x: kc_ops.all_to_all(x, n, split_dim, concat_dim),
        ref_all_to_all(split_dim, concat_dim),
        _input,
        mode=mode,
    )


@pytest.mark.inprocess
@pytest.mark.parametrize("group", [[0, 2], [1, 3], [1]], ids=str)
def test_subgroups(mode, group):
    strategy = make_strategy(4)
    got = _gradcheck.check(
        strategy,
        lambda x: kc_ops.all_to_all(x, len(group), 1, 0, group=group),
        ref_all_to_all(1, 0, group),
        _input,
        mode=mode,
    )
    for r in set(range(4)) - set(group):
        np.testing.assert_array_equal(got[r][0], _input(r, 4))


@pytest.mark.inprocess
def test_closed_form(strategy, mode):
    n = strategy.num_replicas_in_sync

    def fn():
        # Row j of rank r holds 10*r + j: after the exchange, rank i holds
        # row i of every rank, in rank order.
        r = keras_comm.rank()
        x = tf.cast(10 * r + tf.range(n), tf.int32)[:, None]
        return kc_ops.all_to_all(x, n, 0, 1)

    for i, y in enumerate(run_replicas(strategy, fn, mode=mode)):
        np.testing.assert_array_equal(y, [[10 * r + i for r in range(n)]])


@pytest.mark.parametrize(
    "kwargs, error, text",
    [
        ({"split_count": 2}, ValueError, "Received: split_count=2"),
        ({"split_dim": 3}, ValueError, "Received: split_dim=3"),
        ({"concat_dim": -4}, ValueError, "Received: concat_dim=-4"),
        ({"split_dim": 1.0}, TypeError, "Received: split_dim=1.0"),
    ],
)
def test_bad_arguments(kwargs, error, text):
    args = {"split_count": 1, "split_dim": 0, "concat_dim": 0, **kwargs}
    with pytest.raises(error) as info:
        kc_ops.all_to_all(tf.ones([2, 2, 2]), **args)
    assert text in str(info.value)


@pytest.mark.inprocess
def test_indivisible_and_group_size_in_strategy():
    strategy = make_strategy(4)
    with pytest.raises(ValueError, match=r"group size 4.*Received: x.shape=\(6, 4\)"):
        run_replicas(strategy, lambda: kc_layers.AlltoAll(4, 0, 1, name="a2a")(tf.ones([6, 4])))
    with pytest.raises(ValueError, match="must equal the group size 4. Received: split_count=2"):
        run_replicas(strategy, lambda: kc_ops.all_to_all(tf.ones([4]), 2, 0, 0))


@pytest.mark.inprocess
def test_timeout_and_name():
    strategy = make_strategy(2)
    layer = kc_layers.AlltoAll(2, 0, 1, timeout=8.0, name="exchange")

    def step():
        x = tf.ones([2, 2])
        with tf.GradientTape() as tape:
            tape.watch(x)
            loss = tf.reduce_sum(layer(x))
        return tape.gradient(loss, x)

    graph = tf.function(lambda: strategy.run(step)).get_concrete_function().graph
    ops = [op for op in graph.get_operations() if op.type == "CollectiveAllToAllV2"]
    assert len(ops) == 2 * 2  # forward + backward, 2 replicas
    assert {op.get_attr("timeout_seconds") for op in ops} == {8.0}
    assert all("exchange" in op.name for op in ops)


def test_layer_config_shapes_and_errors(tmp_path):
    layer = kc_layers.AlltoAll(2, -1, 0, group=[0, 3], timeout=2)
    cfg = layer.get_config()
    assert (cfg["split_count"], cfg["split_dim"], cfg["concat_dim"], cfg["group"]) == (2, -1, 0, [0, 3])
    assert kc_layers.AlltoAll.from_config(cfg).get_config() == cfg
    assert layer.compute_output_shape((4, 6)) == (8, 3)
    assert layer.compute_output_shape((None, 6)) == (None, 3)
    with pytest.raises(ValueError, match="Received: split_count=3"):
        kc_layers.AlltoAll(3, 0, 0, group=[0, 1])
    with pytest.raises(ValueError, match="Received: split_count=0"):
        kc_layers.AlltoAll(0, 0, 0)
    with pytest.raises(ValueError, match="Received: split_dim=2"):
        kc_layers.AlltoAll(1, 2, 0).compute_output_shape((3, 4))
    # One rank: identity; models save and load.
    inp = keras.Input((4,))
    func = keras.Model(inp, kc_layers.AlltoAll(1, 1, 0)(keras.layers.Dense(4)(inp)))
    seq = keras.Sequential([keras.Input((4,)), kc_layers.AlltoAll(1, 0, 1)])
    x = np.ones([2, 4], "float32")
    for model in (func, seq):
        path = tmp_path / f"{model.name}.keras"
        model.save(path)
        np.testing.assert_allclose(keras.models.load_model(path).predict(x, verbose=0), model.predict(x, verbose=0))


def test_indivisible_static_dim_fails_when_the_model_is_built():
    # Rounded down to 2 before (issue 15 item 6): a model built, failing only when run.
    layer = kc_layers.AlltoAll(2, -1, 0, name="a2a")
    with pytest.raises(ValueError, match=r"'a2a'.*divisible by `split_count` 2.*input_shape=\(4, 5\)"):
        layer.compute_output_shape((4, 5))
    with pytest.raises(ValueError, match=r"divisible by `split_count` 2. Received: input_shape=\(None, 5\)"):
        kc_layers.AlltoAll(2, -1, 0)(keras.Input((5,)))
    # Dims known only at run time are left to the op's own check.
    assert kc_layers.AlltoAll(2, 0, 1).compute_output_shape((None, 4)) == (None, 8)
    # split_dim == concat_dim keeps the shape but must still divide.
    with pytest.raises(ValueError, match="divisible"):
        kc_layers.AlltoAll(2, 1, 1).compute_output_shape((4, 3))
