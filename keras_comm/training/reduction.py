"""Which reduction each gradient gets: the world-wide sum, or the variable's own.

The rule: every gradient is reduced exactly once. By default a gradient is
summed over all replicas (Keras's optimizer does it in
`TFOptimizer._all_reduce_sum_gradients`, `ParallelOptimizer` in its own
collectives). A variable may carry its own reduction instead, a function
``grad -> grad`` called in replica context:

* sharded weights of `keras_comm.parallel` reduce over their data-parallel
  group (the replicas holding the same shard), not the world;
* `mark_gradient_reduced(v)` gives `v` the identity: for a weight whose
  gradient a comm layer (e.g. `MirrorOperator`) already summed.

This is the plug-in point for how gradients travel (bucketing, compression,
hierarchical reductions): `all_reduce_sum_gradients` is the optimizer's
path, `keras_comm.training.accumulate` the `ParallelOptimizer` one.
"""

import tensorflow as tf

from keras_comm import config
from keras_comm._private import keras_api

# The hook itself is a per-variable declaration (`keras_comm.variables.annotations`).
from keras_comm.variables.annotations import GRADIENT_HOOK_ATTR
from keras_comm.variables.annotations import gradient_hook  # noqa: F401
from keras_comm.variables.annotations import set_gradient_hook


def mark_gradient_reduced(variable):
    """Marks `variable` as having its gradient reduced inside the model.

    The rule "every gradient is reduced exactly once": a comm layer whose
    backward already sums a weight's gradient over the replicas (e.g. a
    `MirrorOperator` on the weight's path, the reference's data-parallel
    mirror) makes a second, world-wide sum by the optimizer (or by
    `ParallelOptimizer`) count every replica's contribution N times. The
    layer cannot tell which variable a tensor came from, so the model marks
    the variable: its gradient then passes through unchanged, and the
    optimizer updates it with what the layer produced.

    Args:
        variable: a Keras variable (or tf.Variable).

    Returns:
        `variable`, marked.
    """
    set_gradient_hook(variable, _already_reduced)
    return variable


def _already_reduced(grad):
    return grad


def gradient_buckets(sizes, bucket_bytes):
    """Groups gradients into buckets, in the order to issue them.

    Pure: `sizes` are the gradients' sizes in bytes, in variable order.
    Walking them backwards (the order backward makes them), a bucket closes
    once it holds at least `bucket_bytes`; a gradient larger than that is a
    bucket of its own. Returns the buckets last layer first, each a list of
    indices into `sizes` in ascending order; `bucket_bytes=0` is one bucket.

    Example: ``gradient_buckets([48, 16, 16, 4], 16) == [[2, 3], [1], [0]]``.
    """
    if not sizes:
        return []
    if bucket_bytes == 0:
        return [list(range(len(sizes)))]
    out, current, filled = [], [], 0
    for index in reversed(range(len(sizes))):
        current.append(index)
        filled += sizes[index]
        if filled >= bucket_bytes:
            out.append(sorted(current))
            current, filled = [], 0
    if current:
        out.append(sorted(current))
    return out


def _size_bytes(grad, variable):
    # The variable's shape is always static; a gradient's (IndexedSlices, a
    # partially known shape) need not be.
    return tf.TensorShape(variable.shape).num_elements() * tf.as_dtype(grad.dtype).size


def _bucketed(original, optimizer, grads_and_vars, bucket_bytes):
    """Upstream's reduction, one call (one packed all-reduce) per bucket.

    The calls are traced last bucket first: TensorFlow chains a strategy's
    collectives through one ordering token in program order, so a bucket
    traced after another cannot start before it, whatever data it waits
    for. Each call concatenates only its own bucket, so it waits only for
    those gradients.
    """
    present = [i for i, (g, _) in enumerate(grads_and_vars) if g is not None]
    sizes = [_size_bytes(*grads_and_vars[i]) for i in present]
    out = list(grads_and_vars)  # None gradients pass through, as upstream.
    for bucket in gradient_buckets(sizes, bucket_bytes):
        members = [present[k] for k in bucket]
        reduced = original(optimizer, [grads_and_vars[i] for i in members])
        for i, pair in zip(members, reduced, strict=True):
            out[i] = pair
    return out


def sum_duplicate_rows(grad):
    """`grad` with each row index once, duplicates summed (a sparse gradient).

    An embedding's gradient is a `tf.IndexedSlices` with one row per looked-up
    token, so a token seen twice in a batch appears twice. Keras 3's
    TensorFlow optimizers apply such a gradient as it is, and a non-linear
    update then treats the rows one by one: Adam's second moment gets
    ``g1**2 + g2**2`` where the gradient's row is ``g1 + g2`` and the update
    wants ``(g1 + g2)**2``. That is not Adam (Keras on JAX, tf-keras and a
    dense gradient all give the sum's square), and it differs from the same
    model whose gradient arrives dense — e.g. an embedding split by a
    `keras.distribution` layout. Summing the duplicates first (tf-keras's
    `_deduplicate_indexed_slices`) makes every update the optimizer's own
    maths on the true gradient; linear updates (SGD) are unchanged.
    """
    if not isinstance(grad, tf.IndexedSlices):
        return grad
    unique, positions = tf.unique(grad.indices)
    values = tf.math.unsorted_segment_sum(grad.values, positions, tf.shape(unique)[0])
    return tf.IndexedSlices(values, unique, grad.dense_shape)


def all_reduce_sum_gradients(self, grads_and_vars):
    """Replaces `TFOptimizer._all_reduce_sum_gradients` (an optimizer method).

    Variables without a hook are reduced as upstream: one batched
    all-reduce, or with `keras_comm.set_gradient_bucket_bytes(n)` one per
    bucket, last layer first (see `gradient_buckets`); each hooked
    variable's gradient goes through its hook. Sparse gradients then have
    their duplicate rows summed (`sum_duplicate_rows`).
    """
    return [(sum_duplicate_rows(g), v) for g, v in _reduce_each(self, grads_and_vars)]


def _reduce_each(self, grads_and_vars):
    original = keras_api.upstream_gradient_reduction()
    grads_and_vars = list(grads_and_vars)
    bucket_bytes = config.get_gradient_bucket_bytes()
    if tf.distribute.get_replica_context() is None:
        return original(self, grads_and_vars)
    if bucket_bytes:
        def reduce(pairs):
            return _bucketed(original, self, pairs, bucket_bytes)
    else:
        def reduce(pairs):
            return original(self, pairs)
    hooks = [getattr(v, GRADIENT_HOOK_ATTR, None) for _, v in grads_and_vars]
    if not any(hooks):
        return reduce(grads_and_vars)
    plain = [gv for gv, h in zip(grads_and_vars, hooks) if h is None]
    reduced = iter(reduce(plain) if plain else [])
    return [
        (h(g), v) if h is not None else next(reduced)
        for (g, v), h in zip(grads_and_vars, hooks)
    ]
