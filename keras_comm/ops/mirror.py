"""Mirror operators of data parallelism, with and without gradient accumulation.

A *mirror* sits between a parameter that every replica holds a copy of and
its use: forward it is the identity, backward it all-reduces the parameter's
gradient so that every copy receives the gradient of the global objective.
The accumulation variants (``*_mini_step_*``, ``*_micro_step_*``) add the
gradient into a per-replica accumulator variable first and communicate only
when the accumulated gradient is released.

Every op returns the gradient a Keras optimizer applies: an op that
accumulates owns its buffer, adds dy into it and returns what is released
(zeros until then), so no gradient is counted twice.

Gradient convention: the objective is the SUM of every replica's loss. For a
mirrored parameter ``theta`` used on every replica, ``dL/dtheta = sum_r dy_r``:
``mean=False`` is that exact adjoint; ``mean=True`` (the default)
divides it by the group size, the gradient of the MEAN of the replicas'
losses.

Accumulators are variables the caller owns (the Keras layers create them):
``synchronization=ON_READ, aggregation=NONE`` variables created under the
strategy's scope, so each replica keeps its own value. Initialise them to
zeros. Their dtype may be wider than the gradient's (e.g. float32 under a
mixed_float16 policy); gradients are cast in and out.
"""

import tensorflow as tf

from keras_comm import _validation
from keras_comm.ops import _checks
from keras_comm.ops import _collective
from keras_comm.ops import _differentiable as D
from keras_comm.ops import _fusion
from keras_comm.ops.all_reduce import all_gather_indexed_slices
from keras_comm.ops.local_norm import record_local_norm


def _scale(x, mean, call):
    if mean and call.size > 1:
        return x * tf.constant(1.0 / call.size, x.dtype)
    return x


def _reduced(total, mean, call, fusion=0):
    """The SUM of `total` over the group, scaled by 1/size if `mean`."""
    return _scale(D.all_reduce(total, call, "sum", fusion), mean, call)


def _add_into(accumulator, dy):
    """accumulator += dy (cast to the accumulator's dtype); returns the op."""
    return accumulator.assign_add(tf.cast(dy, accumulator.dtype), read_value=False)


def _take(accumulator, dtype):
    """Reads the accumulator as `dtype`, then resets it to zeros."""
    value = tf.cast(accumulator.read_value(), dtype)
    with tf.control_dependencies([value]):
        reset = accumulator.assign(tf.zeros_like(accumulator), read_value=False)
    with tf.control_dependencies([reset]):
        return tf.identity(value)


def _counts_step(step, accumulation_steps):
    """Advances the step counter; returns whether this is an update step."""
    new_step = step.assign_add(tf.ones([], step.dtype))
    return tf.equal(new_step % tf.cast(accumulation_steps, step.dtype), 0)


def _branch(pred, true_fn, false_fn):
    # Eager: a Python branch, so that the in-process replicas' merge_call is
    # never inside control flow. Every replica's counter holds the same value,
    # so every replica takes the same branch (the SPMD rule).
    if tf.executing_eagerly():
        return true_fn() if bool(pred) else false_fn()
    return tf.cond(pred, true_fn, false_fn)


# ---------------------------------------------------------------------------
# MirrorOperator
# ---------------------------------------------------------------------------


