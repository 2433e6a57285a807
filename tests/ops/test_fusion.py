"""Fusion groups: separate all-reduces / mirrors with one `fusion` id, one transfer.

Two things are checked for every case: the values and gradients are exactly
those of the unfused ops (float64 simulation, `_gradcheck`), and the traced
step holds the number of collectives fusion promises (graph op counts).
"""

import contextlib

import keras
import numpy as np
import pytest
import tensorflow as tf

import keras_comm
from keras_comm import layers as kc_layers
from keras_comm import ops as kc_ops
from keras_comm.ops import _collective
from conftest import make_strategy
import _gradcheck

_REDUCE = {
    "sum": lambda xs: tf.add_n(xs),
    "prod": lambda xs: tf.reduce_prod(tf.stack(xs), 0),
    "max": lambda xs: tf.reduce_max(tf.stack(xs), 0),
}
_SIZES = [6, 4, 4]


def _input(r, n):
    # Distinct across ranks (no MAX ties), mixed signs, no zeros.
    return (np.arange(1, 15, dtype=np.float64) * (r + 1) * 0.37) - 0.5 * r - 0.05


def _per_part_reference(parts_fn):
    """Reference of ``x -> concat(parts_fn(split(x)))`` over all replicas."""

    def ref(xs):
        parts = [tf.split(x, _SIZES) for x in xs]
        return parts_fn(parts)

    return ref


def _count(strategy, step, op_type="CollectiveReduceV2"):
    """Collectives of `op_type` in the traced step, per replica."""
    graph = tf.function(lambda: strategy.run(step)).get_concrete_function().graph
    total = sum(1 for op in graph.get_operations() if op.type == op_type)
    return total / strategy.num_replicas_in_sync


# ---------------------------------------------------------------------------
# Values and gradients: fused calls are exactly the unfused ops.
# ---------------------------------------------------------------------------


@pytest.mark.inprocess
@pytest.mark.parametrize("reductions", [("sum", "sum", "sum"), ("sum", "max", "prod")], ids=str)
def test_fused_calls_match_reference(strategy, mode, reductions):
    def op_fn(x):
        parts = tf.split(x, _SIZES)
        ys = [kc_ops.all_reduce(p, op, fusion=3) for p, op in zip(parts, reductions)]
        return tf.concat(ys, 0)

    def parts_fn(parts):
        n = len(parts)
        reduced = [_REDUCE[op]([parts[r][i] for r in range(n)]) for i, op in enumerate(reductions)]
        return [tf.concat(reduced, 0)] * n

    _gradcheck.check(
        strategy, op_fn, _per_part_reference(parts_fn), _input, mode=mode, scope=kc_ops.fusion_scope
    )


def _chain(x, all_reduce):
    """y1 = AR(a); y2 = AR(y1 / 2 + b) (depends on y1); y3 = AR(2c) (independent)."""
    a, b, c = tf.split(x, [4, 4, 6])
    y1 = all_reduce(a)
    y2 = all_reduce(y1 * 0.5 + b)
    y3 = all_reduce(c * 2.0)
    return tf.concat([y1, y2, y3 * y3], 0)


@pytest.mark.inprocess
def test_dependent_calls_stay_exact(strategy, mode):
    def ref(xs):
        parts = [tf.split(x, [4, 4, 6]) for x in xs]
        y1 = tf.add_n([p[0] for p in parts])
        y2 = tf.add_n([y1 * 0.5 + p[1] for p in parts])
        y3 = tf.add_n([p[2] * 2.0 for p in parts])
        return [tf.concat([y1, y2, y3 * y3], 0)] * len(xs)

    _gradcheck.check(
        strategy,
        lambda x: _chain(x, lambda t: kc_ops.all_reduce(t, fusion=1)),
        ref,
        _input,
        mode=mode,
        scope=kc_ops.fusion_scope,
    )


@pytest.mark.inprocess
@pytest.mark.parametrize("mean_flag", [True, False])
def test_fused_mirrors_and_all_reduce_share_a_group(strategy, mode, mean_flag):
    # Three mirrored "parameters" and one forward all-reduce, all fusion 2.
    def op_fn(x):
        a, b, c = tf.split(x, _SIZES)
        ma = kc_ops.mirror_operator(a, mean_flag, fusion=2)
        mb = kc_ops.mirror_operator(b, mean_flag, fusion=2)
        mc = kc_ops.all_reduce(c, fusion=2)
        return tf.concat([ma * ma, mb, mc], 0)

    def ref(xs):
        n = len(xs)
        parts = [tf.split(x, _SIZES) for x in xs]
        scale = 1.0 / n if mean_flag else 1.0

        def tied(i):
            total = tf.add_n([p[i] for p in parts])
            return [
                tf.stop_gradient(p[i]) + (total - tf.stop_gradient(total)) * scale for p in parts
            ]

        ta, tb = tied(0), tied(1)
        mc = tf.add_n([p[2] for p in parts])
        return [tf.concat([ta[r] * ta[r], tb[r], mc], 0) for r in range(n)]

    _gradcheck.check(strategy, op_fn, ref, _input, mode=mode, scope=kc_ops.fusion_scope)


