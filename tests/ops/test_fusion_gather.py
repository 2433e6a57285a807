"""Fusion of all-gathers and reduce-scatters (issue 17 item 6).

`fusion=` on AllGather, ReduceScatter, MiniStepAllGather and
MicroStepAllGather: calls with one id traced in one `fusion_scope` travel as
ONE collective per (kind, group, dtype), forward and backward. The count of
collectives in the traced graph is the exactness check of the packing; the
values and gradients must equal the float64 simulation.
"""

import numpy as np
import pytest
import tensorflow as tf

from keras_comm import layers
from keras_comm import ops
from conftest import make_strategy
from _gradcheck import check
from test_mirror import _per_replica

GATHER = "CollectiveGatherV2"
ALL_TO_ALL = "CollectiveAllToAllV2"  # reduce-scatter on CPU: an all-to-all and a local sum
REDUCE = "CollectiveReduceV2"


def _input(r, n):
    return np.arange(8 * 12, dtype=np.float64).reshape(8, 12) / 7.0 + r


def _parts(x):
    # Three shapes and layouts, axis 0 divisible by 2 and 4.
    return [x[:4], tf.reshape(x[4:], [8, 3, 2]), x[:, :4]]


def _gathered(xs, scale=1.0):
    # The all-gather of each part; its adjoint (reduce-scatter SUM) times scale.
    n = len(xs)
    parts = [_parts(x) for x in xs]
    out = []
    for i in range(3):
        pieces = [p[i] * scale + tf.stop_gradient(p[i] * (1 - scale)) for p in parts]
        out.append(tf.reshape(tf.concat(pieces, 0), [-1]))
    return [tf.concat(out, 0)] * n


def _scattered(xs):
    n = len(xs)
    out = []
    for r in range(n):
        pieces = []
        for i in range(3):
            total = tf.add_n([_parts(x)[i] for x in xs])
            k = total.shape[0] // n
            pieces.append(tf.reshape(total[r * k : (r + 1) * k], [-1]))
        out.append(tf.concat(pieces, 0))
    return out


def _flat(ys):
    return tf.concat([tf.reshape(y, [-1]) for y in ys], 0)


@pytest.mark.inprocess
@pytest.mark.parametrize("fusion", [0, 1])
def test_fused_all_gathers_match_reference(strategy, mode, fusion):
    check(
        strategy,
        lambda x: _flat([ops.all_gather(p, fusion=fusion) for p in _parts(x)]),
        _gathered,
        _input,
        mode=mode,
        scope=ops.fusion_scope,
    )


@pytest.mark.inprocess
def test_fused_reduce_scatters_match_reference(strategy, mode):
    check(
        strategy,
        lambda x: _flat([ops.reduce_scatter(p, fusion=2) for p in _parts(x)]),
        _scattered,
        _input,
        mode=mode,
        scope=ops.fusion_scope,
    )


@pytest.mark.inprocess
@pytest.mark.parametrize("shard", [False, True])
def test_fused_micro_and_mini_step_gathers_match_reference(strategy, mode, shard):
    n = strategy.num_replicas_in_sync
    shapes = [[4, 12], [8, 3, 2], [8, 4]]
    accs = [
        _per_replica(strategy, s if shard else [n * s[0]] + s[1:]) for s in shapes
    ]
    steps = [_per_replica(strategy, [], tf.int64) for _ in shapes]
    micro = [_per_replica(strategy, [n * s[0]] + s[1:]) for s in shapes]

    def op(x):
        ys = []
        for p, a, st, m in zip(_parts(x), accs, steps, micro):
            ys.append(ops.mini_step_all_gather(p, a, st, 1, True, shard_accumulator=shard, fusion=3))
            ys.append(ops.micro_step_all_gather(p, m, True, fusion=3))
        return _flat(ys)

    def ref(xs):
        a = [tf.split(y, [4 * 12 * n, 8 * 6 * n, 8 * 4 * n]) for y in _gathered(xs, 1.0 / n)]
        return [tf.concat([a[r][0], a[r][0], a[r][1], a[r][1], a[r][2], a[r][2]], 0) for r in range(n)]

    check(strategy, op, ref, _input, mode=mode, scope=ops.fusion_scope)


def _count(strategy, fn, op_type):
    def step():
        x = tf.ones([8, 12])
        with ops.fusion_scope():
            with tf.GradientTape() as tape:
                tape.watch(x)
                y = fn(x)
            return tape.gradient(y, x)

    graph = tf.function(lambda: strategy.run(step)).get_concrete_function().graph
    return sum(1 for o in graph.get_operations() if o.type == op_type) / strategy.num_replicas_in_sync