def mirror_operator(
    x, mean=True, group=None, *, mean_flag=None, fusion=0, local_norm=None, timeout=None, name=None
):
    """Marks `x` as a copy of a parameter mirrored over the group.

    Forward: identity.
    Backward: ``dx = all_reduce_sum(dy)`` over the group, times
    ``1 / group_size`` if `mean`. A sparse ``tf.IndexedSlices`` dy (e.g.
    from an embedding lookup) has its indices and values all-gathered instead
    (members may hold different numbers of rows), times ``1 / group_size``
    on the values if `mean`: the same sum, kept sparse.

    Convention: ``mean=False`` is the exact adjoint for the SUM
    objective (each copy receives ``dL/dtheta = sum_r dy_r``);
    ``mean=True``, the default, is the gradient of the MEAN of the
    replicas' losses. MindSpore: _MirrorOperator. Ranks outside `group` get `x` back and their
    gradient passes through unchanged. With a group of one this is
    ``tf.identity`` both ways (no scaling).

    Fusion: mirrors (and all-reduces) with the same ``fusion`` id > 0 traced
    in one `fusion_scope` -- every `model.fit` step is one -- send their
    dense backward reductions as ONE collective per (group, dtype), as
    MindSpore's fusion attribute and Horovod's tensor fusion do. Mirrors of
    parameters always qualify: their gradients do not depend on each other.
    See `keras_comm.ops.all_reduce` for the rules.

    Args:
        x: a floating tensor (a parameter or its copy).
        mean: divide the reduced gradient by the group size (`mean_flag`,
            its former name, is still accepted).
        group: None (all replicas), a list of global ranks or a `Group`.
        fusion: int >= 0, the fusion group id; 0 (default) never fuses.
        local_norm: None, or a per-replica float32 scalar variable that the
            backward sets to the L2 norm of this replica's dy before it is
            reduced (MindSpore: dump_local_norm).
        timeout: seconds before a missing peer raises DeadlineExceeded.
        name: name for the collective ops (a layer's name).

    Returns:
        `x`, unchanged.

    Raises:
        TypeError: a non-floating `x`, a non-bool `mean` or a non-int
            `fusion`.
        ValueError: a group outside the world or a negative `fusion`.
    """
    mean = _checks.mean_argument(mean, mean_flag, True)
    fusion = _fusion.validate_fusion(fusion)
    x = D.float_input(x, _checks.what("mirror_operator", name))
    call = _collective.resolve(group, timeout, name)

    def backward(dy, x, y):
        if isinstance(dy, tf.IndexedSlices):
            g = all_gather_indexed_slices(dy, call)
            return tf.IndexedSlices(_scale(g.values, mean, call), g.indices, g.dense_shape)
        return _reduced(dy, mean, call, fusion)

    y = D.collective(x, call, None, backward, sparse_grad=True)
    if local_norm is None:
        return y
    # Closer to the loss than the mirror: sees dy before it is reduced.
    return D.with_gradient(y, tf.identity, lambda dy, x, y: record_local_norm(local_norm, dy))


# ---------------------------------------------------------------------------
# MirrorMiniStepOperator: gradient accumulation over mini-steps.
# ---------------------------------------------------------------------------


def mirror_mini_step_operator(
    x,
    accumulator,
    step,
    accumulation_steps,
    mean=True,
    group=None,
    *,
    mean_flag=None,
    timeout=None,
    name=None,
):
    """Mirror with gradient accumulation: communicates once per `accumulation_steps`.

    Forward: identity.
    Backward (one call per mini-step): ``accumulator += dy``; ``step += 1``.
    Then:

    * update step (``step % accumulation_steps == 0``):
      ``dx = all_reduce_sum(accumulator)`` over the group (times
      ``1 / group_size`` if `mean`), and the accumulator is reset to
      zeros. dx is the SUM over the last `accumulation_steps` mini-steps and
      over the group of dy (not divided by `accumulation_steps`).
    * other steps: ``dx = zeros`` and no communication.

    So the sum of the gradients returned over one accumulation cycle is the
    mirrored gradient of the whole cycle, and an optimizer applies it once.

    The op owns the buffer: non-update steps return zeros, so nothing is
    counted twice. A sparse dy is densified and accumulated. MindSpore:
    _MirrorMiniStepOperator.

    Replicas outside `group` accumulate and release their own (unreduced,
    unscaled) sum on the update step, as a group of one.

    Args:
        x: a floating tensor.
        accumulator: a per-replica variable shaped like `x`, initially zeros.
        step: a per-replica integer variable counting backward calls,
            initially 0.
        accumulation_steps: int >= 1, mini-steps per update.
        mean: divide the reduced gradient by the group size (`mean_flag`,
            its former name, is still accepted).
        group, timeout, name: as in `mirror_operator`.

    Returns:
        `x`, unchanged.
    """
    mean = _checks.mean_argument(mean, mean_flag, True)
    _validation.accumulation_steps(accumulation_steps)
    x = D.float_input(x, _checks.what("mirror_mini_step_operator", name), accumulator)
    call = _collective.resolve(group, timeout, name)

    def backward(dy, x, y):
        dy = tf.convert_to_tensor(dy)
        with tf.control_dependencies([_add_into(accumulator, dy)]):
            update = _counts_step(step, accumulation_steps)

        def release():
            total = _take(accumulator, dy.dtype)
            if call.trivial:
                return total
            return D.on_members(call, lambda t: _reduced(t, mean, call), total)

        return _branch(update, release, lambda: tf.zeros_like(dy))

    return D.with_gradient(x, tf.identity, backward)


