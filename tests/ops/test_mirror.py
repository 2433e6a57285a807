"""Mirror operators: forward identity / all-gather, reduced (accumulated) gradients.

Reference model of a mirror: replica r's input x_r is a *copy* of one shared
parameter theta, so dL/dx_r must be dL/dtheta = sum over the group of dy.
The float64 simulation ties the copies with ``stop_gradient(x_r) + (S -
stop_gradient(S))``, S = sum of the members' x: the forward value is x_r and
the gradient reaching every member's x is the sum of the members' dy.
"""

import numpy as np
import pytest
import tensorflow as tf

import keras
import keras_comm
from keras_comm import ops
from keras_comm import layers
from conftest import make_strategy
from conftest import run_replicas
from _gradcheck import check
from _gradcheck import loss_weights


def _input(rank, n):
    return np.arange(6, dtype=np.float64).reshape(2, 3) + 10.0 * (rank + 1)


def _tied_reference(members, mean_flag):
    def ref(xs):
        ranks = members if members is not None else range(len(xs))
        total = tf.add_n([xs[s] for s in ranks])
        scale = 1.0 / len(ranks) if mean_flag else 1.0
        tied = (total - tf.stop_gradient(total)) * scale
        return [tf.stop_gradient(x) + tied if r in ranks else x for r, x in enumerate(xs)]

    return ref


@pytest.mark.inprocess
@pytest.mark.parametrize("mean_flag", [True, False])
def test_mirror_operator_matches_tied_copies(strategy, mode, mean_flag):
    got = check(
        strategy,
        lambda x: ops.mirror_operator(x, mean=mean_flag),
        _tied_reference(None, mean_flag),
        _input,
        mode=mode,
    )
    n = strategy.num_replicas_in_sync
    # Closed form: every replica gets sum_r w_r (/ n), the same everywhere.
    want = sum(loss_weights(r, [2, 3]).numpy() for r in range(n)) / (n if mean_flag else 1)
    for r, (y, g) in enumerate(got):
        np.testing.assert_array_equal(y, _input(r, n))
        np.testing.assert_allclose(g, want, rtol=1e-12)


@pytest.mark.inprocess
@pytest.mark.parametrize("group", [[1, 3], [0, 2], [2]], ids=str)
def test_mirror_operator_subgroups(mode, group):
    strategy = make_strategy(4)
    check(
        strategy,
        lambda x: ops.mirror_operator(x, mean=True, group=group),
        _tied_reference(group, True),
        _input,
        mode=mode,
    )


@pytest.mark.inprocess
@pytest.mark.parametrize("dtype", ["float16", "bfloat16", "float32"])
def test_mirror_operator_dtypes(dtype):
    strategy = make_strategy(2)

    def fn():
        r = keras_comm.rank()
        x = tf.ones([4], dtype)
        with tf.GradientTape() as tape:
            tape.watch(x)
            y = ops.mirror_operator(x, mean=False)
            loss = tf.reduce_sum(y * tf.cast(r + 1, dtype))
        return y, tape.gradient(loss, x)

    for y, g in run_replicas(strategy, fn):
        assert g.dtype == tf.as_dtype(dtype).as_numpy_dtype
        np.testing.assert_array_equal(np.asarray(g, np.float32), [3.0] * 4)  # 1 + 2


@pytest.mark.inprocess
@pytest.mark.parametrize("mean_flag", [True, False])
def test_mirror_operator_sparse_gradient(strategy, mode, mean_flag):
    """An embedding lookup's IndexedSlices gradient is all-gathered, rows differ per rank."""
    n = strategy.num_replicas_in_sync
    table = np.arange(20, dtype=np.float64).reshape(5, 4)

    def ids(r):
        return [r % 5, (r + 2) % 5, 0][: r % 3 + 1]

    def fn():
        r = keras_comm.rank()
        x = tf.constant(table)
        with tf.GradientTape() as tape:
            tape.watch(x)
            rows = tf.gather(ops.mirror_operator(x, mean=mean_flag), ids(r))
            loss = tf.reduce_sum(rows * (r + 1.0))
        g = tape.gradient(loss, x)
        sparse = isinstance(g, tf.IndexedSlices)
        return tf.convert_to_tensor(g), tf.constant(sparse)

    want = np.zeros_like(table)
    for r in range(n):
        for i in ids(r):
            want[i] += r + 1.0
    want /= n if mean_flag else 1
    for g, sparse in run_replicas(strategy, fn, mode=mode):
        assert sparse, "the sparse gradient should stay IndexedSlices"
        np.testing.assert_allclose(g, want, rtol=1e-12)


