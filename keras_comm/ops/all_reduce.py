"""Differentiable all-reduce: SUM, PROD, MAX and MIN over a group.

Also the sparse (``tf.IndexedSlices``) all-reduce and the fused all-reduce of
a nest of tensors (one transfer per dtype).
"""

import tensorflow as tf

from keras_comm.ops import _collective
from keras_comm.ops import _fusion
from keras_comm.ops.reduce_op import ReduceOp

# Dtypes TF's collectives accept (checked on CPU, TF 2.21). all_gather_v2 and
# the broadcast ops reject bfloat16, so those go through float32 (exact).
_COLLECTIVE_DTYPES = (
    tf.float16,
    tf.bfloat16,
    tf.float32,
    tf.float64,
    tf.int32,
    tf.int64,
)


def _check_dtype(x, what):
    if x.dtype not in _COLLECTIVE_DTYPES:
        raise TypeError(
            f"{what} supports dtypes {[d.name for d in _COLLECTIVE_DTYPES]}. "
            f"Received: x.dtype={x.dtype.name}"
        )


def _what(fn_name, name):
    return f"keras_comm.ops.{fn_name} (layer {name!r})" if name else f"keras_comm.ops.{fn_name}"


def _member_index(call, rank, arg, what):
    """The group index of global `rank` (a root/dest/src argument)."""
    if isinstance(rank, bool) or not isinstance(rank, int):
        raise TypeError(f"{what}: `{arg}` must be an int global rank. Received: {arg}={rank!r}")
    if rank not in call.group:
        raise ValueError(
            f"{what}: `{arg}` must be a global rank in the group "
            f"{list(call.group.ranks)}. Received: {arg}={rank!r}"
        )
    return call.group.index(rank)


def _check_divisible(x, axis, n, what, layer_kind):
    """Static check that ``x.shape[axis]`` splits into `n` equal parts."""
    if x.shape.rank is None:
        raise ValueError(f"{what}: the input needs a known rank. Received: x.shape={x.shape}")
    if x.shape.rank == 0:
        raise ValueError(f"{what}: the input must have at least one dimension. Received: x.shape={x.shape}")
    dim = x.shape[axis]
    if dim is not None and dim % n:
        raise ValueError(
            f"{what}: {layer_kind} needs dimension {axis} of the input to be "
            f"divisible by the group size {n}. Received: x.shape={x.shape}"
        )


def _broadcast(x, call, root_index):
    """The broadcast primitive, with bfloat16 carried as float32."""
    if x.dtype == tf.bfloat16:
        return tf.cast(_collective.broadcast(tf.cast(x, tf.float32), call, root_index), tf.bfloat16)
    return _collective.broadcast(x, call, root_index)


def _gather(x, call):
    """The all_gather primitive, with bfloat16 carried as float32."""
    if x.dtype == tf.bfloat16:
        return tf.cast(_collective.all_gather(tf.cast(x, tf.float32), call), tf.bfloat16)
    return _collective.all_gather(x, call)


def all_gather_indexed_slices(slices, call):
    """Concatenates every group member's `tf.IndexedSlices` (rows may differ).

    Members may hold different numbers of rows: the counts are gathered
    first, every member pads to the largest count, indices and values are
    gathered, and the padding is stripped. The result holds every member's
    rows (duplicate indices included, which `IndexedSlices` sums), so it is
    the SUM over the group as a sparse value.

    Private helper shared with the mirror operators. Call it from inside a
    `_collective.run` thunk, and only on group members; it issues three
    collectives.

    Args:
        slices: a `tf.IndexedSlices`; same dense shape on every member.
        call: a resolved `_collective.Call` whose replica is a member.

    Returns:
        A `tf.IndexedSlices` with this member's `dense_shape`.
    """
    indices = slices.indices
    values = slices.values
    count = tf.shape(indices, out_type=tf.int64)[:1]
    counts = _collective.all_gather(count, call)
    max_count = tf.reduce_max(counts)
    pad = max_count - count[0]
    indices = tf.concat([indices, tf.zeros(tf.reshape(pad, [1]), indices.dtype)], 0)
    value_pad = tf.zeros(
        tf.concat([tf.reshape(pad, [1]), tf.shape(values, out_type=tf.int64)[1:]], 0),
        values.dtype,
    )
    values = tf.concat([values, value_pad], 0)
    gathered_indices = _collective.all_gather(indices, call)
    gathered_values = _gather(values, call)
    keep = tf.reshape(tf.sequence_mask(counts, max_count), [-1])
    return tf.IndexedSlices(
        tf.boolean_mask(gathered_values, keep),
        tf.boolean_mask(gathered_indices, keep),
        slices.dense_shape,
    )


