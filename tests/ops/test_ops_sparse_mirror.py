"""Sparse (IndexedSlices) gradients through the accumulation mirrors (issue 17).

docs/ops.md: `MirrorMiniStepOperator`, `MirrorMicroStepOperator`,
`MiniStepAllGather` and `MicroStepAllGather` release ``accumulator + dy``,
dense whatever dy is, because the accumulator is a dense buffer that other
micro-batches have written to. These tests pin that: an embedding lookup's
IndexedSlices dy, rows differing per rank, with an accumulator that already
holds another writer's (rank-encoded) gradient, gives the dense float64
closed form ``sum_r (acc_r + dense(dy_r))`` (``/ n`` with `mean`), and the
buffer is left at zeros.
"""

import numpy as np
import pytest
import tensorflow as tf

import keras_comm
from keras_comm import ops
from conftest import make_strategy
from conftest import run_replicas
from test_mirror import _per_replica

TABLE = np.arange(20, dtype=np.float64).reshape(5, 4)


def _ids(r):
    return [r % 5, (r + 2) % 5, 0][: r % 3 + 1]


def _prefill(r):
    # What another writer (an earlier micro-batch) left in the buffer.
    return (r + 1.0) * np.linspace(-1.0, 1.0, TABLE.size).reshape(TABLE.shape)


def _mirror(kind, x, acc, step, mean):
    if kind == "micro":
        return ops.mirror_micro_step_operator(x, acc, mean)
    if kind == "micro_sharded_block":
        # optimizer_shard_size=1: every member holds its own shard, so the
        # mirror all-reduces over the whole group, as the plain mirror.
        return ops.mirror_micro_step_operator(x, acc, mean, None, True, optimizer_shard_size=1)
    return ops.mirror_mini_step_operator(x, acc, step, 1, mean)


@pytest.mark.inprocess
@pytest.mark.parametrize(
    "kind,mean,mode",
    [
        ("micro", False, "function"),
        ("micro_sharded_block", True, "eager"),
        ("mini", True, "function"),  # the release in a tf.cond
        ("mini", False, "eager"),  # the release in a Python branch
    ],
)
def test_sparse_gradient_through_accumulation_mirror_is_dense_and_exact(kind, mean, mode):
    # 4 replicas: ranks 0..3 look up 1, 2, 3, 1 rows (a repeated id on rank 2).
    strategy = make_strategy(4)
    n = 4
    acc = _per_replica(strategy, list(TABLE.shape))
    with strategy.scope():
        step = tf.Variable(
            0,
            dtype=tf.int64,
            trainable=False,
            synchronization=tf.VariableSynchronization.ON_READ,
            aggregation=tf.VariableAggregation.NONE,
        )

    def fn():
        r = keras_comm.rank()
        prefill = tf.constant(np.stack([_prefill(q) for q in range(n)]))
        acc.assign(tf.gather(prefill, r))
        x = tf.constant(TABLE)
        with tf.GradientTape() as tape:
            tape.watch(x)
            y = _mirror(kind, x, acc, step, mean)
            rows = tf.gather(y, tf.gather(tf.ragged.constant([_ids(q) for q in range(n)]), r))
            loss = tf.reduce_sum(rows * tf.cast(r + 1, tf.float64))
        g = tape.gradient(loss, x)
        return tf.convert_to_tensor(g), tf.constant(isinstance(g, tf.IndexedSlices)), acc.read_value()

    want = np.zeros_like(TABLE)
    for r in range(n):
        want += _prefill(r)
        for i in _ids(r):
            want[i] += r + 1.0
    want /= n if mean else 1
    for g, sparse, left in run_replicas(strategy, fn, mode=mode):
        assert not sparse  # densified by design (docs/ops.md)
        np.testing.assert_allclose(g, want, rtol=1e-12, atol=1e-12)
        np.testing.assert_array_equal(left, np.zeros_like(TABLE))
