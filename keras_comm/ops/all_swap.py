"""Differentiable variable-size exchange: `all_swap`."""

import tensorflow as tf

from keras_comm.ops import _checks
from keras_comm.ops import _collective
from keras_comm.ops import _differentiable as D


def _pack(x, sizes, n, width):
    """Rows of x grouped by destination -> [n, width, ...], zero padded."""
    sizes = tf.cast(sizes, tf.int32)
    offsets = tf.cumsum(sizes, exclusive=True)
    total = tf.shape(x)[0]
    k = tf.range(width)[tf.newaxis, :]
    idx = tf.where(k < sizes[:, tf.newaxis], offsets[:, tf.newaxis] + k, total)
    padded = tf.concat([x, tf.zeros_like(x[:1])], 0)
    return tf.gather(padded, idx)


def _unpack(received, sizes, width):
    """[n, width, ...] -> the first sizes[j] rows of each j, concatenated."""
    return tf.boolean_mask(received, tf.sequence_mask(sizes, width))


def all_swap(x, send_sizes, recv_sizes=None, group=None, *, timeout=None, name=None):
    """Variable-size exchange: member i sends ``send_sizes[j]`` rows to member j.

    `x`'s rows are grouped by destination in group order: the first
    ``send_sizes[0]`` rows go to the group's first member, and so on. The
    result concatenates, in group order, the rows every member sent here.

    Forward: ``concat_j(rows member j sent to me)``. Backward: AllSwap of dy
    with the sizes swapped (each member sends back the gradient rows of what
    it received). The exact adjoint; the sizes get no gradient.
    MindSpore: AllSwap.

    Implementation and bytes moved: one all-gather of the n x n size matrix
    (n int32 per member) so every member knows the largest block M and what
    it receives, then one all-to-all of ``[n, M, ...]`` blocks padded with
    zeros: each member puts ``(n - 1) * M`` rows on the wire instead of the
    ``sum_{j != me} send_sizes[j]`` it needs. Balanced sizes cost nothing
    extra; a skewed pattern costs up to n times the payload.

    Args:
        x: rows to send, ``sum(send_sizes)`` of them (axis 0).
        send_sizes: n ints (a list or a 1-D int tensor), one per member.
        recv_sizes: optional n ints, what each member sends here; if given, it
            is checked at run time against what the members actually send
            (InvalidArgumentError on a mismatch). Without it, it is derived
            from the gathered sizes.
        group: member ranks; None = the world. Non-members return `x`.
        timeout: seconds before DeadlineExceeded.
        name: op name (the layer's name).

    Returns:
        ``sum(recv_sizes)`` rows.

    Raises:
        ValueError: if the sizes do not have one entry per member, or the
            static row count of `x` differs from ``sum(send_sizes)``.
    """
    what = _checks.what("all_swap", name)
    x = tf.convert_to_tensor(x)
    send_sizes = tf.cast(tf.convert_to_tensor(send_sizes), tf.int32)
    call = _collective.resolve(group, timeout, name)
    n = call.size
    for arg, v in (("send_sizes", send_sizes), ("recv_sizes", recv_sizes)):
        if v is None:
            continue
        shape = tf.convert_to_tensor(v).shape
        if shape.rank != 1 or (shape[0] is not None and shape[0] != n):
            raise ValueError(
                f"{what}: `{arg}` must be a 1-D list of {n} sizes, one per group "
                f"member. Received: {arg} with shape {tuple(shape)}"
            )
    static = tf.get_static_value(send_sizes)
    if static is not None:
        if (static < 0).any():
            raise ValueError(f"{what}: `send_sizes` must be >= 0. Received: send_sizes={static.tolist()}")
        if x.shape.rank and x.shape[0] is not None and x.shape[0] != int(static.sum()):
            raise ValueError(
                f"{what}: `x` must have sum(send_sizes)={int(static.sum())} rows. "
                f"Received: x.shape={tuple(x.shape)}, send_sizes={static.tolist()}"
            )
    state = {}

    def forward(x):
        with tf.device(call.device):
            matrix = tf.reshape(D.all_gather(send_sizes, call), [n, n])
            width = tf.reduce_max(matrix)
            recv_from = matrix[:, call.index]
            checks = []
            if recv_sizes is not None:
                checks.append(tf.debugging.assert_equal(
                    tf.cast(recv_sizes, tf.int32), recv_from,
                    message=f"{what}: `recv_sizes` differ from what the members send",
                ))
            state.update(width=width, recv_from=recv_from)
            with tf.control_dependencies(checks):
                received = D.all_to_all(_pack(x, send_sizes, n, width), call)
            return _unpack(received, recv_from, width)

    def backward(dy, x, y):
        # The same exchange with the sizes swapped.
        with tf.device(call.device):
            width = state["width"]
            received = D.all_to_all(_pack(dy, state["recv_from"], n, width), call)
            return _unpack(received, send_sizes, width)

    return D.collective(x, call, forward, backward)


__all__ = ["all_swap"]
