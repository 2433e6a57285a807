"""The ops' shared skeleton and dtype rule (keras_comm.ops._differentiable)."""

import numpy as np
import pytest
import tensorflow as tf

import keras_comm
from keras_comm.ops import _collective
from keras_comm.ops import _differentiable as D
from conftest import make_strategy
from conftest import run_replicas

# Exactly representable in float16 and bfloat16, and rank-encoded.
_VALUES = np.array([[0.5, -1.25], [3.0, 96.0]], np.float32)


def _x(rank, dtype):
    return tf.cast(_VALUES + 8 * rank, dtype)


@pytest.mark.inprocess
@pytest.mark.parametrize("dtype", [tf.float16, tf.bfloat16], ids=lambda d: d.name)
@pytest.mark.parametrize("mode", ["eager", "function"])
def test_every_primitive_takes_half_types_and_moves_them_exactly(dtype, mode):
    # A primitive whose kernel lacks a dtype the rule does not carry as
    # float32 raises TypeError here; a carried value must come back unchanged.
    strategy = make_strategy(2)

    def replica_fn():
        rank = keras_comm.rank()
        call = _collective.resolve()
        x = _x(rank, dtype)

        def thunk():
            return {
                "all_gather": D.all_gather(x, call),
                "all_to_all": D.all_to_all(x, call),
                "broadcast": D.broadcast(x, call, 1),
                "all_reduce": D.all_reduce(x, call),
                "reduce_scatter": D.reduce_scatter(x, call),
            }

        return _collective.run(thunk)

    got = run_replicas(strategy, replica_fn, mode=mode)
    xs = [_VALUES + 8 * r for r in range(2)]
    total = xs[0] + xs[1]
    for r in range(2):
        out = got[r]
        assert all(v.dtype == dtype.as_numpy_dtype for v in out.values())
        f32 = {k: np.asarray(v, np.float32) for k, v in out.items()}
        np.testing.assert_array_equal(f32["all_gather"], np.concatenate(xs))
        np.testing.assert_array_equal(f32["all_to_all"], np.stack([xs[0][r], xs[1][r]]))
        np.testing.assert_array_equal(f32["broadcast"], xs[1])
        np.testing.assert_array_equal(f32["all_reduce"], total)  # exact: small integers/halves
        np.testing.assert_array_equal(f32["reduce_scatter"], total[r : r + 1])


def test_the_rule_carries_only_what_a_kernel_lacks():
    assert D.carried_dtype(tf.bfloat16, "all_gather") == tf.float32
    assert D.carried_dtype(tf.bfloat16, "broadcast") == tf.float32
    assert D.carried_dtype(tf.float16, "all_gather") == tf.float16
    for kind in ("all_reduce", "reduce_scatter", "all_to_all"):
        assert D.carried_dtype(tf.bfloat16, kind) == tf.bfloat16


def test_group_of_one_is_the_identity_both_ways():
    # Outside any strategy the world is one replica: neither rule runs.
    def never(*args):
        raise AssertionError("a group of one must not communicate")

    call = _collective.resolve()
    x = tf.constant([1.0, 2.0])
    with tf.GradientTape() as tape:
        tape.watch(x)
        y = D.collective(x, call, never, never)
        loss = tf.reduce_sum(3.0 * y)
    np.testing.assert_array_equal(y, x)
    np.testing.assert_array_equal(tape.gradient(loss, x), [3.0, 3.0])


@pytest.mark.inprocess
@pytest.mark.parametrize("mode", ["eager", "function"])
def test_non_members_pass_values_and_gradients_through(mode):
    strategy = make_strategy(4)

    def replica_fn():
        rank = keras_comm.rank()
        call = _collective.resolve([0, 2])
        x = tf.fill([2], tf.cast(rank + 1, tf.float32))
        with tf.GradientTape() as tape:
            tape.watch(x)
            # Members: y = 10 x, dx = 10 dy, with a real collective each way
            # so that members and non-members reach the same run points.
            y = D.collective(
                x,
                call,
                lambda x: 10.0 * x + 0.0 * D.all_reduce(x, call),
                lambda dy, x, y: 10.0 * dy + 0.0 * D.all_reduce(dy, call),
            )
            loss = tf.reduce_sum(y)
        return y, tape.gradient(loss, x)

    got = run_replicas(strategy, replica_fn, mode=mode)
    for rank, (y, g) in enumerate(got):
        scale = 10.0 if rank in (0, 2) else 1.0
        np.testing.assert_array_equal(y, [scale * (rank + 1)] * 2)
        np.testing.assert_array_equal(g, [scale] * 2)