def _per_replica(strategy, shape, dtype=tf.float64):
    with strategy.scope():
        return tf.Variable(
            tf.zeros(shape, dtype),
            trainable=False,
            synchronization=tf.VariableSynchronization.ON_READ,
            aggregation=tf.VariableAggregation.NONE,
        )


def _stepper(strategy, fn, mode):
    """Returns t -> [per-replica numpy results] of fn(t); one trace for all t."""
    if mode == "function":
        run = tf.function(lambda t: strategy.run(fn, args=(t,)))
    else:
        run = lambda t: strategy.run(fn, args=(t,))  # noqa: E731
    n = strategy.num_replicas_in_sync

    def step(t):
        out = run(tf.constant(t, tf.float64))
        return [
            tf.nest.map_structure(lambda v: np.asarray(strategy.experimental_local_results(v)[i]), out)
            for i in range(n)
        ]

    return step


def _micro_input(r, t):
    return np.array([1.0, 2.0, 3.0]) * (r + 1) + t


def _micro_dy(r, t):
    # loss_{r,t} = sum(w * y**2), so dy = 2 w y: depends on the micro-batch.
    w = np.array([0.5, 1.0, 1.5]) * (r + 1)
    return 2.0 * w * _micro_input(r, t)


def _micro_loss(y, r, t):
    w = tf.constant([0.5, 1.0, 1.5], tf.float64) * tf.cast(r + 1, tf.float64)
    return tf.reduce_sum(w * y * y)


@pytest.mark.inprocess
@pytest.mark.parametrize("mean_flag", [True, False])
def test_mirror_mini_step_accumulates(strategy, mode, mean_flag):
    """After k mini-steps the released gradient is the sum of the k global gradients."""
    n, k = strategy.num_replicas_in_sync, 3
    acc = _per_replica(strategy, [3])
    step = _per_replica(strategy, [], tf.int64)

    def fn(t):
        r = keras_comm.rank()
        x = tf.constant([1.0, 2.0, 3.0], tf.float64) * (r + 1) + t
        with tf.GradientTape() as tape:
            tape.watch(x)
            y = ops.mirror_mini_step_operator(x, acc, step, k, mean=mean_flag)
            loss = _micro_loss(y, r, t)
        return y, tape.gradient(loss, x)

    run = _stepper(strategy, fn, mode)
    for t in range(2 * k):
        got = run(t)
        if (t + 1) % k:
            want = np.zeros(3)
        else:
            ts = range(t + 1 - k, t + 1)
            want = sum(_micro_dy(r, s) for r in range(n) for s in ts) / (n if mean_flag else 1)
        for r, (y, g) in enumerate(got):
            np.testing.assert_allclose(y, _micro_input(r, t), rtol=1e-12)
            np.testing.assert_allclose(g, want, rtol=1e-12, err_msg=f"step {t}, rank {r}")
    # Reset after each release; the counter is per replica and in step.
    for a, s in zip(strategy.experimental_local_results(acc), strategy.experimental_local_results(step)):
        np.testing.assert_array_equal(a.numpy(), np.zeros(3))
        assert int(s.numpy()) == 2 * k


SUBGROUP, SUBGROUP_K = [1, 3], 2


