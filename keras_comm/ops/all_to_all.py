"""Differentiable all-to-all with split and concat dimensions."""

import tensorflow as tf

from keras_comm import _validation
from keras_comm.ops import _checks
from keras_comm.ops import _collective
from keras_comm.ops import _differentiable as D


def _exchange(x, call, split_dim, concat_dim):
    # Chunks are made and merged with reshapes, which copy nothing; a
    # transpose (one copy) is needed only for a split or concat axis other
    # than 0.
    n = call.size
    rank = x.shape.rank
    shape = tf.shape(x)
    chunks = tf.reshape(
        x,
        tf.concat([shape[:split_dim], [n, shape[split_dim] // n], shape[split_dim + 1 :]], 0),
    )
    if split_dim != 0:
        chunks = tf.transpose(chunks, [split_dim] + [i for i in range(rank + 1) if i != split_dim])
    received = D.all_to_all(chunks, call)  # [n, *chunk shape]
    if concat_dim != 0:
        received = tf.transpose(
            received,
            list(range(1, concat_dim + 1)) + [0] + list(range(concat_dim + 1, rank + 1)),
        )
    shape = tf.shape(received)
    out = tf.reshape(
        received,
        tf.concat([shape[:concat_dim], [n * shape[concat_dim + 1]], shape[concat_dim + 2 :]], 0),
    )
    static = x.shape.as_list()
    if static[split_dim] is not None:
        static[split_dim] //= n
    if static[concat_dim] is not None:
        static[concat_dim] *= n
    out.set_shape(static)
    return out


def all_to_all(x, split_count, split_dim, concat_dim, group=None, *, timeout=None, name=None):
    """Exchanges chunks of `x` between all group members.

    Forward: split `x` along `split_dim` into `split_count` equal chunks;
    chunk i goes to group member i; the chunks received (in member order)
    are concatenated along `concat_dim`. The output shape is the input
    shape with ``split_dim`` divided and ``concat_dim`` multiplied by the
    group size.
    Backward: the same all-to-all with `split_dim` and `concat_dim`
    swapped (exact adjoint: all-to-all is a permutation of the chunks).
    MindSpore: AlltoAll.

    Args:
        x: a tensor of known rank; same shape on every member.
        split_count: must equal the group size.
        split_dim: axis to split (negative counts from the end).
        concat_dim: axis to concatenate along (negative allowed).
        group: None (all replicas), a list of global ranks or a `Group`.
        timeout: seconds; None for `keras_comm.get_timeout()`.
        name: name for the collective ops (a layer's name).

    Returns:
        The exchanged tensor on members; `x` unchanged on non-members.

    Raises:
        ValueError: `split_count` differs from the group size, a dim is out
            of range, or ``x.shape[split_dim]`` is not divisible.
        TypeError: a non-int argument or an unsupported dtype.
    """
    what = _checks.what("all_to_all", name)
    _validation.integer(split_count, "split_count")
    x = tf.convert_to_tensor(x)
    D.check_dtype(x, what)
    _checks.check_known_rank(x.shape, what)
    rank = x.shape.rank
    split_dim = _checks.normalize_axis(split_dim, rank, "split_dim", what)
    concat_dim = _checks.normalize_axis(concat_dim, rank, "concat_dim", what)
    call = _collective.resolve(group, timeout, name)
    if split_count != call.size:
        raise ValueError(
            f"{what}: `split_count` must equal the group size {call.size}. "
            f"Received: split_count={split_count}"
        )
    _checks.check_divisible(x.shape, split_dim, call.size, what)

    def forward(x):
        return _exchange(x, call, split_dim, concat_dim)

    def backward(dy, x, y):
        return _exchange(dy, call, concat_dim, split_dim)

    return D.collective(x, call, forward, backward)