def _all_reduce_dense(x, op, call, fusion=0):
    """One differentiable all-reduce of one tensor (call is not trivial).

    `fusion` > 0 packs the forward reduction and the backward SUM of dy with
    the other members of that fusion group (see `_fusion`).
    """

    def reduce_sum(t):
        return _collective.all_reduce(t, call, "sum", fusion)

    @tf.custom_gradient
    def fn(x):
        y = _collective.run(
            lambda: _collective.all_reduce(x, call, op.value, fusion) if call.member else x
        )

        def grad(dy):
            if isinstance(dy, tf.IndexedSlices) and op is ReduceOp.SUM:
                # dx_r = sum_s dy_s, kept sparse: every member's rows.
                return _collective.run(
                    lambda: all_gather_indexed_slices(dy, call) if call.member else dy
                )
            dy = tf.convert_to_tensor(dy)
            if op is ReduceOp.SUM:
                return _collective.run(lambda: reduce_sum(dy) if call.member else dy)
            if op is ReduceOp.PROD:
                return _collective.run(
                    lambda: _prod_grad(x, reduce_sum(dy), call) if call.member else dy
                )
            # MAX / MIN: the full summed gradient goes to every member whose x
            # equals the result; on ties every tied member gets all of it
            # (the reference's convention; a subgradient would split it).
            return _collective.run(
                lambda: reduce_sum(dy) * tf.cast(tf.equal(x, y), dy.dtype)
                if call.member
                else dy
            )

        return y, grad

    return fn(x)


def _prod_grad(x, summed_dy, call):
    # d(prod_t x_t)/dx_r = prod_{t != r} x_t, computed as an exclusive product
    # of the gathered inputs (prefix times suffix): exact, and finite when some
    # x are zero, where the reference's out / x is NaN. Costs one all-gather.
    gathered = _gather(x[tf.newaxis], call)
    others = tf.math.cumprod(gathered, axis=0, exclusive=True) * tf.math.cumprod(
        gathered, axis=0, exclusive=True, reverse=True
    )
    return summed_dy * others[call.index]


def _fused(values, op, call, what, fusion=0):
    """All-reduces a flat list of tensors with one collective per dtype."""
    out = list(values)
    by_dtype = {}
    for i, v in enumerate(values):
        if not isinstance(v, tf.IndexedSlices):
            by_dtype.setdefault(v.dtype, []).append(i)
    for i, v in enumerate(values):
        if isinstance(v, tf.IndexedSlices):
            out[i] = _sparse(v, op, call, what)
    for idxs in by_dtype.values():
        if call.trivial:
            for i in idxs:
                out[i] = tf.identity(values[i])
            continue
        reduced = _fusion.packed(
            [values[i] for i in idxs], lambda t: _all_reduce_dense(t, op, call, fusion)
        )
        for i, r in zip(idxs, reduced):
            out[i] = r
    return out


def _sparse(x, op, call, what):
    if op is not ReduceOp.SUM:
        raise ValueError(
            f"{what}: a tf.IndexedSlices input can only be reduced with op='sum'. "
            f"Received: op={op.value!r}"
        )
    _check_dtype(x.values, what)
    if call.trivial:
        return x
    return _collective.run(
        lambda: all_gather_indexed_slices(x, call) if call.member else x
    )