@pytest.mark.inprocess
@pytest.mark.parametrize("consumer", ["all_gather", "broadcast", "cond"])
def test_collective_reading_a_pending_result_flushes_it_first(consumer, mode):
    # A non-fused collective (or one inside tf.cond) on a fused, still pending
    # output: the pack must be issued before it, or the step would deadlock.
    if consumer == "cond" and mode == "eager":
        pytest.skip("tf.cond of a collective: graph mode only")
    strategy = make_strategy(2)

    def use(y):
        if consumer == "all_gather":
            return tf.reduce_sum(tf.reshape(kc_ops.all_gather(y[tf.newaxis]), [2, -1]), 0)
        if consumer == "broadcast":
            return kc_ops.broadcast(y, root=1) * 2.0
        return tf.cond(tf.reduce_sum(y) > -1e9, lambda: kc_ops.all_reduce(y), lambda: y)

    def op_fn(x):
        a, b, c = tf.split(x, _SIZES)
        ya = kc_ops.all_reduce(a, fusion=1)
        yb = kc_ops.all_reduce(b, fusion=1)
        yc = kc_ops.all_reduce(c, fusion=1)
        return tf.concat([use(ya), yb, yc], 0)

    def ref(xs):
        parts = [tf.split(x, _SIZES) for x in xs]
        ya, yb, yc = (tf.add_n([p[i] for p in parts]) for i in range(3))
        used = ya * 2.0
        return [tf.concat([used, yb, yc], 0)] * len(xs)

    _gradcheck.check(strategy, op_fn, ref, _input, mode=mode, scope=kc_ops.fusion_scope)


# ---------------------------------------------------------------------------
# How many transfers a step makes.
# ---------------------------------------------------------------------------


def _squares_step(fusions, scope=kc_ops.fusion_scope):
    """Three all-reduces with the given fusion ids; loss sum(y^2) (dy needs y)."""

    def step():
        xs = [tf.ones([3], tf.float32) * (i + 1) for i in range(3)]
        with scope():
            with tf.GradientTape() as tape:
                tape.watch(xs)
                ys = [kc_ops.all_reduce(x, fusion=f) for x, f in zip(xs, fusions)]
                loss = tf.add_n([tf.reduce_sum(y * y) for y in ys])
            return tape.gradient(loss, xs)

    return step


@pytest.mark.inprocess
@pytest.mark.parametrize(
    "fusions, scope, per_replica",
    [
        ((0, 0, 0), kc_ops.fusion_scope, 6),  # fusion 0: never fused
        ((1, 1, 1), kc_ops.fusion_scope, 2),  # one forward pack, one backward pack
        ((1, 2, 1), kc_ops.fusion_scope, 4),  # two ids: two packs each way
        ((1, 1, 1), contextlib.nullcontext, 6),  # no scope: each call on its own
    ],
    ids=["fusion0", "one_id", "two_ids", "no_scope"],
)
def test_transfers_per_step(fusions, scope, per_replica):
    strategy = make_strategy(2)
    assert _count(strategy, _squares_step(fusions, scope)) == per_replica


@pytest.mark.inprocess
def test_dependent_chain_transfers():
    # Forward: {y1}, then {y2, y3}. Backward dys are constants (linear loss)
    # except through y1's input, so they join the pending {y2, y3} pack,
    # which y1's backward must wait for: 3 transfers in all.
    strategy = make_strategy(2)

    def step():
        x = tf.range(14, dtype=tf.float32)
        with kc_ops.fusion_scope():
            with tf.GradientTape() as tape:
                tape.watch(x)
                loss = tf.reduce_sum(_chain(x, lambda t: kc_ops.all_reduce(t, fusion=1))[:8])
            return tape.gradient(loss, x)

    assert _count(strategy, step) == 3


@pytest.mark.inprocess
def test_mirrors_of_parameters_send_one_backward_transfer():
    strategy = make_strategy(2)

    def step(fusion):
        def fn():
            ws = [tf.ones([4, 4]) * 0.1, tf.ones([4]) * 0.2, tf.ones([4, 2]) * 0.3]
            x = tf.ones([5, 4])
            with kc_ops.fusion_scope():
                with tf.GradientTape() as tape:
                    tape.watch(ws)
                    k1, b1, k2 = (kc_ops.mirror_operator(w, fusion=fusion) for w in ws)
                    loss = tf.reduce_sum(tf.tanh(x @ k1 + b1) @ k2)
                return tape.gradient(loss, ws)

        return fn

    assert _count(strategy, step(0)) == 3
    assert _count(strategy, step(7)) == 1


@pytest.mark.inprocess
def test_call_checking_turns_fusion_off():
    strategy = make_strategy(2)
    previous = keras_comm.get_check_calls()
    keras_comm.set_check_calls(True)
    try:
        assert _count(strategy, _squares_step((1, 1, 1))) == 6
    finally:
        keras_comm.set_check_calls(previous)