# ---------------------------------------------------------------------------
# MirrorMicroStepOperator: pipeline micro-steps.
# ---------------------------------------------------------------------------


def optimizer_shard_size_argument(optimizer_shard, optimizer_shard_size):
    """Validates `optimizer_shard_size` (None, or an int >= 1 with `optimizer_shard`)."""
    _validation.boolean(optimizer_shard, "optimizer_shard")
    if optimizer_shard_size is None:
        return None
    size = _validation.positive_int(optimizer_shard_size, "optimizer_shard_size")
    if not optimizer_shard:
        raise ValueError(
            "`optimizer_shard_size` describes a sharded optimizer and needs "
            "optimizer_shard=True. Received: optimizer_shard=False, "
            f"optimizer_shard_size={optimizer_shard_size!r}"
        )
    return size


def same_shard_ranks(ranks, index, shard_size):
    """The members of `ranks` holding the same optimizer shard as member `index`.

    The sharded optimizer's groups are consecutive blocks of `shard_size`
    members; member i holds shard ``i % shard_size`` of its block, and so do
    the members at the same position in every other block (a pure function,
    tested without a cluster).

    Raises:
        ValueError: if `shard_size` does not divide the number of members.
    """
    ranks = list(ranks)
    if len(ranks) % shard_size:
        raise ValueError(
            "`optimizer_shard_size` must divide the mirror group's size "
            f"{len(ranks)}. Received: optimizer_shard_size={shard_size}"
        )
    return ranks[index % shard_size :: shard_size]


