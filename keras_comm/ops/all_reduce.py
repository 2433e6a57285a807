"""Differentiable all-reduce: SUM, PROD, MAX and MIN over a group.

Also the sparse (``tf.IndexedSlices``) all-reduce and the fused all-reduce of
a nest of tensors (one transfer per dtype).
"""

import tensorflow as tf

from keras_comm.ops import _checks
from keras_comm.ops import _collective
from keras_comm.ops import _differentiable as D
from keras_comm.ops import _fusion
from keras_comm.ops.reduce_op import ReduceOp
from keras_comm.variables import packing


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
    counts = D.all_gather(count, call)
    max_count = tf.reduce_max(counts)
    pad = max_count - count[0]
    indices = tf.concat([indices, tf.zeros(tf.reshape(pad, [1]), indices.dtype)], 0)
    value_pad = tf.zeros(
        tf.concat([tf.reshape(pad, [1]), tf.shape(values, out_type=tf.int64)[1:]], 0),
        values.dtype,
    )
    values = tf.concat([values, value_pad], 0)
    gathered_indices = D.all_gather(indices, call)
    gathered_values = D.all_gather(values, call)
    keep = tf.reshape(tf.sequence_mask(counts, max_count), [-1])
    return tf.IndexedSlices(
        tf.boolean_mask(gathered_values, keep),
        tf.boolean_mask(gathered_indices, keep),
        slices.dense_shape,
    )


def _all_reduce_dense(x, op, call, fusion=0):
    """One differentiable all-reduce of one tensor.

    `fusion` > 0 packs the forward reduction and the backward SUM of dy with
    the other members of that fusion group (see `_fusion`).
    """

    def forward(x):
        return D.all_reduce(x, call, op.value, fusion)

    def backward(dy, x, y):
        if isinstance(dy, tf.IndexedSlices):
            # dx_r = (sum_s dy_s) * factor_r, elementwise: the summed rows
            # stay sparse (every member's rows; duplicates add up, and
            # scaling each piece of a row by the row's factor is linear).
            total = all_gather_indexed_slices(dy, call)
            if op is ReduceOp.SUM:
                return total
            if op is ReduceOp.PROD:
                factor = prod_grad(x, tf.ones([], x.dtype), call)
            else:
                factor = tf.cast(tf.equal(x, y), dy.dtype)
            return tf.IndexedSlices(
                total.values * tf.gather(factor, total.indices), total.indices, total.dense_shape
            )
        total = D.all_reduce(dy, call, "sum", fusion)
        if op is ReduceOp.SUM:
            return total
        if op is ReduceOp.PROD:
            return prod_grad(x, total, call)
        # MAX / MIN: the full summed gradient goes to every member whose x
        # equals the result; on ties every tied member gets all of it (a
        # subgradient would split it).
        return total * tf.cast(tf.equal(x, y), dy.dtype)

    return D.collective(x, call, forward, backward, sparse_grad=True)


def prod_grad(x, summed_dy, call):
    """``summed_dy * prod_{t != r} x_t`` on member r (private; shared with reduce)."""
    # d(prod_t x_t)/dx_r = prod_{t != r} x_t, computed as an exclusive product
    # of the gathered inputs (prefix times suffix): exact, and finite when some
    # x are zero, where out / x would be NaN. Costs one all-gather.
    gathered = D.all_gather(x[tf.newaxis], call)
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
        reduced = packing.packed(
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
    D.check_dtype(x.values, what)
    if call.trivial:
        return x
    return D.on_members(call, lambda x: all_gather_indexed_slices(x, call), x)


def all_reduce(x, op="sum", group=None, *, fusion=0, timeout=None, name=None):
    """Reduces `x` elementwise over the group; every member gets the result.

    Forward: ``y = op(x_0, ..., x_{n-1})`` on every member.
    Backward (objective: the sum of every replica's loss):

    * SUM: ``dx = all_reduce_sum(dy)``.
    * PROD: ``dx_r = all_reduce_sum(dy) * prod_{t != r} x_t``. The product of
      the *other* members' x comes from an all-gather and an exclusive
      product, so zeros in x give exact gradients (``out / x`` would be NaN
      at 0). Costs one extra all-gather of x.
    * MAX / MIN: ``dx_r = all_reduce_sum(dy) * (x_r == y)``. Convention: on
      ties every tied member receives the full gradient (the sum over tied
      members' gradients is then k times the subgradient).

    Sparse: `x` may be a ``tf.IndexedSlices`` (op SUM only). Its rows are
    all-gathered (members may hold different numbers of rows) and returned as
    one ``tf.IndexedSlices``; this path is for gradients and is not itself
    differentiable. A dense all-reduce whose upstream gradient arrives as
    ``tf.IndexedSlices`` (e.g. ``tf.gather(y, ids)`` downstream) all-gathers
    that gradient the same way instead of densifying it, with every op: for
    PROD, MAX and MIN the gathered rows are multiplied by the rows of the
    dense factor (``prod_{t != r} x_t``, or ``x_r == y``), which the rule
    above applies elementwise.

    Fusion, within one call: `x` may be a list, tuple or dict (any `tf.nest`
    structure) of tensors. Tensors of one dtype are flattened, concatenated,
    reduced with ONE collective and split back; so is their gradient. The
    result has the structure of `x`.

    Fusion across calls: all-reduces with the same ``fusion`` id > 0 traced
    in one `fusion_scope` (every `model.fit`/`evaluate`/`predict` step is one)
    are packed into ONE collective per (group, op, dtype) -- forward and,
    separately, backward. An
    all-reduce whose input depends on an earlier member's output starts a new
    pack (it cannot travel with what it waits for). Values are identical to
    unfused calls. In eager mode, nested control flow or with call checking
    on, each call runs on its own. Sparse inputs/gradients are not fused.

    Ranks outside `group` get `x` back unchanged, and their gradient passes
    through unchanged. With a group of one (e.g. outside any strategy) this
    is the identity.

    Dtypes: float16, bfloat16, float32, float64, int32, int64 (int inputs are
    forward-only). MindSpore: AllReduce (``fusion`` is its fusion attribute).

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
    what = _checks.what("all_reduce", name)
    call = _collective.resolve(group, timeout, name)
    if isinstance(x, tf.IndexedSlices):
        return _sparse(x, op, call, what)
    if isinstance(x, (list, tuple, dict)) or tf.nest.is_nested(x):
        flat = [
            v if isinstance(v, tf.IndexedSlices) else tf.convert_to_tensor(v)
            for v in tf.nest.flatten(x, expand_composites=False)
        ]
        for v in flat:
            D.check_dtype(v.values if isinstance(v, tf.IndexedSlices) else v, what)
        return tf.nest.pack_sequence_as(x, _fused(flat, op, call, what, fusion))
    x = tf.convert_to_tensor(x)
    D.check_dtype(x, what)
    if call.trivial:
        return tf.identity(x)
    return _all_reduce_dense(x, op, call, fusion)