def _subgroup_stepper(mode, op, loss):
    """t -> per-replica d loss(op(x, acc, step, k, group), r, t) / dx on 4 replicas.

    x = [1, 2, 3] (r + 1) + t; the mini-step group is `SUBGROUP` with
    k = `SUBGROUP_K`, replicas outside it are non-members.
    """
    strategy = make_strategy(4)
    acc = _per_replica(strategy, [3])
    step = _per_replica(strategy, [], tf.int64)

    def fn(t):
        r = keras_comm.rank()
        x = tf.constant([1.0, 2.0, 3.0], tf.float64) * tf.cast(r + 1, tf.float64) + t
        with tf.GradientTape() as tape:
            tape.watch(x)
            value = loss(op(x, acc, step, SUBGROUP_K, SUBGROUP), r, t)
        return tape.gradient(value, x)

    return _stepper(strategy, fn, mode)


@pytest.mark.inprocess
def test_mirror_mini_step_subgroup_and_non_members(mode):
    group = SUBGROUP
    run = _subgroup_stepper(
        mode,
        lambda x, acc, step, k, group: ops.mirror_mini_step_operator(x, acc, step, k, False, group),
        _micro_loss,
    )
    run(0)
    got = run(1)
    for r in range(4):
        ranks = group if r in group else [r]  # non-members: a group of one
        want = sum(_micro_dy(s, t) for s in ranks for t in (0, 1))
        np.testing.assert_allclose(got[r], want, rtol=1e-12, err_msg=f"rank {r}")


@pytest.mark.inprocess
@pytest.mark.parametrize("optimizer_shard", [False, True])
def test_mirror_micro_step_with_virtual_assign_add(strategy, mode, optimizer_shard):
    """Micro-batches 0..m-2 write into the buffer; the mirror releases all m."""
    n, m = strategy.num_replicas_in_sync, 3
    acc = _per_replica(strategy, [3])

    def fn(t):
        r = keras_comm.rank()
        x = tf.constant([1.0, 2.0, 3.0], tf.float64) * tf.cast(r + 1, tf.float64)
        grads = []
        for s in range(m):
            xs = x + s
            with tf.GradientTape() as tape:
                tape.watch(xs)
                if s < m - 1:
                    y = ops.virtual_assign_add(xs, acc)
                else:
                    y = ops.mirror_micro_step_operator(
                        xs, acc, mean=True, optimizer_shard=optimizer_shard
                    )
                loss = _micro_loss(y, r, s)
            grads.append(tape.gradient(loss, xs))
        return tf.stack(grads)

    got = _stepper(strategy, fn, mode)(0)
    for r in range(n):
        np.testing.assert_array_equal(got[r][: m - 1], np.zeros([m - 1, 3]))
        if optimizer_shard:
            want = sum(_micro_dy(r, s) for s in range(m))
        else:
            want = sum(_micro_dy(q, s) for q in range(n) for s in range(m)) / n
        np.testing.assert_allclose(got[r][m - 1], want, rtol=1e-12, err_msg=f"rank {r}")
    for a in strategy.experimental_local_results(acc):
        np.testing.assert_array_equal(a.numpy(), np.zeros(3))


def _gather_reference(mean_flag):
    def ref(xs):
        scale = 1.0 / len(xs) if mean_flag else 1.0
        # dx_r = scale * sum_q dy_q[slice r]: a copy of x whose gradient is scaled.
        full = tf.concat([x * scale + tf.stop_gradient(x * (1 - scale)) for x in xs], 0)
        return [full for _ in xs]

    return ref


@pytest.mark.inprocess
@pytest.mark.parametrize("mean_flag", [True, False])
@pytest.mark.parametrize("which", ["mini", "micro"])
def test_step_all_gather_single_step_is_all_gather(strategy, mode, mean_flag, which):
    n = strategy.num_replicas_in_sync
    acc = _per_replica(strategy, [2 * n, 3])
    step = _per_replica(strategy, [], tf.int64)

    def op(x):
        if which == "mini":
            return ops.mini_step_all_gather(x, acc, step, 1, mean_flag)
        return ops.micro_step_all_gather(x, acc, mean_flag)

    got = check(strategy, op, _gather_reference(mean_flag), _input, mode=mode)
    full = np.concatenate([_input(r, n) for r in range(n)])
    for y, _ in got:
        np.testing.assert_array_equal(y, full)


