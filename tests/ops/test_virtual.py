"""Virtual operators (identity forward, bookkeeping backward) and local norms."""

import numpy as np
import pytest
import tensorflow as tf

import keras
import keras_comm
from keras_comm import layers
from keras_comm import ops
from conftest import make_strategy
from conftest import run_replicas
from _gradcheck import check


def _input(rank, n):
    return np.arange(8, dtype=np.float64).reshape(4, 2) + 10.0 * (rank + 1)


def _per_replica(strategy, shape, dtype=tf.float64):
    with strategy.scope():
        return tf.Variable(
            tf.zeros(shape, dtype),
            trainable=False,
            synchronization=tf.VariableSynchronization.ON_READ,
            aggregation=tf.VariableAggregation.NONE,
        )


def _locals(strategy, var):
    return [v.numpy() for v in strategy.experimental_local_results(var)]


@pytest.mark.inprocess
@pytest.mark.parametrize("group", [None, "all", [1, 3]], ids=str)
def test_virtual_assign_add_writes_buffer(mode, group):
    """Backward returns zeros; the buffer gets dy (reduce-scattered with a group)."""
    strategy = make_strategy(4)
    ranks = list(range(4)) if group == "all" else group
    shard = 4 // len(ranks) if ranks else 4
    # Non-members of [1, 3] keep a full-size buffer; use two variables.
    acc_shard = _per_replica(strategy, [shard, 2])
    acc_full = _per_replica(strategy, [4, 2])

    def fn():
        r = keras_comm.rank()
        x = tf.constant(_input(r, 4))
        acc = acc_shard if ranks is None or r in ranks else acc_full
        with tf.GradientTape() as tape:
            tape.watch(x)
            y = ops.virtual_assign_add(x, acc, group=ranks)
            loss = tf.reduce_sum(y * tf.cast(r + 1, tf.float64) * tf.range(1.0, 9.0, dtype=tf.float64)[:, None][:4])
        return y, tape.gradient(loss, x)

    for r, (y, g) in enumerate(run_replicas(strategy, fn, mode=mode)):
        np.testing.assert_array_equal(y, _input(r, 4))
        np.testing.assert_array_equal(g, np.zeros([4, 2]))
    dy = lambda r: (r + 1) * np.arange(1.0, 5.0)[:, None] * np.ones([4, 2])  # noqa: E731
    shards, fulls = _locals(strategy, acc_shard), _locals(strategy, acc_full)
    for r in range(4):
        if ranks is None:
            np.testing.assert_array_equal(shards[r], dy(r))
        elif r in ranks:
            i = ranks.index(r)
            want = sum(dy(q) for q in ranks)[shard * i : shard * (i + 1)]
            np.testing.assert_allclose(shards[r], want, rtol=1e-12)
        else:
            np.testing.assert_array_equal(fulls[r], dy(r))


@pytest.mark.inprocess
def test_virtual_accu_grad_and_add(strategy, mode):
    n = strategy.num_replicas_in_sync
    acc = _per_replica(strategy, [4, 2])

    def fn():
        r = keras_comm.rank()
        acc.assign(tf.fill([4, 2], tf.cast(100.0 * (r + 1), tf.float64)))
        x = tf.constant(_input(r, n))
        with tf.GradientTape(persistent=True) as tape:
            tape.watch(x)
            a = ops.virtual_accu_grad(x, acc)
            b = ops.virtual_add(x, acc)
            la = tf.reduce_sum(a * 3.0)
            lb = tf.reduce_sum(b * 3.0)
        return tape.gradient(la, x), tape.gradient(lb, x)

    for r, (ga, gb) in enumerate(run_replicas(strategy, fn, mode=mode)):
        np.testing.assert_array_equal(ga, np.full([4, 2], 100.0 * (r + 1)))  # dy discarded
        np.testing.assert_array_equal(gb, np.full([4, 2], 100.0 * (r + 1) + 3.0))
    for r, a in enumerate(_locals(strategy, acc)):
        np.testing.assert_array_equal(a, np.full([4, 2], 100.0 * (r + 1)))  # left as is


@pytest.mark.parametrize("divisor", [4, 0.5])
@pytest.mark.parametrize("structure", ["tensor", "tuple", "list"])
def test_virtual_div(divisor, structure):
    xs = [tf.constant([1.0, 2.0]), tf.constant([3.0], tf.float64)]
    with tf.GradientTape() as tape:
        for x in xs:
            tape.watch(x)
        if structure == "tensor":
            ys = [ops.virtual_div(xs[0], divisor)]
        else:
            ys = ops.virtual_div(tuple(xs) if structure == "tuple" else list(xs), divisor)
            assert isinstance(ys, tuple if structure == "tuple" else list)
        loss = tf.add_n([tf.cast(tf.reduce_sum(y * 6.0), tf.float64) for y in ys])
    grads = tape.gradient(loss, xs[: len(ys)])
    for x, y, g in zip(xs, ys, grads):
        np.testing.assert_array_equal(y, x)
        np.testing.assert_allclose(g, np.full(x.shape, 6.0 / divisor))


