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

from keras_comm._private import keras_api

#: Attribute of the tf.Variable holding its own gradient reduction.
GRADIENT_HOOK_ATTR = "_keras_comm_reduce_gradient"


def set_gradient_hook(variable, reduce):
    """Makes `reduce(grad) -> grad` the gradient reduction of `variable`.

    The hook lives on the tf.Variable, which is what the optimizer's
    reduction receives.
    """
    setattr(keras_api.tf_variable(variable), GRADIENT_HOOK_ATTR, reduce)


def gradient_hook(variable):
    """The reduction `variable` carries, or None (the world-wide sum)."""
    return getattr(keras_api.tf_variable(variable), GRADIENT_HOOK_ATTR, None)


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


def all_reduce_sum_gradients(self, grads_and_vars):
    """Replaces `TFOptimizer._all_reduce_sum_gradients` (an optimizer method).

    Variables without a hook are reduced exactly as upstream (one batched
    all-reduce); each hooked variable's gradient goes through its hook.
    """
    original = keras_api.upstream_gradient_reduction()
    grads_and_vars = list(grads_and_vars)
    hooks = [getattr(v, GRADIENT_HOOK_ATTR, None) for _, v in grads_and_vars]
    if tf.distribute.get_replica_context() is None or not any(hooks):
        return original(self, grads_and_vars)
    plain = [gv for gv, h in zip(grads_and_vars, hooks) if h is None]
    reduced = iter(original(self, plain) if plain else [])
    return [
        (h(g), v) if h is not None else next(reduced)
        for (g, v), h in zip(grads_and_vars, hooks)
    ]
