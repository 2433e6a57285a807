"""Differentiable gathers and scatters along axis 0.

`all_gather` / `reduce_scatter` (every member gets a result) and
`collective_gather` / `collective_scatter` (one member is the destination or
source). Ranks outside the group get `x` back unchanged (so their output
shape is their input shape) and their gradient passes through.
"""

import tensorflow as tf

from keras_comm.ops import _checks
from keras_comm.ops import _collective
from keras_comm.ops import _differentiable as D
from keras_comm.ops import _fusion
from keras_comm.ops.reduce_op import ReduceOp


def _prepare(x, fn_name, name):
    what = _checks.what(fn_name, name)
    x = tf.convert_to_tensor(x)
    D.check_dtype(x, what)
    # Split or concatenated along axis 0.
    _checks.check_known_rank(x.shape, what)
    return x, what


def all_gather(
    x, mean=False, group=None, *, mean_flag=None, fusion=0, timeout=None, name=None
):
    """Concatenates every group member's `x` along axis 0, on every member.

    Forward: ``y = concat([x_0, ..., x_{n-1}], axis=0)`` on every member.
    Backward: ``dx = reduce_scatter_sum(dy)`` (this member's slice of the sum
    of every member's dy), times ``1/n`` if `mean` (for gathered
    parameter shards whose gradients are averaged); the exact adjoint is
    ``mean=False``. MindSpore: AllGather.

    Every member must pass the same shape (TF's all-gather requires it; a
    mismatch fails at run time with InvalidArgument). dtypes: float16,
    bfloat16 (sent as float32), float32, float64, int32, int64.

    Args:
        x: a tensor of rank >= 1.
        mean: scale the gradient by 1/group size (`mean_flag`, its former
            name, is still accepted).
        group: None (all replicas), a list of global ranks or a `Group`.
        fusion: int >= 0; all-gathers (and, separately, their backward
            reduce-scatters) with the same id > 0 traced in one
            `fusion_scope` travel as one collective per (group, dtype), as
            for `all_reduce`. 0 (default) never fuses.
        timeout: seconds; None for `keras_comm.get_timeout()`.
        name: name for the collective ops (a layer's name).

    Returns:
        Shape ``[n * x.shape[0], ...]`` on members; `x` on non-members.
    """
    mean = _checks.mean_argument(mean, mean_flag, False)
    fusion = _fusion.validate_fusion(fusion)
    x, _ = _prepare(x, "all_gather", name)
    call = _collective.resolve(group, timeout, name)

    def forward(x):
        return D.all_gather(x, call, fusion)

    def backward(dy, x, y):
        dx = D.reduce_scatter(dy, call, fusion)
        # tf.constant, not tf.cast: a Python float would pass through
        # float32 first (1/3 off by 1e-8 in float64).
        return dx * tf.constant(1.0 / call.size, dx.dtype) if mean else dx

    return D.collective(x, call, forward, backward)


def reduce_scatter(x, op="sum", group=None, *, fusion=0, timeout=None, name=None):
    """Sums `x` over the group; member i keeps slice i of axis 0.

    Forward: ``y_i = (sum_r x_r)[i*k:(i+1)*k]`` with ``k = x.shape[0] / n``.
    Backward: ``dx = all_gather(dy)`` (exact adjoint).

    On GPUs (NCCL) this is TF's native reduce-scatter; on CPUs, where TF has
    no reduce-scatter kernel, an all-to-all plus a local sum (same bytes).

    Args:
        x: a tensor whose axis 0 is divisible by the group size.
        op: only `ReduceOp.SUM` / "sum" (the only reduction with a
            gradient here). MindSpore: ReduceScatter.
        fusion: int >= 0; reduce-scatters (and, separately, their backward
            all-gathers) with the same id > 0 traced in one `fusion_scope`
            travel as one collective per (group, dtype). 0 never fuses.
        group, timeout, name: as for `all_reduce`.

    Returns:
        Shape ``[x.shape[0] / n, ...]`` on members; `x` on non-members.

    Raises:
        ValueError: `op` is not SUM; axis 0 not divisible by the group size.
    """
    what = _checks.what("reduce_scatter", name)
    op = ReduceOp.from_value(op)
    if op is not ReduceOp.SUM:
        raise ValueError(
            f"{what}: only op='sum' is supported (its gradient is an all-gather). "
            f"Received: op={op.value!r}"
        )
    fusion = _fusion.validate_fusion(fusion)
    x, what = _prepare(x, "reduce_scatter", name)
    call = _collective.resolve(group, timeout, name)
    _checks.check_divisible(x.shape, 0, call.size, what)

    def forward(x):
        return D.reduce_scatter(x, call, fusion)

    def backward(dy, x, y):
        return D.all_gather(dy, call, fusion)

    return D.collective(x, call, forward, backward)