@pytest.mark.inprocess
def test_packed_op_names_its_members():
    strategy = make_strategy(2)

    def step():
        a = kc_ops.all_reduce(tf.ones([2]), fusion=4, name="left")
        b = kc_ops.all_reduce(tf.ones([3]), fusion=4, name="right")
        return a, b

    def traced():
        with kc_ops.fusion_scope():
            return strategy.run(step)

    graph = tf.function(traced).get_concrete_function().graph
    names = [op.name for op in graph.get_operations() if op.type == "CollectiveReduceV2"]
    assert len(names) == 2, names  # one per replica
    assert all("fusion4_left_right" in n for n in names), names


# ---------------------------------------------------------------------------
# model.fit: mirrors on weights, one fusion id.
# ---------------------------------------------------------------------------


class _MirroredDense(keras.layers.Layer):
    """A dense layer whose weights pass through MirrorOperator (reduced there)."""

    def __init__(self, units, fusion, **kwargs):
        super().__init__(**kwargs)
        self.units = units
        self.fusion = fusion

    def build(self, input_shape):
        self.kernel = self.add_weight(
            shape=(input_shape[-1], self.units), initializer="glorot_uniform", name="kernel"
        )
        self.bias = self.add_weight(shape=(self.units,), initializer="zeros", name="bias")
        for w in (self.kernel, self.bias):
            keras_comm.compat.mark_gradient_reduced(w)
        self.mirror = kc_layers.MirrorOperator(mean=False, fusion=self.fusion)

    def call(self, x):
        return x @ self.mirror(self.kernel) + self.mirror(self.bias)


def _fit(fusion, count):
    strategy = make_strategy(2)
    keras.utils.set_random_seed(3)
    rng = np.random.default_rng(0)
    x = rng.normal(size=(24, 5)).astype("float32")
    y = rng.normal(size=(24, 2)).astype("float32")
    with strategy.scope():
        if fusion is None:
            hidden, out = keras.layers.Dense(8, activation="tanh"), keras.layers.Dense(2)
        else:
            hidden = keras.Sequential([_MirroredDense(8, fusion), keras.layers.Activation("tanh")])
            out = _MirroredDense(2, fusion)
        model = keras.Sequential([keras.Input((5,)), hidden, out])
        model.compile(optimizer=keras.optimizers.SGD(0.1), loss="mse")
    model.fit(x, y, batch_size=8, epochs=2, shuffle=False, verbose=0)
    return [w.numpy() for w in model.trainable_weights], count()


@pytest.mark.inprocess
def test_fit_with_fused_mirrors_matches_keras(monkeypatch):
    reduces = []
    original = _collective._ordered

    def spy(call, kind, launch, **attrs):
        if kind == "all_reduce":
            reduces.append(call.name)
        return original(call, kind, launch, **attrs)

    monkeypatch.setattr(_collective, "_ordered", spy)

    def traced():
        n = len(reduces)
        reduces.clear()
        return n

    plain, _ = _fit(None, traced)
    unfused, n_unfused = _fit(0, traced)
    fused, n_fused = _fit(5, traced)
    # Four weights, two replicas: 8 all-reduces traced unfused, 2 packed.
    assert (n_unfused, n_fused) == (8, 2)
    for a, b, c in zip(plain, unfused, fused):
        np.testing.assert_allclose(b, a, rtol=1e-5, atol=1e-6)
        np.testing.assert_allclose(c, b, rtol=1e-6, atol=1e-7)


# ---------------------------------------------------------------------------
# Arguments and config.
# ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    "fusion, error",
    [(-1, ValueError), (1.0, TypeError), (True, TypeError), ("1", TypeError)],
    ids=str,
)
def test_bad_fusion_is_rejected_everywhere(fusion, error):
    for make in (
        lambda: kc_layers.AllReduce(fusion=fusion),
        lambda: kc_layers.MirrorOperator(fusion=fusion),
        lambda: kc_ops.all_reduce(tf.ones([2]), fusion=fusion),
        lambda: kc_ops.mirror_operator(tf.ones([2]), fusion=fusion),
    ):
        with pytest.raises(error, match=r"`fusion` must be an int >= 0.*Received: fusion="):
            make()


def test_mirror_operator_config_keeps_fusion():
    layer = kc_layers.MirrorOperator(mean=False, fusion=3, group=[0, 1], name="m")
    clone = kc_layers.MirrorOperator.from_config(layer.get_config())
    assert (clone.fusion, clone.mean_flag, list(clone.group.ranks)) == (3, False, [0, 1])


def test_scope_outside_functions_is_a_no_op():
    with kc_ops.fusion_scope():
        y = kc_ops.all_reduce(tf.ones([2]), fusion=1)
    np.testing.assert_array_equal(y, [1.0, 1.0])


def test_error_inside_scope_is_not_masked_and_scope_is_dropped():
    strategy = make_strategy(2)

    def step():
        kc_ops.all_reduce(tf.ones([2]), fusion=1)
        raise ValueError("boom")

    @tf.function
    def traced():
        with kc_ops.fusion_scope():
            strategy.run(step)

    with pytest.raises(ValueError, match="boom"):
        traced.get_concrete_function()
    # The next trace starts clean and works.
    assert _count(strategy, _squares_step((1, 1, 1))) == 2
