"""Differentiable broadcast (one to all) and reduce (all to one).

Ranks outside the group get `x` back unchanged and their gradient passes
through.
"""

import tensorflow as tf

from keras_comm.ops import _collective
from keras_comm.ops.all_reduce import _broadcast
from keras_comm.ops.all_reduce import _check_dtype
from keras_comm.ops.all_reduce import _member_index
from keras_comm.ops.all_reduce import _what

BROADCAST_GRADIENTS = ("exact", "identity")


def validate_gradient(gradient, name="gradient"):
    """Returns `gradient` if it is "exact" or "identity"; raises otherwise."""
    if not isinstance(gradient, str) or gradient.lower() not in BROADCAST_GRADIENTS:
        raise ValueError(
            f"`{name}` must be one of {list(BROADCAST_GRADIENTS)}. "
            f"Received: {name}={gradient!r}"
        )
    return gradient.lower()


def broadcast(x, root=0, group=None, *, gradient="exact", timeout=None, name=None):
    """Sends `root`'s `x` to every group member.

    Forward: ``y = x_root`` on every member (others' x give shape and dtype).
    Backward, by `gradient`:

    * "exact" (default): the exact adjoint, ``dx_root = sum_r dy_r`` and zeros
      on the other members (their x does not affect any output). This is
      the gradient of the global objective (the sum of every replica's
      loss), so an optimizer step on a broadcast weight is the step of
      single-process training.
    * "identity": ``dx = dy`` on every member, the reference's (MindSpore's)
      choice. Each member's gradient is then only its own loss's share; it
      is what you want when every member keeps its own copy of x and the
      broadcast only re-synchronizes values.

    dtypes: float16, bfloat16 (sent as float32), float32, float64, int32,
    int64.

    Args:
        x: a tensor, same shape on every member.
        root: the source's GLOBAL rank; must be in the group.
        group: None (all replicas), a list of global ranks or a `Group`.
        gradient: "exact" or "identity" (see above).
        timeout: seconds; None for `keras_comm.get_timeout()`.
        name: name for the collective ops (a layer's name).

    Raises:
        ValueError: `root` not in the group, or an unknown `gradient`.
        TypeError: `root` not an int, or an unsupported dtype.
    """
    what = _what("broadcast", name)
    gradient = validate_gradient(gradient)
    x = tf.convert_to_tensor(x)
    _check_dtype(x, what)
    call = _collective.resolve(group, timeout, name)
    root_index = _member_index(call, root, "root", what)
    if call.trivial:
        return tf.identity(x)
    is_root = call.member and call.index == root_index

    @tf.custom_gradient
    def fn(x):
        y = _collective.run(lambda: _broadcast(x, call, root_index) if call.member else x)

        def grad(dy):
            dy = tf.convert_to_tensor(dy)
            if gradient == "identity":
                return dy

            def backward():
                # TF has no reduce-to-one collective: all-reduce, keep at root.
                total = _collective.all_reduce(dy, call, "sum")
                return total if is_root else tf.zeros_like(total)

            return _collective.run(backward if call.member else lambda: dy)

        return y, grad

    return fn(x)


def reduce(x, dest=0, group=None, *, timeout=None, name=None):
    """Sums `x` over the group into member `dest`.

    Forward: ``y_dest = sum_r x_r``; the other members output zeros of the
    same shape (the reference leaves them undefined; zeros make every
    output well defined and the reference's backward the exact adjoint).
    Backward: ``dx_r = dy_dest`` on every member (broadcast from `dest`).

    Implemented as an all-reduce (TF has no reduce-to-one collective).

    Args:
        x: a tensor, same shape on every member.
        dest: the destination's GLOBAL rank; must be in the group.
        group, timeout, name: as for `broadcast`.

    Raises:
        ValueError: `dest` not in the group. TypeError: `dest` not an int,
            or an unsupported dtype.
    """
    what = _what("reduce", name)
    x = tf.convert_to_tensor(x)
    _check_dtype(x, what)
    call = _collective.resolve(group, timeout, name)
    dest_index = _member_index(call, dest, "dest", what)
    if call.trivial:
        return tf.identity(x)
    is_dest = call.member and call.index == dest_index

    @tf.custom_gradient
    def fn(x):
        def forward():
            total = _collective.all_reduce(x, call, "sum")
            return total if is_dest else tf.zeros_like(total)

        y = _collective.run(forward if call.member else lambda: x)

        def grad(dy):
            dy = tf.convert_to_tensor(dy)
            return _collective.run(
                lambda: _broadcast(dy, call, dest_index) if call.member else dy
            )

        return y, grad

    return fn(x)
