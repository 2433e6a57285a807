"""Local gradient norms: each parameter's gradient norm on this replica.

The squared L2 norm of each parameter's gradient *before* it is reduced over
the replicas (MindSpore: dump_local_norm, which prints it inside the mirror
operators' backward). `local_norms` returns the values, and the caller (e.g. the ParallelOptimizer callback, or a
custom train step) decides where they go (logs, metrics, TensorBoard).

Under Keras, the gradients a train step gets from its tape are per-replica
(local) gradients: Keras all-reduces them inside ``optimizer.apply``. So
calling `local_norms` on them in replica context gives the local norms.
"""

import tensorflow as tf


def _name(var, i):
    for attr in ("path", "name"):
        value = getattr(var, attr, None)
        if isinstance(value, str) and value:
            return value
    return f"variable_{i}"


def local_norms(grads_and_vars, squared=False):
    """Returns ``{variable path: norm of its gradient on this replica}``.

    Args:
        grads_and_vars: an iterable of ``(gradient, variable)`` pairs, as
            passed to ``optimizer.apply_gradients``. A None gradient is
            skipped; a ``tf.IndexedSlices`` gradient counts its rows (a row
            present twice counts as its sum, as the dense gradient would).
            The variable may be a Keras or TF variable (its ``path``, else
            ``name``, is the key) or a string.
        squared: return ``sum(g**2)`` instead of
            ``sqrt(sum(g**2))``.

    Returns:
        A dict from name to a float32 scalar tensor, in input order. Names
        repeated in the input get a ``#i`` suffix.

    Raises:
        TypeError: if an element is not a ``(gradient, variable)`` pair.
    """
    out = {}
    for i, pair in enumerate(grads_and_vars):
        if not isinstance(pair, (tuple, list)) or len(pair) != 2:
            raise TypeError(
                "`grads_and_vars` must contain (gradient, variable) pairs. "
                f"Received: element {i} = {pair!r}"
            )
        grad, var = pair
        if grad is None:
            continue
        if isinstance(grad, tf.IndexedSlices):
            # Sum duplicate rows first, as the dense gradient would.
            values, idx = grad.values, grad.indices
            unique, pos = tf.unique(idx)
            grad = tf.math.unsorted_segment_sum(values, pos, tf.shape(unique)[0])
        grad = tf.cast(tf.convert_to_tensor(grad), tf.float32)
        value = tf.reduce_sum(tf.square(grad))
        if not squared:
            value = tf.sqrt(value)
        key = var if isinstance(var, str) else _name(var, i)
        if key in out:
            key = f"{key}#{i}"
        out[key] = value
    return out


def record_local_norm(variable, gradient):
    """Sets `variable` to the L2 norm of `gradient`; returns `gradient`, ordered after it.

    For the mirror ops' backward (MindSpore: dump_local_norm, printed there):
    the norm of this replica's gradient before it is reduced. `variable` is
    a per-replica float32 scalar (the layers create it), or None to record
    nothing. The returned gradient depends on the assignment, so it runs in
    a traced backward too.

    Args:
        variable: None or a scalar float variable.
        gradient: a tensor or a ``tf.IndexedSlices`` (duplicate rows count
            as their sum, as in `local_norms`).

    Returns:
        `gradient`, unchanged in value.
    """
    if variable is None:
        return gradient
    values = gradient.values if isinstance(gradient, tf.IndexedSlices) else gradient
    if values.dtype == tf.float64:
        # float64 gradients keep their precision (local_norms computes in float32).
        g = gradient
        if isinstance(g, tf.IndexedSlices):
            unique, pos = tf.unique(g.indices)
            g = tf.math.unsorted_segment_sum(g.values, pos, tf.shape(unique)[0])
        norm = tf.sqrt(tf.reduce_sum(tf.square(tf.convert_to_tensor(g))))
    else:
        (norm,) = local_norms([(gradient, "g")]).values()
    update = variable.assign(tf.cast(norm, variable.dtype), read_value=False)
    with tf.control_dependencies([update]):
        if isinstance(gradient, tf.IndexedSlices):
            return tf.IndexedSlices(
                tf.identity(gradient.values), gradient.indices, gradient.dense_shape
            )
        return tf.identity(gradient)
