"""Check an op per replica against a single-process simulation of all replicas.

The gradient convention of keras_comm: the objective is the SUM over replicas
of each replica's loss. Here replica r's loss is ``sum(w_r * op(x_r))`` with
fixed rank-dependent weights w_r, so the distributed gradient of x_r (which
the op's custom backward computes by communicating) must equal
``d/dx_r sum_r sum(w_r * y_r)`` computed by plain TF on one device over the
list of all replicas' inputs, in float64.
"""

import contextlib

import numpy as np
import tensorflow as tf

import keras_comm
from conftest import run_replicas


def loss_weights(rank, shape, dtype=tf.float64):
    """The fixed weights of replica `rank`'s loss (same in both computations)."""
    return tf.random.stateless_uniform(
        shape, seed=[rank, 2024], minval=0.5, maxval=1.5, dtype=dtype
    )


def _loss(rank, y):
    return tf.reduce_sum(loss_weights(rank, tf.shape(y), y.dtype) * y)


def distributed(strategy, op_fn, make_input, mode="function", scope=contextlib.nullcontext):
    """Runs op_fn on every replica; returns [(y_r, dloss/dx_r)] as numpy.

    `scope` is a context manager factory entered around each replica's
    forward and backward pass (e.g. `keras_comm.ops.fusion_scope`).
    """
    n = strategy.num_replicas_in_sync

    def replica_fn():
        rank = keras_comm.rank()
        x = tf.constant(make_input(rank, n))
        with scope():
            with tf.GradientTape() as tape:
                tape.watch(x)
                y = op_fn(x)
                loss = _loss(rank, y)
            grad = tape.gradient(loss, x, unconnected_gradients=tf.UnconnectedGradients.ZERO)
        return y, grad

    return run_replicas(strategy, replica_fn, mode=mode)


def reference(n, reference_fn, make_input):
    """Single-process simulation: [(y_r, dL/dx_r)] with L = sum_r loss_r."""
    xs = [tf.constant(make_input(r, n)) for r in range(n)]
    with tf.GradientTape() as tape:
        for x in xs:
            tape.watch(x)
        ys = reference_fn(xs)
        total = tf.add_n([_loss(r, y) for r, y in enumerate(ys)])
    grads = tape.gradient(total, xs, unconnected_gradients=tf.UnconnectedGradients.ZERO)
    return [(np.asarray(y), np.asarray(g)) for y, g in zip(ys, grads)]


def check(
    strategy,
    op_fn,
    reference_fn,
    make_input,
    mode="function",
    rtol=1e-9,
    atol=1e-12,
    scope=contextlib.nullcontext,
):
    """Asserts forward values and gradients of every replica match the reference.

    Args:
        strategy: an in-process multi-replica strategy (see conftest).
        op_fn: ``x -> y``, run per replica (may call keras_comm.rank()).
        reference_fn: ``[x_0 .. x_{n-1}] -> [y_0 .. y_{n-1}]`` in plain TF.
        make_input: ``(rank, n) -> np.ndarray`` (rank-encoded, float64).
        scope: as in `distributed`.
    Returns:
        The distributed per-replica results [(y_r, g_r)].
    """
    n = strategy.num_replicas_in_sync
    got = distributed(strategy, op_fn, make_input, mode=mode, scope=scope)
    want = reference(n, reference_fn, make_input)
    for r, ((y, g), (y_ref, g_ref)) in enumerate(zip(got, want)):
        np.testing.assert_allclose(y, y_ref, rtol=rtol, atol=atol, err_msg=f"forward, rank {r}")
        np.testing.assert_allclose(g, g_ref, rtol=rtol, atol=atol, err_msg=f"gradient, rank {r}")
    return got
