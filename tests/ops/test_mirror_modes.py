"""The reference's other modes of the mirror ops (issue 17).

`MiniStepAllGather(shard_accumulator=True)` (MindSpore's
grad_accumulation_shard), `MicroStepAllGather(reduce_gradient=False)`
(do_mirror=False) and `MicroStepAllGather(with_mirror_operator=True)`, each
against the float64 single-process simulation of all replicas
(`_gradcheck`) or a closed form written from the op's definition.
"""

import numpy as np
import pytest
import tensorflow as tf

import keras_comm
from keras_comm import layers
from keras_comm import ops
from conftest import make_strategy
from _gradcheck import check
from test_mirror import _gather_reference
from test_mirror import _input
from test_mirror import _micro_input
from test_mirror import _per_replica
from test_mirror import _stepper
from test_mirror import _subgroup_stepper
from test_mirror import SUBGROUP


def _mini_want(n, k, t_last, r, mean):
    """dL/dx_r released after the cycle ending at mini-step t_last (closed form).

    Replica q's loss at step t is sum(w_{q,t} * y * y), y the gathered
    vector, so dy_{q,t} = 2 w_{q,t} y_t; the adjoint of the gather sums
    dy over the replicas and keeps rank r's rows, over the cycle's steps.
    """
    want = 0.0
    for t in range(t_last + 1 - k, t_last + 1):
        ys = np.concatenate([_micro_input(q, t) for q in range(n)])
        for q in range(n):
            w = np.arange(1.0, 3 * n + 1) * (q + 1) + t
            want = want + (2 * w * ys)[3 * r : 3 * r + 3]
    return want / (n if mean else 1)


def _mini_step_fn(n, acc, step, k, mean, shard, group=None):
    def fn(t):
        r = keras_comm.rank()
        x = tf.constant([1.0, 2.0, 3.0], tf.float64) * tf.cast(r + 1, tf.float64) + t
        with tf.GradientTape() as tape:
            tape.watch(x)
            y = ops.mini_step_all_gather(
                x, acc, step, k, mean, group, shard_accumulator=shard
            )
            width = y.shape[0]
            w = tf.range(1.0, width + 1, dtype=tf.float64) * tf.cast(r + 1, tf.float64) + t
            loss = tf.reduce_sum(w * y * y)
        return y, tape.gradient(loss, x)

    return fn


@pytest.mark.inprocess
@pytest.mark.parametrize("mean", [True, False])
def test_mini_step_shard_accumulator_releases_cycle_sum(strategy, mode, mean):
    n, k = strategy.num_replicas_in_sync, 3
    acc = _per_replica(strategy, [3])  # the shard's shape: 1/n of the gathered one
    step = _per_replica(strategy, [], tf.int64)
    run = _stepper(strategy, _mini_step_fn(n, acc, step, k, mean, True), mode)
    for t in range(2 * k):
        got = run(t)
        for r in range(n):
            np.testing.assert_array_equal(
                got[r][0], np.concatenate([_micro_input(q, t) for q in range(n)])
            )
            if (t + 1) % k:
                np.testing.assert_array_equal(got[r][1], np.zeros(3))
            else:
                want = _mini_want(n, k, t, r, mean)
                np.testing.assert_allclose(got[r][1], want, rtol=1e-12, err_msg=f"t={t} r={r}")
        if (t + 1) % k:
            # Reduced every mini-step: each replica's buffer holds only its shard
            # of the global gradient so far.
            for r, a in enumerate(strategy.experimental_local_results(acc)):
                np.testing.assert_allclose(
                    a.numpy(), _mini_want(n, (t % k) + 1, t, r, mean), rtol=1e-12
                )
    for a in strategy.experimental_local_results(acc):
        np.testing.assert_array_equal(a.numpy(), np.zeros(3))


@pytest.mark.inprocess
def test_mini_step_all_gather_layer_passes_its_own_keywords():
    """The layer's `shard_accumulator` reaches the op (through the mixin's
    `call`): the shard-sized buffer holds this member's partial sum."""
    strategy = make_strategy(2)
    n, k = 2, 2
    with strategy.scope():
        layer = layers.MiniStepAllGather(
            mean=False, accumulation_steps=k, shard_accumulator=True, fusion=0, dtype="float64"
        )
        layer.build((3,))

    def fn(t):
        r = keras_comm.rank()
        x = tf.constant([1.0, 2.0, 3.0], tf.float64) * tf.cast(r + 1, tf.float64) + t
        with tf.GradientTape() as tape:
            tape.watch(x)
            y = layer(x)
            w = tf.range(1.0, 3 * n + 1, dtype=tf.float64) * tf.cast(r + 1, tf.float64) + t
            loss = tf.reduce_sum(w * y * y)
        return y, tape.gradient(loss, x)

    run = _stepper(strategy, fn, "function")
    got = run(0)
    for r, a in enumerate(strategy.experimental_local_results(layer._accumulator_variable())):
        np.testing.assert_allclose(a.numpy(), _mini_want(n, 1, 0, r, False), rtol=1e-12)
    got = run(1)
    for r in range(n):
        np.testing.assert_allclose(got[r][1], _mini_want(n, k, 1, r, False), rtol=1e-12)