def mirror_micro_step_operator(
    x,
    accumulator,
    mean=True,
    group=None,
    optimizer_shard=False,
    *,
    optimizer_shard_size=None,
    local_norm=None,
    fusion=0,
    mean_flag=None,
    timeout=None,
    name=None,
):
    """Mirror at the end of pipeline micro-steps: reduces the accumulated gradient.

    In pipeline training each micro-batch's gradient of a parameter is added
    into `accumulator` (e.g. by `virtual_assign_add` on the micro-batch's
    path); the mirror's backward runs once, after them, and releases it.

    Forward: identity.
    Backward: ``total = accumulator + dy`` (read after dy is computed), the
    accumulator is reset to zeros, and

    * ``optimizer_shard=False``: ``dx = all_reduce_sum(total)`` over the
      group, times ``1 / group_size`` if `mean`;
    * ``optimizer_shard=True``: a sharded optimizer will reduce dx over its
      own groups, consecutive blocks of `optimizer_shard_size` members of
      `group`; this op all-reduces ``total`` over the members that hold the
      same shard (the same position in every block), times ``1 / (group_size
      / optimizer_shard_size)`` if `mean`. The two reductions together sum
      over the whole group once (each gradient counted once). With
      ``optimizer_shard_size=None`` (the default) the optimizer's group is
      the whole group, as `keras_comm.callbacks.ParallelOptimizer` shards:
      then every shard is held once and ``dx = total``, no communication.
      MindSpore all-reduces over its mirror group here too: its mirror group
      is the members holding the same shard.

    dy itself is added, so with no other writer this is `mirror_operator`,
    and the reduced gradient is returned (the buffer is left at zeros),
    since a Keras optimizer reads the gradient. MindSpore:
    _MirrorMicroStepOperator.

    Replicas outside `group` release ``total`` unreduced and unscaled.

    Args:
        x: a floating tensor.
        accumulator: a per-replica variable shaped like `x`, initially zeros.
        mean: divide the reduced gradient by the number of members it is
            reduced over (`mean_flag`, its former name, is still accepted).
        group, timeout, name: as in `mirror_operator`.
        optimizer_shard: a sharded optimizer reduces the returned gradient
            further (over blocks of `optimizer_shard_size` members).
        optimizer_shard_size: int >= 1 dividing the group size, or None for
            the whole group; only with `optimizer_shard`.
        local_norm: None, or a per-replica float32 scalar variable that the
            backward sets to the L2 norm of ``total``, the accumulated local
            gradient before any reduction (MindSpore: dump_local_norm).
        fusion: int >= 0; the backward all-reduces of micro-step mirrors (and
            all-reduces) with one id > 0 travel as one collective per step,
            as for `mirror_operator`.

    Returns:
        `x`, unchanged.
    """
    mean = _checks.mean_argument(mean, mean_flag, True)
    fusion = _fusion.validate_fusion(fusion)
    shard_size = optimizer_shard_size_argument(optimizer_shard, optimizer_shard_size)
    x = D.float_input(x, _checks.what("mirror_micro_step_operator", name), accumulator)
    call = _collective.resolve(group, timeout, name)
    if optimizer_shard:
        size = call.size if shard_size is None else shard_size
        index = call.index if call.member else 0
        ranks = same_shard_ranks(call.group.ranks, index, size)
        if call.member:
            call = _collective.resolve(ranks, timeout, name)
        elif len(ranks) == 1:
            call = _collective.resolve([call.replica.rank], timeout, name)
    reduce = not call.trivial

    def backward(dy, x, y):
        dy = tf.convert_to_tensor(dy)
        with tf.control_dependencies([_add_into(accumulator, dy)]):
            total = _take(accumulator, dy.dtype)
        total = record_local_norm(local_norm, total)
        if not reduce:
            return total
        return D.on_members(call, lambda t: _reduced(t, mean, call, fusion), total)

    return D.with_gradient(x, tf.identity, backward)


# ---------------------------------------------------------------------------
# Mini/MicroStepAllGather: all-gather of a parameter shard with accumulation.
# ---------------------------------------------------------------------------


def _gather_forward(x, call, fusion=0):
    if call.trivial:
        return tf.identity(x)
    y = D.on_members(call, lambda x: D.all_gather(x, call, fusion), x)
    if call.member and x.shape.rank is not None:
        # The collective loses the static leading dimension; restore it.
        lead = None if x.shape[0] is None else x.shape[0] * call.size
        y.set_shape(tf.TensorShape([lead]).concatenate(x.shape[1:]))
    return y


def _gathered_input(x, accumulator, fn_name, group, timeout, name, accumulator_rows="gathered"):
    """(x, call) for an all-gather whose gradient accumulates in `accumulator`.

    The accumulator holds the gradient of the gathered output (group-size
    times x's rows) when `accumulator_rows` is "gathered", of x itself (this
    member's shard) when "shard", and is not used when None; non-members
    never touch it.
    """
    what = _checks.what(fn_name, name)
    x = D.float_input(x, what)
    call = _collective.resolve(group, timeout, name)
    _checks.check_divisible(x.shape, 0, 1, what)
    if call.member and accumulator_rows == "shard":
        D.check_accumulator(accumulator, x.shape, what)
    elif call.member and accumulator_rows == "gathered":
        full = tf.TensorShape([None if x.shape[0] is None else x.shape[0] * call.size]).concatenate(
            x.shape[1:]
        )
        D.check_accumulator(accumulator, full, what)
    return x, call


def _own_rows(total, x, call):
    # This member's rows of a gradient of the gathered output: the part that
    # belongs to its own shard, with no communication.
    if call.trivial:
        return total
    rows = tf.shape(x)[0]
    return total[call.index * rows : (call.index + 1) * rows]


