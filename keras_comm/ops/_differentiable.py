"""The differentiable-collective skeleton and the ops' dtype rule.

Every op in `keras_comm.ops` is a forward and a backward rule handed to
`collective` (or, for ops that move no data forward, to `with_gradient`).
The skeleton supplies what every collective needs around its maths:

* a group of one moves no data: the op is the identity both ways;
* replicas outside the group return `x` and pass their gradient through,
  yet still reach the same `_collective.run` points as the members (SPMD);
* both directions run inside `_collective.run`, which launches the local
  replicas' collectives together in eager mode.

The dtype rule: a tensor goes through a collective in its own dtype, except
where TensorFlow's kernel does not define that dtype. There it travels as
float32, which holds every bfloat16 value exactly, so the rule never changes
a value. In TF 2.21 the all-gather and broadcast kernels (and so send and
receive, which are two-member broadcasts) lack bfloat16; reductions take
every dtype and so always reduce in the tensor's own dtype.
"""

import tensorflow as tf

from keras_comm.ops import _collective

# Dtypes TF's collectives accept (checked on CPU, TF 2.21).
COLLECTIVE_DTYPES = (tf.float16, tf.bfloat16, tf.float32, tf.float64, tf.int32, tf.int64)
FLOAT_DTYPES = (tf.float16, tf.bfloat16, tf.float32, tf.float64)
# Per primitive, the dtypes its kernel lacks; they travel as float32.
_CARRIED_AS_FLOAT32 = {
    "all_gather": (tf.bfloat16,),
    "broadcast": (tf.bfloat16,),
}


def check_dtype(x, what):
    """Raises TypeError unless `x`'s dtype goes through TF's collectives."""
    if x.dtype not in COLLECTIVE_DTYPES:
        raise TypeError(
            f"{what} supports dtypes {[d.name for d in COLLECTIVE_DTYPES]}. "
            f"Received: x.dtype={x.dtype.name}"
        )


def check_float(x, what):
    """Raises TypeError unless `x` is floating (it carries a gradient)."""
    if x.dtype not in FLOAT_DTYPES:
        raise TypeError(
            f"{what} carries gradients and needs a floating dtype "
            f"({', '.join(d.name for d in FLOAT_DTYPES)}). Received: x.dtype={x.dtype.name}"
        )


def check_accumulator(accumulator, shape, what):
    """Raises ValueError unless `accumulator`'s shape is compatible with `shape`."""
    acc_shape = tf.TensorShape(accumulator.shape)
    if not acc_shape.is_compatible_with(shape):
        raise ValueError(
            f"{what}: the accumulator must have the gradient's shape {shape}. "
            f"Received: accumulator.shape={acc_shape}"
        )


def float_input(x, what, accumulator=None):
    """`x` as a floating tensor; with `accumulator`, checks it is shaped like `x`."""
    x = tf.convert_to_tensor(x)
    check_float(x, what)
    if accumulator is not None:
        check_accumulator(accumulator, x.shape, what)
    return x


def carried_dtype(dtype, kind):
    """The dtype a `dtype` tensor travels in through primitive `kind`."""
    return tf.float32 if dtype in _CARRIED_AS_FLOAT32.get(kind, ()) else dtype


def _carried(kind, primitive, x, *args):
    carried = carried_dtype(x.dtype, kind)
    if carried == x.dtype:
        return primitive(x, *args)
    return tf.cast(primitive(tf.cast(x, carried), *args), x.dtype)


# The primitives with the dtype rule applied: what the ops call.


def all_reduce(x, call, op="sum", fusion=0):
    return _collective.all_reduce(x, call, op, fusion)


def all_gather(x, call, fusion=0):
    return _carried("all_gather", _collective.all_gather, x, call, fusion)


def all_to_all(x, call):
    return _carried("all_to_all", _collective.all_to_all, x, call)


def reduce_scatter(x, call, fusion=0):
    return _carried("reduce_scatter", _collective.reduce_scatter, x, call, fusion)


def broadcast(x, call, root_index):
    return _carried("broadcast", _collective.broadcast, x, call, root_index)


def send(x, call, dest, tag=0):
    return _carried("broadcast", _collective.send, x, call, dest, tag)


def recv(shape, dtype, call, src, tag=0):
    carried = carried_dtype(dtype, "broadcast")
    out = _collective.recv(shape, carried, call, src, tag)
    return out if carried == dtype else tf.cast(out, dtype)


# The skeleton.


def with_gradient(x, forward, backward):
    """``forward(x)`` with the backward rule ``backward(dy, x, y)``.

    A local `tf.custom_gradient`: no group logic, no `_collective.run`. `x`
    may be a list of tensors; `forward` then takes and returns lists, and
    `backward` takes the list of output gradients and returns one gradient
    per input.
    """
    several = isinstance(x, (list, tuple))

    @tf.custom_gradient
    def fn(*xs):
        arg = list(xs) if several else xs[0]
        y = forward(arg)

        def grad(*dys):
            return backward(list(dys) if several else dys[0], arg, y)

        return y, grad

    return fn(*x) if several else fn(x)


def everywhere(x, forward, backward):
    """``forward(x)`` with backward ``backward(dy, x, y)``, both on every replica.

    For exchanges whose plan gives each replica its own share of transfers
    (possibly none), so there is no membership test and no group-of-one
    fast path; both directions still run inside `_collective.run`.
    """
    return with_gradient(
        x,
        lambda x: _collective.run(lambda: forward(x)),
        lambda dy, x, y: _collective.run(lambda: backward(dy, x, y)),
    )


def on_members(call, fn, value, active=None):
    """``fn(value)`` on active replicas (default: group members), `value` elsewhere.

    Inside `_collective.run`, so every replica reaches the same point (SPMD).
    For a communication in the middle of a backward rule.
    """
    active = call.member if active is None else active
    return _collective.run(lambda: fn(value) if active else value)


def collective(x, call, forward, backward, *, active=None, sparse_grad=False):
    """The differentiable collective ``forward(x)`` with backward ``backward(dy, x, y)``.

    Args:
        x: the input tensor.
        call: the resolved `_collective.Call`; a group of one makes the op
            the identity both ways.
        forward: ``forward(x) -> y`` on active replicas, or None for the
            identity (an op that communicates only in its backward).
        backward: ``backward(dy, x, y) -> dx`` on active replicas, or None
            for the identity (a gradient that needs no communication).
        active: whether this replica takes part (default: it is a group
            member). Inactive replicas return `x` and pass dy through.
        sparse_grad: hand a ``tf.IndexedSlices`` dy to `backward` as is
            (default: densify it first).
    """
    if call.trivial:
        return tf.identity(x)

    def forward_all(x):
        if forward is None:
            return tf.identity(x)
        return on_members(call, forward, x, active)

    def backward_all(dy, x, y):
        if not (sparse_grad and isinstance(dy, tf.IndexedSlices)):
            dy = tf.convert_to_tensor(dy)
        if backward is None:
            return dy
        return on_members(call, lambda dy: backward(dy, x, y), dy, active)

    return with_gradient(x, forward_all, backward_all)