def all_reduce(x, op="sum", group=None, *, fusion=0, timeout=None, name=None):
    """Reduces `x` elementwise over the group; every member gets the result.

    Forward: ``y = op(x_0, ..., x_{n-1})`` on every member.
    Backward (objective: the sum of every replica's loss):

    * SUM: ``dx = all_reduce_sum(dy)``.
    * PROD: ``dx_r = all_reduce_sum(dy) * prod_{t != r} x_t``. The product of
      the *other* members' x comes from an all-gather and an exclusive
      product, so zeros in x give exact gradients (the reference divides
      ``out / x``, NaN at 0). Costs one extra all-gather of x.
    * MAX / MIN: ``dx_r = all_reduce_sum(dy) * (x_r == y)``. Convention of the
      reference: on ties every tied member receives the full gradient (the
      sum over tied members' gradients is then k times the subgradient).

    Sparse: `x` may be a ``tf.IndexedSlices`` (op SUM only). Its rows are
    all-gathered (members may hold different numbers of rows) and returned as
    one ``tf.IndexedSlices``; this path is for gradients and is not itself
    differentiable. A dense SUM all-reduce whose upstream gradient arrives as
    ``tf.IndexedSlices`` (e.g. ``tf.gather(y, ids)`` downstream) all-gathers
    that gradient the same way instead of densifying it.

    Fusion, within one call: `x` may be a list, tuple or dict (any `tf.nest`
    structure) of tensors. Tensors of one dtype are flattened, concatenated,
    reduced with ONE collective and split back; so is their gradient. The
    result has the structure of `x`.

    Fusion across calls: all-reduces with the same ``fusion`` id > 0 traced
    in one `fusion_scope` (every `model.fit`/`evaluate`/`predict` step is one)
    are packed into ONE collective per (group, op, dtype) -- forward and,
    separately, backward -- the reference's ``fusion`` attribute. An
    all-reduce whose input depends on an earlier member's output starts a new
    pack (it cannot travel with what it waits for). Values are identical to
    unfused calls. In eager mode, nested control flow or with call checking
    on, each call runs on its own. Sparse inputs/gradients are not fused.

    Ranks outside `group` get `x` back unchanged, and their gradient passes
    through unchanged. With a group of one (e.g. outside any strategy) this
    is the identity.

    Dtypes: float16, bfloat16, float32, float64, int32, int64 (int inputs are
    forward-only).

    Args:
        x: a tensor, a ``tf.IndexedSlices``, or a nest of them.
        op: a `ReduceOp` or "sum", "prod", "max", "min".
        group: None (all replicas), a list of global ranks or a `Group`.
        fusion: int >= 0, the fusion group id; 0 (default) never fuses.
        timeout: seconds before a missing peer raises DeadlineExceeded;
            None for `keras_comm.get_timeout()`.
        name: name used in the collective ops' names (a layer's name).

    Returns:
        The reduced value(s), same structure, shapes and dtypes as `x`.

    Raises:
        ValueError: unknown `op`, a group outside the world, a negative
            `fusion`, or a sparse input with an op other than SUM.
        TypeError: an unsupported dtype, or a non-int `fusion`.
    """
    op = ReduceOp.from_value(op)
    fusion = _fusion.validate_fusion(fusion)
    what = _what("all_reduce", name)
    call = _collective.resolve(group, timeout, name)
    if isinstance(x, tf.IndexedSlices):
        return _sparse(x, op, call, what)
    if isinstance(x, (list, tuple, dict)) or tf.nest.is_nested(x):
        flat = [
            v if isinstance(v, tf.IndexedSlices) else tf.convert_to_tensor(v)
            for v in tf.nest.flatten(x, expand_composites=False)
        ]
        for v in flat:
            _check_dtype(v.values if isinstance(v, tf.IndexedSlices) else v, what)
        return tf.nest.pack_sequence_as(x, _fused(flat, op, call, what, fusion))
    x = tf.convert_to_tensor(x)
    _check_dtype(x, what)
    if call.trivial:
        return tf.identity(x)
    return _all_reduce_dense(x, op, call, fusion)