def collective_gather(x, dest=0, group=None, *, timeout=None, name=None):
    """Concatenates every member's `x` along axis 0 at member `dest`.

    Forward: at `dest`, ``concat([x_0, ..., x_{n-1}], axis=0)``; the other
    members output zeros of the same shape (so every member's output has one
    shape, and the backward below is the exact adjoint). MindSpore:
    CollectiveGather.
    Backward: broadcast dy from `dest`; each member keeps its own slice
    ``dy_dest[i*k:(i+1)*k]``.

    Implemented with an all-gather (TF has no gather-to-one collective): it
    moves n times the bytes a gather-to-one needs.

    Args:
        x: a tensor of rank >= 1, same shape on every member.
        dest: the destination's GLOBAL rank; must be in the group.
        group, timeout, name: as for `all_reduce`.

    Returns:
        Shape ``[n * x.shape[0], ...]`` on members; `x` on non-members.

    Raises:
        ValueError: `dest` not in the group. TypeError: `dest` not an int.
    """
    x, what = _prepare(x, "collective_gather", name)
    call = _collective.resolve(group, timeout, name)
    dest_index = _checks.member_index(call.group, dest, "dest", what)

    def forward(x):
        gathered = D.all_gather(x, call)
        return gathered if call.index == dest_index else tf.zeros_like(gathered)

    def backward(dy, x, y):
        k = tf.shape(x)[0]
        full = D.broadcast(dy, call, dest_index)
        return full[call.index * k : (call.index + 1) * k]

    return D.collective(x, call, forward, backward)


def collective_scatter(x, src=0, group=None, *, timeout=None, name=None):
    """Splits `src`'s `x` along axis 0; group member i receives slice i.

    Forward: ``y_i = x_src[i*k:(i+1)*k]`` with ``k = x.shape[0] / n``. Every
    member passes a tensor of the same shape (only `src`'s values are used;
    the others give shape and dtype).
    Backward: gather dy at `src` (``dx_src = concat(dy_0 .. dy_{n-1})``);
    zeros on the other members (their x does not affect the output): the
    exact adjoint.

    Implemented with one all-to-all (src sends slice i to member i).
    MindSpore: CollectiveScatter.

    Args:
        x: a tensor whose axis 0 is divisible by the group size.
        src: the source's GLOBAL rank; must be in the group.
        group, timeout, name: as for `all_reduce`.

    Returns:
        Shape ``[x.shape[0] / n, ...]`` on members; `x` on non-members.

    Raises:
        ValueError: `src` not in the group; axis 0 not divisible by the group
            size. TypeError: `src` not an int.
    """
    x, what = _prepare(x, "collective_scatter", name)
    call = _collective.resolve(group, timeout, name)
    src_index = _checks.member_index(call.group, src, "src", what)
    _checks.check_divisible(x.shape, 0, call.size, what)
    n = call.size

    def forward(x):
        shape = tf.shape(x)
        chunks = tf.reshape(x, tf.concat([[n, shape[0] // n], shape[1:]], 0))
        if call.index != src_index:
            chunks = tf.zeros_like(chunks)
        return D.all_to_all(chunks, call)[src_index]

    def backward(dy, x, y):
        gathered = D.all_gather(dy, call)
        return gathered if call.index == src_index else tf.zeros_like(gathered)

    return D.collective(x, call, forward, backward)