@pytest.mark.inprocess
@pytest.mark.parametrize(
    "fusions, gathers, all_to_alls",
    [((0, 0, 0), 3, 3), ((1, 1, 1), 1, 1), ((1, 2, 1), 2, 2), ((1, 1, 0), 2, 2)],
    ids=str,
)
def test_all_gather_transfers_per_step(fusions, gathers, all_to_alls):
    strategy = make_strategy(2)

    def fn(x):
        return _flat([ops.all_gather(p, fusion=f) for p, f in zip(_parts(x), fusions)])

    assert _count(strategy, fn, GATHER) == gathers  # forward
    assert _count(strategy, fn, ALL_TO_ALL) == all_to_alls  # backward reduce-scatters


@pytest.mark.inprocess
def test_reduce_scatter_kinds_and_groups_do_not_mix():
    strategy = make_strategy(4)

    def fn(x):
        p = _parts(x)
        return _flat(
            [
                ops.reduce_scatter(p[0], fusion=1),
                ops.reduce_scatter(p[1], fusion=1),
                ops.reduce_scatter(p[2], group=[0, 1], fusion=1),  # another group
                ops.all_reduce(x, fusion=1),  # another kind, same id
            ]
        )

    # Forward: one world pack per replica, plus the subgroup's on its 2 of 4 members.
    assert _count(strategy, fn, ALL_TO_ALL) == 1.5
    # The all-reduce packs alone, its forward and backward together (this dy
    # does not depend on the forward result).
    assert _count(strategy, fn, REDUCE) == 1
    # Backward all-gathers: one world pack; the subgroup's on its members only.
    assert _count(strategy, fn, GATHER) == 1.5


@pytest.mark.inprocess
def test_micro_step_gathers_send_one_transfer_each_way():
    strategy = make_strategy(2)
    accs = [_per_replica(strategy, [2 * s[0]] + s[1:]) for s in ([4, 12], [8, 3, 2], [8, 4])]

    def fn(x):
        return _flat(
            [ops.micro_step_all_gather(p, a, fusion=5) for p, a in zip(_parts(x), accs)]
        )

    assert _count(strategy, fn, GATHER) == 1
    assert _count(strategy, fn, ALL_TO_ALL) == 1


def test_fusion_arguments_round_trip_and_validate():
    for cls, kwargs in (
        (layers.AllGather, {}),
        (layers.ReduceScatter, {}),
        (layers.MiniStepAllGather, {}),
        (layers.MicroStepAllGather, {}),
    ):
        layer = cls(fusion=4, **kwargs)
        config = layer.get_config()
        assert config["fusion"] == 4
        assert cls.from_config(config).get_config() == config
        config.pop("fusion")  # saved before the argument existed
        assert cls.from_config(config).fusion == 0
        with pytest.raises(ValueError, match="Received: fusion=-1"):
            cls(fusion=-1)
        with pytest.raises(TypeError, match="Received: fusion=1.5"):
            cls(fusion=1.5)


@pytest.mark.inprocess
def test_micro_step_mirrors_send_one_backward_all_reduce(mode):
    strategy = make_strategy(2)
    shapes = ([4, 12], [8, 3, 2], [8, 4])
    accs = [_per_replica(strategy, s) for s in shapes]

    def op(x):
        return _flat(
            [ops.mirror_micro_step_operator(p, a, False, fusion=6) for p, a in zip(_parts(x), accs)]
        )

    def ref(xs):
        parts = [_parts(x) for x in xs]
        out = []
        for r in range(2):
            tied = []
            for i in range(3):
                total = tf.add_n([p[i] for p in parts])
                tied.append(tf.stop_gradient(parts[r][i]) + total - tf.stop_gradient(total))
            out.append(_flat(tied))
        return out

    check(strategy, op, ref, _input, mode=mode, scope=ops.fusion_scope)
    fn = lambda x: op(tf.cast(x, tf.float64))  # noqa: E731
    assert _count(strategy, fn, REDUCE) == 1


def test_micro_step_mirror_fusion_round_trip():
    layer = layers.MirrorMicroStepOperator(fusion=2)
    config = layer.get_config()
    assert config["fusion"] == 2
    config.pop("fusion")
    assert layers.MirrorMicroStepOperator.from_config(config).fusion == 0