@pytest.mark.inprocess
def test_mini_step_all_gather_accumulates(strategy, mode):
    n, k = strategy.num_replicas_in_sync, 2
    acc = _per_replica(strategy, [n * 3])
    step = _per_replica(strategy, [], tf.int64)

    def fn(t):
        r = keras_comm.rank()
        x = tf.constant([1.0, 2.0, 3.0], tf.float64) * tf.cast(r + 1, tf.float64) + t
        with tf.GradientTape() as tape:
            tape.watch(x)
            y = ops.mini_step_all_gather(x, acc, step, k, mean=True)
            w = tf.range(1.0, 3 * n + 1, dtype=tf.float64) * tf.cast(r + 1, tf.float64) + t
            loss = tf.reduce_sum(w * y * y)
        return y, tape.gradient(loss, x)

    run = _stepper(strategy, fn, mode)
    for t in range(k):
        got = run(t)
    for r in range(n):
        # dL/dx_r = 1/n * sum_t sum_q 2 w_{q,t}[slice r] * x_{r,t}
        want = 0.0
        for t in range(k):
            xs = np.concatenate([_micro_input(q, t) for q in range(n)])
            for q in range(n):
                w = np.arange(1.0, 3 * n + 1) * (q + 1) + t
                want = want + (2 * w * xs)[3 * r : 3 * r + 3]
        np.testing.assert_allclose(got[r][1], want / n, rtol=1e-12, err_msg=f"rank {r}")
    assert not np.any(got[0][1] == 0)  # the first step returned zeros, this one not


@pytest.mark.inprocess
def test_micro_step_all_gather_releases_buffer(mode):
    strategy = make_strategy(2)
    acc = _per_replica(strategy, [4])

    def fn(t):
        r = keras_comm.rank()
        x = tf.constant([1.0, 2.0], tf.float64) * tf.cast(r + 1, tf.float64)
        with tf.GradientTape() as last:
            last.watch(x)
            full = ops.micro_step_all_gather(x, acc, False)
            # An earlier micro-batch: its gradient of `full` goes into the buffer.
            with tf.GradientTape() as first:
                first.watch(full)
                loss1 = tf.reduce_sum(ops.virtual_assign_add(full, acc) * tf.cast(r + 1, tf.float64))
            g1 = first.gradient(loss1, full)
            loss2 = tf.reduce_sum(full * 10.0)  # the last micro-batch
        return g1, last.gradient(loss2, x)

    got = _stepper(strategy, fn, mode)(0)
    for r in range(2):
        np.testing.assert_array_equal(got[r][0], [0.0] * 4)
        # buffer: sum_q (q+1) over the full vector; plus 10 * 2 replicas, own slice.
        np.testing.assert_allclose(got[r][1], [3.0 + 20.0] * 2, rtol=1e-12)


def test_one_replica_fast_path():
    x = tf.constant([1.0, 2.0])
    acc = tf.Variable(tf.zeros([2]))
    step = tf.Variable(0, dtype=tf.int64)
    with tf.GradientTape() as tape:
        tape.watch(x)
        ys = [
            ops.mirror_operator(x),
            ops.mirror_mini_step_operator(x, acc, step, 1),
            ops.mini_step_all_gather(x, tf.Variable(tf.zeros([2])), tf.Variable(0, dtype=tf.int64)),
        ]
        loss = tf.add_n([tf.reduce_sum(y * 3.0) for y in ys])
    np.testing.assert_array_equal(tape.gradient(loss, x), [9.0, 9.0])