@pytest.mark.inprocess
def test_mini_step_shard_accumulator_equals_gathered_accumulator(strategy, mode):
    """Both modes release the same gradient (the reduce-scatter is linear)."""
    n, k = strategy.num_replicas_in_sync, 2
    results = {}
    for shard in (False, True):
        acc = _per_replica(strategy, [3] if shard else [3 * n])
        step = _per_replica(strategy, [], tf.int64)
        run = _stepper(strategy, _mini_step_fn(n, acc, step, k, True, shard), mode)
        results[shard] = [run(t) for t in range(k)]
    for t in range(k):
        for r in range(n):
            np.testing.assert_allclose(
                results[True][t][r][1], results[False][t][r][1], rtol=1e-12, atol=1e-12
            )


@pytest.mark.inprocess
@pytest.mark.parametrize("mean", [True, False])
def test_mini_step_shard_accumulator_single_step_is_all_gather(strategy, mode, mean):
    acc = _per_replica(strategy, [2, 3])
    step = _per_replica(strategy, [], tf.int64)
    check(
        strategy,
        lambda x: ops.mini_step_all_gather(x, acc, step, 1, mean, shard_accumulator=True),
        _gather_reference(mean),
        _input,
        mode=mode,
    )


@pytest.mark.inprocess
def test_mini_step_shard_accumulator_subgroup(mode):
    group = SUBGROUP
    run = _subgroup_stepper(
        mode,
        lambda x, acc, step, k, group: ops.mini_step_all_gather(
            x, acc, step, k, False, group, shard_accumulator=True
        ),
        lambda y, r, t: tf.reduce_sum(y * tf.cast(r + 1, tf.float64) * (t + 1)),
    )
    g0, g1 = run(0), run(1)
    for r in range(4):
        if r in group:
            np.testing.assert_array_equal(g0[r], np.zeros(3))
            # sum over the members q and steps t of (q + 1) (t + 1)
            want = sum((q + 1) * (t + 1) for q in group for t in (0, 1))
            np.testing.assert_allclose(g1[r], np.full(3, want), rtol=1e-12)
        else:  # non-members: the gradient passes through, every step
            np.testing.assert_allclose(g0[r], np.full(3, r + 1.0), rtol=1e-12)
            np.testing.assert_allclose(g1[r], np.full(3, 2.0 * (r + 1)), rtol=1e-12)


def _own_rows_reference(xs):
    # Replica r's output: the gathered shards, where only its own shard
    # carries a gradient (the others are held constant on replica r).
    return [
        tf.concat([x if q == r else tf.stop_gradient(x) for q, x in enumerate(xs)], 0)
        for r in range(len(xs))
    ]


@pytest.mark.inprocess
@pytest.mark.parametrize("with_mirror_operator", [False, True])
def test_micro_step_all_gather_without_reduction(strategy, mode, with_mirror_operator):
    n = strategy.num_replicas_in_sync
    acc = None if with_mirror_operator else _per_replica(strategy, [2 * n, 3])
    check(
        strategy,
        lambda x: ops.micro_step_all_gather(
            x, acc, reduce_gradient=False, with_mirror_operator=with_mirror_operator
        ),
        _own_rows_reference,
        _input,
        mode=mode,
    )