def test_virtual_div_int_passes_through():
    x = tf.constant([1, 2])
    np.testing.assert_array_equal(ops.virtual_div(x, 3), [1, 2])


@pytest.mark.inprocess
@pytest.mark.parametrize("backward", ["zeros", "exact"])
def test_get_tensor_slice(strategy, mode, backward):
    n = strategy.num_replicas_in_sync

    def reference(xs):
        out = []
        for r, x in enumerate(xs):
            size = 4 // n
            y = x[r * size : (r + 1) * size]
            out.append(tf.stop_gradient(y) if backward == "zeros" else y)
        return out

    got = check(
        strategy,
        lambda x: ops.get_tensor_slice(x, axis=0, backward=backward),
        reference,
        _input,
        mode=mode,
    )
    for r, (y, g) in enumerate(got):
        size = 4 // n
        np.testing.assert_array_equal(y, _input(r, n)[r * size : (r + 1) * size])


@pytest.mark.inprocess
def test_get_tensor_slice_axis_subgroup_num_slices(mode):
    strategy = make_strategy(4)

    def fn():
        r = keras_comm.rank()
        x = tf.reshape(tf.range(8.0), [2, 4])
        a = ops.get_tensor_slice(x, axis=-1, group=[1, 3])  # 2 slices of the last axis
        b = ops.get_tensor_slice(x, axis=1, num_slices=4)
        return a, b

    got = run_replicas(strategy, fn, mode=mode)
    x = np.arange(8.0).reshape(2, 4)
    np.testing.assert_array_equal(got[0][0], x)  # non-member: the whole tensor
    np.testing.assert_array_equal(got[1][0], x[:, :2])
    np.testing.assert_array_equal(got[3][0], x[:, 2:])
    for r in range(4):
        np.testing.assert_array_equal(got[r][1], x[:, r : r + 1])


def test_get_tensor_slice_int_one_replica():
    x = tf.constant([[1, 2], [3, 4]])
    np.testing.assert_array_equal(ops.get_tensor_slice(x, axis=1, num_slices=2), [[1], [3]])


@pytest.mark.parametrize(
    "call, error, text",
    [
        (lambda: ops.virtual_div(tf.constant(1.0), 0), ValueError, "divisor=0"),
        (lambda: ops.virtual_div(tf.constant(1.0), "2"), ValueError, "divisor='2'"),
        (lambda: ops.get_tensor_slice(tf.zeros([3]), num_slices=2), ValueError, "x.shape=(3,)"),
        (lambda: ops.get_tensor_slice(tf.zeros([4]), axis=1), ValueError, "axis=1"),
        (lambda: ops.get_tensor_slice(tf.zeros([4]), num_slices=0), ValueError, "num_slices=0"),
        (lambda: ops.get_tensor_slice(tf.zeros([4]), backward="grad"), ValueError, "backward='grad'"),
        (
            lambda: ops.virtual_add(tf.zeros([4]), tf.Variable(tf.zeros([3]))),
            ValueError,
            "accumulator.shape=(3,)",
        ),
        (
            lambda: ops.virtual_assign_add(tf.zeros([4], tf.int32), tf.Variable(tf.zeros([4]))),
            TypeError,
            "x.dtype=int32",
        ),
        (lambda: ops.local_norms([tf.zeros([2])]), TypeError, "element 0"),
    ],
)
def test_bad_input(call, error, text):
    with pytest.raises(error, match="Received") as info:
        call()
    assert text in str(info.value)


def test_local_norms():
    v1 = keras.Variable(np.zeros([2, 2]), name="kernel")
    v2 = tf.Variable(np.zeros([5, 2]), name="table")
    dense = tf.constant([[3.0, 4.0], [0.0, 0.0]])
    sparse = tf.IndexedSlices(tf.constant([[1.0, 1.0], [1.0, 1.0]]), tf.constant([1, 1]), [5, 2])
    norms = ops.local_norms([(dense, v1), (sparse, v2), (None, "skipped")])
    assert list(norms) == [v1.path, "table:0"]
    np.testing.assert_allclose(norms[v1.path], 5.0)
    np.testing.assert_allclose(norms["table:0"], np.sqrt(8.0))  # row 1 = [2, 2]
    squared = ops.local_norms([(dense, "w"), (dense, "w")], squared=True)
    np.testing.assert_allclose(list(squared.values()), [25.0, 25.0])
    assert list(squared) == ["w", "w#1"]