@pytest.mark.parametrize(
    "call, error, text",
    [
        (lambda x, a, s: ops.mirror_operator(x, mean_flag="yes"), TypeError, "mean_flag='yes'"),
        (lambda x, a, s: ops.mirror_operator(tf.constant([1, 2])), TypeError, "x.dtype=int32"),
        (lambda x, a, s: ops.mirror_operator(x, group=[0, 5]), ValueError, "outside the world"),
        (
            lambda x, a, s: ops.mirror_mini_step_operator(x, a, s, 0),
            ValueError,
            "accumulation_steps=0",
        ),
        (
            lambda x, a, s: ops.mirror_mini_step_operator(x, tf.Variable([0.0]), s, 2),
            ValueError,
            "accumulator.shape=(1,)",
        ),
        (
            lambda x, a, s: ops.mirror_micro_step_operator(x, a, optimizer_shard=1),
            TypeError,
            "optimizer_shard=1",
        ),
        (
            lambda x, a, s: ops.mini_step_all_gather(tf.constant(1.0), a, s),
            ValueError,
            "rank >= 1",
        ),
    ],
)
def test_bad_input(call, error, text):
    x = tf.constant([1.0, 2.0])
    with pytest.raises(error, match="Received") as info:
        call(x, tf.Variable(tf.zeros([2])), tf.Variable(0, dtype=tf.int64))
    assert text in str(info.value)


# ---------------------------------------------------------------------------
# Layers.
# ---------------------------------------------------------------------------

LAYERS = [
    (layers.MirrorOperator, dict(mean=False, group=[0], timeout=12.0)),
    (layers.MirrorMiniStepOperator, dict(accumulation_steps=4, mean=True, group=None)),
    (layers.MirrorMicroStepOperator, dict(mean=False, optimizer_shard=True)),
    (layers.MiniStepAllGather, dict(mean=False, accumulation_steps=2)),
    (layers.MicroStepAllGather, dict(mean=True, group=[0])),
]


@pytest.mark.parametrize("cls, kwargs", LAYERS, ids=lambda v: getattr(v, "__name__", ""))
def test_layer_config_round_trip(cls, kwargs):
    layer = cls(**kwargs)
    config = layer.get_config()
    for key, value in kwargs.items():
        assert config[key] == value
    clone = cls.from_config(config)
    assert clone.get_config() == config


@pytest.mark.parametrize(
    "make, error, text",
    [
        (lambda: layers.MirrorOperator(mean_flag=1), TypeError, "mean_flag=1"),
        (lambda: layers.MirrorOperator(group=[]), ValueError, "must not be empty"),
        (lambda: layers.MirrorOperator(timeout=-1), ValueError, "timeout=-1"),
        (lambda: layers.MirrorMiniStepOperator(0), ValueError, "accumulation_steps=0"),
        (lambda: layers.MiniStepAllGather(accumulation_steps=1.5), ValueError, "accumulation_steps=1.5"),
        (lambda: layers.MirrorMicroStepOperator(optimizer_shard="no"), TypeError, "optimizer_shard='no'"),
    ],
)
def test_layer_bad_arguments(make, error, text):
    with pytest.raises(error, match="Received") as info:
        make()
    assert text in str(info.value)


@pytest.mark.parametrize("cls, kwargs", LAYERS, ids=lambda v: getattr(v, "__name__", ""))
def test_layer_accepts_old_mean_flag_keyword_and_config_key(cls, kwargs):
    # `mean` was called `mean_flag`; calls and saved configs using it still work.
    old = {("mean_flag" if k == "mean" else k): v for k, v in kwargs.items()}
    layer = cls(**old)
    assert layer.mean == kwargs["mean"] == layer.mean_flag
    config = layer.get_config()
    config["mean_flag"] = config.pop("mean")
    assert cls.from_config(config).get_config() == layer.get_config()
    with pytest.raises(TypeError, match="old name of `mean`"):
        cls(**old, mean=False)  # the default is True


def test_layer_needs_known_shape():
    layer = layers.MirrorMiniStepOperator(2)
    with pytest.raises(ValueError, match=r"input shape must be fully\s+known"):
        layer.build((None, 3))


def _model(kind):
    inputs = keras.Input(shape=(3,), batch_size=4)
    if kind == "sequential":
        model = keras.Sequential(
            [
                inputs,
                keras.layers.Dense(4, name="d1"),
                layers.MirrorOperator(name="mirror"),
                layers.MirrorMiniStepOperator(2, name="mini"),
                layers.MirrorMicroStepOperator(name="micro"),
                layers.MiniStepAllGather(name="gather"),
                layers.MicroStepAllGather(name="gather2"),
                keras.layers.Dense(1),
            ]
        )
        return model
    h = keras.layers.Dense(4)(inputs)
    a = layers.MirrorOperator(mean=False)(h)
    b = layers.MiniStepAllGather(accumulation_steps=1)(h)
    out = keras.layers.Dense(1)(keras.layers.Concatenate(axis=-1)([a, b]))
    return keras.Model(inputs, out)


