"""AllReduce PROD / MAX / MIN with a sparse upstream gradient (issue 17 item 5).

`tf.gather(all_reduce(x, op), ids)` hands the all-reduce's backward a
`tf.IndexedSlices` dy. The gradient must stay sparse and equal the float64
single-process simulation (duplicate ids, ties for MAX/MIN, zeros for PROD).
"""

import numpy as np
import pytest
import tensorflow as tf

import keras_comm
from keras_comm import ops
from conftest import run_replicas
import _gradcheck


def _x(r, n, op):
    x = (np.arange(1, 11, dtype=np.float64).reshape(5, 2) * (r + 1) * 0.37) - 0.5 * r
    if op in ("max", "min"):
        x[3, 1] = 100.0 if op == "max" else -100.0  # a tie on every rank
    if op == "prod" and r == 0:
        x[1, 0] = 0.0  # a zero: the other ranks' gradient there is 0, rank 0's is not
    return x


def _ids(r):
    return [r % 5, 3, 1, 3]  # a duplicate row, and rows every rank touches


def _tied(op):
    # The convention: every member equal to the result gets the full gradient.
    reduce = {"max": tf.reduce_max, "min": tf.reduce_min}[op]

    def y_of(xs):
        y = reduce(tf.stack(xs), 0)
        mask = [tf.cast(tf.equal(x, y), x.dtype) for x in xs]
        return tf.stop_gradient(y) + tf.add_n(
            [(x - tf.stop_gradient(x)) * m for x, m in zip(xs, mask)]
        )

    return y_of


def _reference(op, n):
    xs = [tf.constant(_x(r, n, op)) for r in range(n)]
    with tf.GradientTape() as tape:
        for x in xs:
            tape.watch(x)
        if op == "prod":
            y = tf.reduce_prod(tf.stack(xs), 0)
        else:
            y = _tied(op)(xs)
        total = 0.0
        for r in range(n):
            rows = tf.gather(y, _ids(r))
            total += tf.reduce_sum(_gradcheck.loss_weights(r, rows.shape) * rows)
    return [g.numpy() for g in tape.gradient(total, xs)]


@pytest.mark.inprocess
@pytest.mark.parametrize("op", ["prod", "max", "min"])
def test_sparse_upstream_gradient_stays_sparse(strategy, mode, op):
    n = strategy.num_replicas_in_sync

    def fn():
        r = keras_comm.rank()
        x = tf.constant(_x(r, n, op))
        with tf.GradientTape() as tape:
            tape.watch(x)
            rows = tf.gather(ops.all_reduce(x, op), _ids(r))
            loss = tf.reduce_sum(_gradcheck.loss_weights(r, rows.shape) * rows)
        g = tape.gradient(loss, x)
        return tf.constant(isinstance(g, tf.IndexedSlices)), tf.convert_to_tensor(g)

    want = _reference(op, n)
    for r, (sparse, g) in enumerate(run_replicas(strategy, fn, mode=mode)):
        assert sparse, "the gradient should stay IndexedSlices"
        np.testing.assert_allclose(g, want[r], rtol=1e-12, atol=1e-12, err_msg=f"rank {r}")
    if op == "prod":
        assert want[0][1, 0] != 0 and all(w[1, 0] == 0 for w in want[1:])
    else:
        assert all(w[3, 1] != 0 for w in want)  # the tie: everyone gets it