def _scatter_total(total, mean, call, fusion=0):
    # A member's share of the accumulated gathered gradient: its slice of
    # the reduce-scatter SUM (the whole total in a group of one).
    if call.trivial:
        return _scale(total, mean, call)
    return _collective.run(lambda: _scale(D.reduce_scatter(total, call, fusion), mean, call))


def mini_step_all_gather(
    x,
    accumulator,
    step,
    accumulation_steps=1,
    mean=True,
    group=None,
    *,
    shard_accumulator=False,
    fusion=0,
    mean_flag=None,
    timeout=None,
    name=None,
):
    """All-gathers a parameter shard; accumulates its gradient over mini-steps.

    Forward: ``y = concat([x_0, ..., x_{n-1}], axis=0)`` over the group (every
    member's shard has the same shape).
    Backward (one call per mini-step), ``shard_accumulator=False`` (the
    default): ``accumulator += dy`` (dy has y's shape); ``step += 1``. Then:

    * update step (``step % accumulation_steps == 0``):
      ``dx = reduce_scatter_sum(accumulator)`` (the SUM over the group, this
      member's slice of axis 0), times ``1 / group_size`` if `mean`;
      the accumulator is reset to zeros.
    * other steps: ``dx = zeros``, no communication.

    ``shard_accumulator=True`` (MindSpore's grad_accumulation_shard): every
    mini-step reduce-scatters dy at once, ``accumulator +=
    reduce_scatter_sum(dy)`` (times ``1 / group_size`` if `mean`), so the
    accumulator holds only this member's shard (x's shape, 1/n of the
    memory) at the price of one reduce-scatter per mini-step; the update
    step returns the accumulator and resets it, other steps return zeros.
    The reduce-scatter is linear, so both modes release the same gradient.

    With ``accumulation_steps=1`` this is the all-gather's own backward
    (reduce-scatter of dy). Convention: ``mean=False`` is the exact
    adjoint for the SUM objective. As in `mirror_mini_step_operator`, the
    op owns the buffer and non-update steps return zeros. MindSpore:
    _MiniStepAllGather.

    Replicas outside `group` get `x` back and their gradient passes through
    (no accumulation).

    Args:
        x: this member's shard, a floating tensor of rank >= 1.
        accumulator: a per-replica variable, initially zeros, shaped like the
            gathered output (``x.shape[0] * group_size`` rows), or like `x`
            with `shard_accumulator`.
        step: a per-replica integer variable, initially 0.
        accumulation_steps: int >= 1.
        mean, group, timeout, name: as in `mirror_operator`.
        shard_accumulator: reduce-scatter every mini-step into a shard-sized
            accumulator.
        fusion: int >= 0: the forward all-gathers and the backward
            reduce-scatters of ops with one id > 0 each travel as one
            collective per step (see `all_gather`); the release of the
            default mode runs in a ``tf.cond`` and is always sent alone.

    Returns:
        The gathered tensor (or `x` on non-members and with a group of one).
    """
    mean = _checks.mean_argument(mean, mean_flag, True)
    _validation.accumulation_steps(accumulation_steps)
    _validation.boolean(shard_accumulator, "shard_accumulator")
    fusion = _fusion.validate_fusion(fusion)
    rows = "shard" if shard_accumulator else "gathered"
    x, call = _gathered_input(x, accumulator, "mini_step_all_gather", group, timeout, name, rows)

    def backward(dy, x, y):
        dy = tf.convert_to_tensor(dy)
        if not call.member:
            # Same program points as the members: counter, branch, run.
            if shard_accumulator:
                # Members reduce-scatter every mini-step, outside the branch.
                if not call.trivial:
                    dy = _collective.run(lambda: dy)
                with tf.control_dependencies([_counts_step(step, accumulation_steps)]):
                    return tf.identity(dy)
            update = _counts_step(step, accumulation_steps)
            return _branch(update, lambda: _collective.run(lambda: dy), lambda: dy)
        if shard_accumulator:
            part = _scatter_total(dy, mean, call, fusion)
            with tf.control_dependencies([_add_into(accumulator, part)]):
                update = _counts_step(step, accumulation_steps)
            return _branch(
                update, lambda: _take(accumulator, dy.dtype), lambda: tf.zeros_like(x)
            )
        with tf.control_dependencies([_add_into(accumulator, dy)]):
            update = _counts_step(step, accumulation_steps)

        def release():
            return _scatter_total(_take(accumulator, dy.dtype), mean, call)

        return _branch(update, release, lambda: tf.zeros_like(x))

    return D.with_gradient(x, lambda x: _gather_forward(x, call, fusion), backward)