@pytest.mark.parametrize("kind", ["sequential", "functional"])
def test_layers_in_models_save_and_load(tmp_path, kind):
    model = _model(kind)
    x = np.random.default_rng(0).normal(size=(4, 3)).astype("float32")
    y = model(x)
    model.compile(optimizer="sgd", loss="mse")
    model.fit(x, np.zeros_like(y), epochs=1, verbose=0)
    path = tmp_path / "model.keras"
    model.save(path)
    loaded = keras.models.load_model(path)
    np.testing.assert_allclose(loaded(x), model(x), rtol=1e-6)
    # Accumulators and step counters are saved and restored with the model.
    assert [w.name for w in loaded.weights] == [w.name for w in model.weights]
    assert "accumulator" in [w.name for w in model.non_trainable_weights]
    for a, b in zip(loaded.weights, model.weights):
        np.testing.assert_array_equal(a.numpy(), b.numpy())


def test_accumulator_weights_are_per_replica_and_non_trainable():
    strategy = make_strategy(2)
    with strategy.scope():
        layer = layers.MirrorMiniStepOperator(2, dtype="float64")
        layer.build((3,))
    assert layer.trainable_weights == []
    assert {w.name for w in layer.non_trainable_weights} == {"accumulator", "step"}
    assert isinstance(layer.accumulator.value, tf.distribute.DistributedValues)
    assert layer.accumulator.value.synchronization == tf.VariableSynchronization.ON_READ


@pytest.mark.inprocess
def test_layers_train_under_two_replicas(mode):
    """A custom strategy.run step: the mirror layers' gradients match the global ones."""
    strategy = make_strategy(2)
    with strategy.scope():
        mirror = layers.MirrorOperator(mean=False, dtype="float64")
        mini = layers.MirrorMiniStepOperator(2, mean=False, dtype="float64")
        gather = layers.MiniStepAllGather(mean=False, dtype="float64")
        for layer, shape in ((mirror, (3,)), (mini, (3,)), (gather, (3,))):
            layer.build(shape)

    def fn(t):
        r = keras_comm.rank()
        x = tf.constant([1.0, 2.0, 3.0], tf.float64) * tf.cast(r + 1, tf.float64) + t
        with tf.GradientTape() as tape:
            tape.watch(x)
            loss = (
                _micro_loss(mirror(x), r, t)
                + _micro_loss(mini(x), r, t)
                + tf.reduce_sum(gather(x)) * tf.cast(r + 1, tf.float64)
            )
        return tape.gradient(loss, x)

    run = _stepper(strategy, fn, mode)
    g0, g1 = run(0), run(1)
    for r in range(2):
        mirror_t = [sum(_micro_dy(q, t) for q in range(2)) for t in (0, 1)]
        gather_g = np.full(3, 3.0)  # sum_q (q + 1)
        np.testing.assert_allclose(g0[r], mirror_t[0] + gather_g, rtol=1e-12)
        np.testing.assert_allclose(g1[r], mirror_t[1] + mirror_t[0] + mirror_t[1] + gather_g, rtol=1e-12)


def test_ops_accept_old_mean_flag_keyword():
    # The ops' `mean` was MindSpore's `mean_flag`; calls using it still work,
    # and passing both names is an error naming them.
    x = tf.constant([1.0, 2.0])
    with tf.GradientTape() as tape:
        tape.watch(x)
        y = ops.mirror_operator(x, mean_flag=False)
    np.testing.assert_array_equal(tape.gradient(y, x).numpy(), [1.0, 1.0])
    assert ops.all_gather(x, mean_flag=True).shape == (2,)
    with pytest.raises(TypeError, match="old name of `mean`.*Received: mean=False, mean_flag=True"):
        ops.mirror_operator(x, mean=False, mean_flag=True)
