"""Differentiable broadcast (one to all) and reduce (all to one).

Ranks outside the group get `x` back unchanged and their gradient passes
through.
"""

import tensorflow as tf

from keras_comm import _validation
from keras_comm.ops import _checks
from keras_comm.ops import _collective
from keras_comm.ops import _differentiable as D
from keras_comm.ops.all_reduce import prod_grad
from keras_comm.ops.reduce_op import ReduceOp

BROADCAST_GRADIENTS = ("exact", "identity")


def validate_gradient(gradient, name="gradient"):
    """Returns `gradient` if it is "exact" or "identity"; raises otherwise."""
    if not isinstance(gradient, str) or gradient.lower() not in BROADCAST_GRADIENTS:
        _validation.one_of(gradient, BROADCAST_GRADIENTS, name)
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
    * "identity": ``dx = dy`` on every member (MindSpore Broadcast's rule).
      Each member's gradient is then only its own loss's share; it
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
    what = _checks.what("broadcast", name)
    gradient = validate_gradient(gradient)
    x = tf.convert_to_tensor(x)
    D.check_dtype(x, what)
    call = _collective.resolve(group, timeout, name)
    root_index = _checks.member_index(call.group, root, "root", what)

    def forward(x):
        return D.broadcast(x, call, root_index)

    def backward(dy, x, y):
        # TF has no reduce-to-one collective: all-reduce, keep at root.
        total = D.all_reduce(dy, call, "sum")
        return total if call.index == root_index else tf.zeros_like(total)

    return D.collective(x, call, forward, None if gradient == "identity" else backward)


def reduce(x, dest=0, group=None, *, op="sum", timeout=None, name=None):
    """Reduces `x` elementwise over the group into member `dest`.

    Forward: ``y_dest = op(x_0, ..., x_{n-1})``; the other members output
    zeros of the same shape, so every output is well defined and the
    backward below is the exact adjoint (only `dest`'s dy matters).
    Backward, with ``g = dy_dest`` broadcast from `dest` to every member:

    * SUM: ``dx_r = g``.
    * PROD: ``dx_r = g * prod_{t != r} x_t``. The product of the *other*
      members' x comes from an all-gather and an exclusive product (as in
      `all_reduce`), so zeros in x give exact, finite gradients. Costs one
      extra all-gather of x.
    * MAX / MIN: ``dx_r = g * (x_r == y_dest)``; `dest`'s result travels
      with dy in the same broadcast. Convention (as `all_reduce`): on ties
      every tied member receives the full gradient.

    MindSpore: Reduce (its bprop broadcasts dy from dest). Implemented as an
    all-reduce (TF has no reduce-to-one collective).

    Args:
        x: a tensor, same shape on every member.
        dest: the destination's GLOBAL rank; must be in the group.
        group, timeout, name: as for `broadcast`.
        op: a `ReduceOp` or "sum", "prod", "max", "min".

    Raises:
        ValueError: `dest` not in the group, or an unknown `op`.
        TypeError: `dest` not an int, `op` not a `ReduceOp` or string, or an
            unsupported dtype.
    """
    what = _checks.what("reduce", name)
    op = ReduceOp.from_value(op)
    x = tf.convert_to_tensor(x)
    D.check_dtype(x, what)
    call = _collective.resolve(group, timeout, name)
    dest_index = _checks.member_index(call.group, dest, "dest", what)

    def forward(x):
        y = D.all_reduce(x, call, op.value)
        return y if call.index == dest_index else tf.zeros_like(y)

    def backward(dy, x, y):
        if op in (ReduceOp.MAX, ReduceOp.MIN):
            # y is the result only at dest; send it along with dy.
            g, result = tf.unstack(D.broadcast(tf.stack([dy, y]), call, dest_index))
            return g * tf.cast(tf.equal(x, result), dy.dtype)
        g = D.broadcast(dy, call, dest_index)
        if op is ReduceOp.PROD:
            return prod_grad(x, g, call)
        return g

    return D.collective(x, call, forward, backward)