def micro_step_all_gather(
    x,
    accumulator,
    mean=True,
    group=None,
    *,
    reduce_gradient=True,
    with_mirror_operator=False,
    local_norm=None,
    fusion=0,
    mean_flag=None,
    timeout=None,
    name=None,
):
    """All-gathers a parameter shard; reduces the micro-steps' accumulated gradient.

    Forward: ``y = concat([x_0, ..., x_{n-1}], axis=0)`` over the group.
    Backward: with ``with_mirror_operator=False`` (the default), ``total =
    accumulator + dy`` (accumulator holds the earlier micro-batches'
    gradients of y, e.g. written by `virtual_assign_add`) and the
    accumulator is reset to zeros; with ``with_mirror_operator=True`` a
    `mirror_micro_step_operator` on the shard owns the micro-step
    accumulation, so ``total = dy`` and the accumulator is not used (pass
    None). Then

    * ``reduce_gradient=True`` (the default): ``dx = reduce_scatter_sum(total)``
      (this member's slice of axis 0), times ``1 / group_size`` if `mean`.
    * ``reduce_gradient=False`` (MindSpore: ``do_mirror=False``): no
      communication, ``dx`` = this member's own rows of ``total``: the
      gradient of this replica's loss with the other members' shards held
      constant. With a group of one, MindSpore's case, that is the whole
      total, the exact adjoint; with a wider group the rows that belong to
      other members' shards are dropped here (MindSpore returns the whole
      gathered-shape total, which is not a gradient of the shard).

    With no other writer of the buffer this is the all-gather's own
    backward. MindSpore: _MicroStepAllGather.

    Replicas outside `group` get `x` back and their gradient passes through
    (the accumulator is not used).

    Args:
        x: this member's shard, a floating tensor of rank >= 1.
        accumulator: a per-replica variable shaped like the gathered output;
            None with `with_mirror_operator`.
        mean, group, timeout, name: as in `mirror_operator`.
        reduce_gradient: reduce-scatter the gradient over the group.
        with_mirror_operator: leave the micro-step accumulation to a mirror
            on the shard; this op only reduces (or slices) dy.
        local_norm: None, or a per-replica float32 scalar variable that the
            backward sets to the L2 norm of ``total`` (gathered shape)
            before it is reduced (MindSpore: dump_local_norm; not recorded
            with `with_mirror_operator`, where the mirror records it).
        fusion: int >= 0: the forward all-gathers and the backward
            reduce-scatters of ops with one id > 0 each travel as one
            collective per step (see `all_gather`).

    Returns:
        The gathered tensor (or `x` on non-members and with a group of one).
    """
    mean = _checks.mean_argument(mean, mean_flag, True)
    _validation.boolean(reduce_gradient, "reduce_gradient")
    _validation.boolean(with_mirror_operator, "with_mirror_operator")
    fusion = _fusion.validate_fusion(fusion)
    rows = None if with_mirror_operator else "gathered"
    x, call = _gathered_input(x, accumulator, "micro_step_all_gather", group, timeout, name, rows)

    def backward(dy, x, y):
        dy = tf.convert_to_tensor(dy)
        if not call.member:
            communicates = reduce_gradient and not call.trivial
            return _collective.run(lambda: dy) if communicates else dy
        total = dy
        if not with_mirror_operator:
            with tf.control_dependencies([_add_into(accumulator, dy)]):
                total = _take(accumulator, dy.dtype)
            total = record_local_norm(local_norm, total)
        if not reduce_gradient:
            return _own_rows(total, x, call)
        return _scatter_total(total, mean, call, fusion)

    return D.with_gradient(x, lambda x: _gather_forward(x, call, fusion), backward)