@pytest.mark.inprocess
def test_micro_step_all_gather_without_reduction_releases_buffer(mode):
    """reduce_gradient=False still adds dy to the buffer and returns own rows of the total."""
    strategy = make_strategy(2)
    acc = _per_replica(strategy, [4])

    def fn(t):
        r = keras_comm.rank()
        x = tf.constant([1.0, 2.0], tf.float64) * tf.cast(r + 1, tf.float64)
        with tf.GradientTape() as last:
            last.watch(x)
            full = ops.micro_step_all_gather(x, acc, reduce_gradient=False)
            with tf.GradientTape() as first:
                first.watch(full)
                w = tf.constant([1.0, 2.0, 3.0, 4.0], tf.float64) * tf.cast(r + 1, tf.float64)
                loss1 = tf.reduce_sum(ops.virtual_assign_add(full, acc) * w)
            first.gradient(loss1, full)
            loss2 = tf.reduce_sum(full * 10.0)
        return last.gradient(loss2, x)

    got = _stepper(strategy, fn, mode)(0)
    for r in range(2):
        w = np.array([1.0, 2.0, 3.0, 4.0]) * (r + 1)
        np.testing.assert_allclose(got[r], (w + 10.0)[2 * r : 2 * r + 2], rtol=1e-12)
    for a in strategy.experimental_local_results(acc):
        np.testing.assert_array_equal(a.numpy(), np.zeros(4))


@pytest.mark.inprocess
@pytest.mark.parametrize("mean", [True, False])
def test_micro_step_all_gather_with_mirror_operator_is_all_gather(strategy, mode, mean):
    """The accumulator is not used: the backward is the all-gather's own."""
    got = check(
        strategy,
        lambda x: ops.micro_step_all_gather(x, None, mean, with_mirror_operator=True),
        _gather_reference(mean),
        _input,
        mode=mode,
    )
    assert got[0][0].shape == (2 * strategy.num_replicas_in_sync, 3)


def test_micro_step_with_mirror_operator_layer_has_no_accumulator():
    layer = layers.MicroStepAllGather(with_mirror_operator=True)
    layer.build((2, 3))
    assert layer.weights == []
    layer = layers.MiniStepAllGather(shard_accumulator=True, accumulation_steps=2)
    layer.build((2, 3))
    assert layer.accumulator.shape == (2, 3)


@pytest.mark.parametrize(
    "make, text",
    [
        (lambda: layers.MiniStepAllGather(shard_accumulator=1), "shard_accumulator=1"),
        (lambda: layers.MicroStepAllGather(reduce_gradient="no"), "reduce_gradient='no'"),
        (lambda: layers.MicroStepAllGather(with_mirror_operator=0), "with_mirror_operator=0"),
    ],
)
def test_new_arguments_validated(make, text):
    with pytest.raises(TypeError, match="Received") as info:
        make()
    assert text in str(info.value)


def test_shard_accumulator_shape_checked():
    # Outside a strategy the group is one replica: the shard accumulator has x's shape.
    x = tf.constant([1.0, 2.0])
    with pytest.raises(ValueError, match=r"accumulator.shape=\(3,\)"):
        ops.mini_step_all_gather(
            x, tf.Variable(tf.zeros([3])), tf.Variable(0, dtype=tf.int64), shard_accumulator=True
        )


@pytest.mark.parametrize(
    "cls, kwargs",
    [
        (layers.MiniStepAllGather, dict(accumulation_steps=2, shard_accumulator=True)),
        (layers.MicroStepAllGather, dict(reduce_gradient=False, with_mirror_operator=True)),
    ],
    ids=["mini", "micro"],
)
def test_new_arguments_round_trip_and_old_configs(cls, kwargs):
    layer = cls(**kwargs)
    config = layer.get_config()
    for key, value in kwargs.items():
        assert config[key] == value
    assert cls.from_config(config).get_config() == config
    for key in kwargs:
        if key != "accumulation_steps":
            config.pop(key)  # a config saved before these arguments existed
    old = cls.from_config(config)
    assert getattr(old, "shard_accumulator", False) is False
    assert getattr(old, "reduce_gradient", True) is True
    assert getattr(old, "with_mirror_operator", False) is False


# ---------------------------------------------------------------------------
# MirrorMicroStepOperator with a sharded optimizer (issue 17 item 2).
# ---------------------------------------------------------------------------


def test_same_shard_ranks():
    from keras_comm.ops.mirror import same_shard_ranks

    assert [same_shard_ranks(range(4), i, 2) for i in range(4)] == [[0, 2], [1, 3], [0, 2], [1, 3]]
    assert same_shard_ranks([1, 3, 5, 7, 9, 11], 4, 3) == [3, 9]
    assert same_shard_ranks(range(4), 3, 4) == [3]
    assert same_shard_ranks(range(4), 3, 1) == [0, 1, 2, 3]
    with pytest.raises(ValueError, match="Received: optimizer_shard_size=3"):
        same_shard_ranks(range(4), 0, 3)