@pytest.mark.inprocess
def test_local_norms_are_local(mode):
    strategy = make_strategy(2)

    def fn():
        r = keras_comm.rank()
        return ops.local_norms([(tf.fill([4], tf.cast(r + 1, tf.float32)), "w")])["w"]

    got = run_replicas(strategy, fn, mode=mode)
    np.testing.assert_allclose([float(g) for g in got], [2.0, 4.0])


# ---------------------------------------------------------------------------
# Layers.
# ---------------------------------------------------------------------------

LAYERS = [
    (layers.VirtualAssignAdd, dict(group=[0], timeout=5.0)),
    (layers.VirtualAccuGrad, dict()),
    (layers.VirtualAdd, dict()),
    (layers.VirtualDiv, dict(divisor=8)),
    (layers.GetTensorSlice, dict(axis=-1, num_slices=2, group=None, backward="exact")),
]


@pytest.mark.parametrize("cls, kwargs", LAYERS, ids=lambda v: getattr(v, "__name__", ""))
def test_layer_config_round_trip(cls, kwargs):
    config = cls(**kwargs).get_config()
    for key, value in kwargs.items():
        assert config[key] == value
    assert cls.from_config(config).get_config() == config


@pytest.mark.parametrize(
    "make, error, text",
    [
        (lambda: layers.VirtualDiv(0), ValueError, "divisor=0"),
        (lambda: layers.GetTensorSlice(axis="0"), TypeError, "axis='0'"),
        (lambda: layers.GetTensorSlice(num_slices=0), ValueError, "num_slices=0"),
        (lambda: layers.GetTensorSlice(backward="none"), ValueError, "backward='none'"),
        (lambda: layers.VirtualAssignAdd(group=[1, 1]), ValueError, "repeat"),
        (lambda: layers.VirtualAssignAdd(timeout=0), ValueError, "timeout=0"),
    ],
)
def test_layer_bad_arguments(make, error, text):
    with pytest.raises(error, match="Received") as info:
        make()
    assert text in str(info.value)


@pytest.mark.parametrize("kind", ["sequential", "functional"])
def test_layers_in_models_save_and_load(tmp_path, kind):
    inputs = keras.Input(shape=(4,), batch_size=2)
    stack = [
        keras.layers.Dense(4),
        layers.VirtualDiv(2),
        layers.VirtualAdd(),
        layers.GetTensorSlice(axis=1, num_slices=2, backward="exact"),
        keras.layers.Dense(1),
    ]
    if kind == "sequential":
        model = keras.Sequential([inputs, *stack])
    else:
        h = inputs
        for layer in stack:
            h = layer(h)
        model = keras.Model(inputs, h)
    x = np.ones([2, 4], "float32")
    assert model(x).shape == (2, 1)
    model.compile(optimizer="sgd", loss="mse")
    model.fit(x, np.zeros([2, 1]), epochs=1, verbose=0)
    path = tmp_path / "model.keras"
    model.save(path)
    loaded = keras.models.load_model(path)
    np.testing.assert_allclose(loaded(x), model(x), rtol=1e-6)


@pytest.mark.inprocess
def test_accumulation_layers_under_two_replicas(mode):
    """VirtualAssignAdd's buffer, read back by a VirtualAccuGrad sharing it via the ops tier."""
    strategy = make_strategy(2)
    with strategy.scope():
        write = layers.VirtualAssignAdd(group=[0, 1], dtype="float64")
        write.build((4, 2))

    def fn():
        r = keras_comm.rank()
        x = tf.constant(_input(r, 2))
        with tf.GradientTape() as tape:
            tape.watch(x)
            loss = tf.reduce_sum(write(x) * tf.cast(r + 1, tf.float64))
        g1 = tape.gradient(loss, x)
        shard = x[2 * r : 2 * r + 2]
        with tf.GradientTape() as tape:
            tape.watch(shard)
            loss = tf.reduce_sum(ops.virtual_accu_grad(shard, write.accumulator.value))
        return g1, tape.gradient(loss, shard)

    for r, (g1, g2) in enumerate(run_replicas(strategy, fn, mode=mode)):
        np.testing.assert_array_equal(g1, np.zeros([4, 2]))
        np.testing.assert_array_equal(g2, np.full([2, 2], 3.0))  # sum_q (q + 1)