def _sharded_reference(n, shard, mean):
    """Replica r holds a copy of shard r % shard of a parameter; gathers its block.

    Copies of one shard are tied (their gradients summed, times 1/copies if
    `mean`); the block's all-gather concatenates the block members' copies.
    """

    def ref(xs):
        copies = n // shard
        tied = []
        for q, x in enumerate(xs):
            total = tf.add_n([xs[s] for s in range(q % shard, n, shard)])
            scale = 1.0 / copies if mean else 1.0
            tied.append(tf.stop_gradient(x) + (total - tf.stop_gradient(total)) * scale)
        return [tf.concat(tied[(r // shard) * shard : (r // shard + 1) * shard], 0) for r in range(n)]

    return ref


@pytest.mark.inprocess
@pytest.mark.parametrize("mean", [True, False])
def test_mirror_micro_step_optimizer_shard_narrower_than_mirror_group(mode, mean):
    """4 replicas, the mirror group is all 4, the optimizer shards over blocks of 2.

    The gather over the block (its backward reduce-scatters over the block)
    and the mirror (all-reduces over the replicas holding the same shard)
    together give each shard the gradient summed over all 4 replicas once.
    """
    strategy = make_strategy(4)
    acc = _per_replica(strategy, [2, 3])

    def op(x):
        r = keras_comm.rank()
        block = [2 * (r // 2), 2 * (r // 2) + 1]
        m = ops.mirror_micro_step_operator(x, acc, mean, None, True, optimizer_shard_size=2)
        return ops.micro_step_all_gather(m, None, False, block, with_mirror_operator=True)

    got = check(strategy, op, _sharded_reference(4, 2, mean), _input, mode=mode)
    for r in range(4):
        b = r // 2
        np.testing.assert_array_equal(got[r][0], np.concatenate([_input(2 * b, 4), _input(2 * b + 1, 4)]))


@pytest.mark.inprocess
@pytest.mark.parametrize("mean", [True, False])
def test_mirror_micro_step_optimizer_shard_sizes(strategy, mode, mean):
    """Shard size 1: every member holds the whole parameter (a full all-reduce);
    size n (and None): each shard is held once, the gradient is returned unreduced."""
    n = strategy.num_replicas_in_sync
    for size in (1, n, None):
        acc = _per_replica(strategy, [2, 3])
        want_shard = 1 if size is None else size
        check(
            strategy,
            lambda x: ops.mirror_micro_step_operator(
                x, acc, mean, None, True, optimizer_shard_size=size
            ),
            lambda xs: _tied_by_shard(xs, n, n if size is None else size, mean),
            _input,
            mode=mode,
        )


def _tied_by_shard(xs, n, shard, mean):
    out = []
    copies = n // shard
    for q, x in enumerate(xs):
        total = tf.add_n([xs[s] for s in range(q % shard, n, shard)])
        scale = 1.0 / copies if mean else 1.0
        out.append(tf.stop_gradient(x) + (total - tf.stop_gradient(total)) * scale)
    return out


@pytest.mark.parametrize(
    "make, error, text",
    [
        (
            lambda: layers.MirrorMicroStepOperator(optimizer_shard_size=2),
            ValueError,
            "optimizer_shard=False, optimizer_shard_size=2",
        ),
        (
            lambda: layers.MirrorMicroStepOperator(optimizer_shard=True, optimizer_shard_size=0),
            ValueError,
            "optimizer_shard_size=0",
        ),
        (
            lambda: layers.MirrorMicroStepOperator(
                optimizer_shard=True, optimizer_shard_size=2, group=[0, 1, 2]
            ),
            ValueError,
            "optimizer_shard_size=2",
        ),
    ],
)
def test_optimizer_shard_size_validated(make, error, text):
    with pytest.raises(error, match="Received") as info:
        make()
    assert text in str(info.value)


def test_optimizer_shard_size_checked_against_world_at_build():
    strategy = make_strategy(4)
    with strategy.scope():
        layer = layers.MirrorMicroStepOperator(optimizer_shard=True, optimizer_shard_size=3)
        with pytest.raises(ValueError, match="Received: optimizer_shard_size=3"):
            layer.build((2,))


def test_optimizer_shard_size_round_trip_and_old_config():
    layer = layers.MirrorMicroStepOperator(optimizer_shard=True, optimizer_shard_size=2)
    config = layer.get_config()
    assert config["optimizer_shard_size"] == 2
    assert layers.MirrorMicroStepOperator.from_config(config).get_config() == config
    config.pop("optimizer_shard_size")
    assert layers.MirrorMicroStepOperator.from_config(config).optimizer_shard_size is None
