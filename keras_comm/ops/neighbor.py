"""Differentiable neighbour exchanges: `neighbor_exchange` and `halo_exchange`.

Both run a plan from `keras_comm.ops._exchange_plan` (who sends which piece
to whom, in a deadlock-free global order) through one routine, `_exchange`.
The backward pass of an exchange is the same exchange with every link
reversed: each receiver sends the gradient of what it received back to the
sender, which adds it to the gradient of the piece it sent.
"""

import tensorflow as tf

from keras_comm import topology
from keras_comm.ops import _checks
from keras_comm.ops import _collective
from keras_comm.ops import _differentiable as D
from keras_comm.ops import _exchange_plan as plan
from keras_comm.ops import point_to_point as p2p

# Re-exported: the layers validate their arguments with the plan's checks.
exchange_plan = plan.exchange_plan
halo_plan = plan.halo_plan
halo_rank_ids = plan.halo_rank_ids
validate_data_format = plan.check_data_format
DIRECTIONS = plan.DIRECTIONS


def _exchange(call, tag, moves, piece, piece_shape, dtype):
    """Runs this rank's `moves`: sends ``piece(slot)``, receives the others.

    Call inside `_collective.run`. Returns (sent, received): the sends'
    results, which the caller must make its outputs depend on (or
    tf.function prunes the sends), and ``(slot, tensor)`` for each receive,
    in plan order.
    """
    transfers = [
        p2p._Transfer("send", m.peer, tag, piece(m.slot), None, None)
        if m.kind == "send"
        else p2p._Transfer("recv", m.peer, tag, None, piece_shape(m.slot), dtype)
        for m in moves
    ]
    results = p2p._run_transfers(call, transfers) if transfers else []
    sent = [r for m, r in zip(moves, results) if m.kind == "send"]
    received = [(m.slot, r) for m, r in zip(moves, results) if m.kind == "recv"]
    return sent, received


def _my_links(ranks, group, links, timeout, name, what, tables):
    """The call, this rank and the plan's links, checked against the world."""
    call = _collective.resolve(None, timeout, name)
    world = call.replica.world_size
    if world == 1:
        # One replica (or no strategy): nothing to exchange.
        return call, call.replica.rank, []
    if group is not None:
        try:
            group.check_world(world)
        except ValueError as e:
            raise ValueError(f"{what}: {e}") from None
    elif len(ranks) != world:
        raise ValueError(
            f"{what}: {tables} have {len(ranks)} rows but the world has "
            f"{world} replicas; give one row per rank."
        )
    return call, call.replica.rank, links


def neighbor_exchange(
    inputs,
    send_ranks,
    recv_ranks,
    recv_shapes,
    send_shapes,
    recv_dtype="float32",
    group=None,
    *,
    timeout=None,
    name=None,
):
    """Each rank sends tensors to some ranks and receives tensors from others.

    Every rank runs the same program, so `send_ranks` / `recv_ranks` hold one
    row per group member and each rank uses its own row: input slot i of
    member p goes to ``send_ranks[p][i]``, output slot j of member p comes
    from ``recv_ranks[p][j]``. The n-th slot member a sends to b is the n-th
    slot b receives from a. Transfers run in one global order, so the
    exchange cannot deadlock. MindSpore: NeighborExchange.

    Forward: output j = the tensor its source sent; zeros where the slot is
    None, and on ranks outside the group.
    Backward: the same exchange reversed: each receiver sends the gradient
    of output j back, and it becomes the gradient of the input slot that was
    sent; zeros for input slots that were not sent. The exact adjoint.

    Args:
        inputs: a list of k tensors (k = len(send_shapes)).
        send_ranks, recv_ranks: see above (lists of rows of ranks/None).
        recv_shapes: m shapes; a None dim is the first input's dim.
        send_shapes: k shapes (checked against `inputs`).
        recv_dtype: dtype of every received tensor; inputs are cast to it.
        group: ranks taking part (None: the world; rows then belong to ranks
            0..len(rows)-1 and must cover the world).
        timeout: seconds before DeadlineExceeded.
        name: op name (the layer's name).

    Returns:
        A list of m tensors.

    Raises:
        TypeError, ValueError: a malformed table or shape, inputs that do not
            match `send_shapes`, or tables that do not cover the world.
    """
    what = _checks.what("neighbor_exchange", name)
    group = topology.as_group(group)
    ranks, send_ranks, recv_ranks, send_shapes, recv_shapes, links = plan.exchange_plan(
        send_ranks, recv_ranks, send_shapes, recv_shapes, group
    )
    recv_dtype = tf.as_dtype(recv_dtype)
    inputs = [tf.cast(tf.convert_to_tensor(x), recv_dtype) for x in inputs]
    if len(inputs) != len(send_shapes):
        raise ValueError(
            f"{what}: expected {len(send_shapes)} input tensor(s) (one per "
            f"send_shapes entry). Received: {len(inputs)} inputs"
        )
    for i, (x, s) in enumerate(zip(inputs, send_shapes)):
        if not x.shape.is_compatible_with(s):
            raise ValueError(
                f"{what}: input {i} has shape {tuple(x.shape)}, which does not "
                f"match send_shapes[{i}]={s}."
            )
    call, me, links = _my_links(
        ranks, group, links, timeout, name, what, "`send_ranks`/`recv_ranks`"
    )
    if not inputs and any(None in s for s in recv_shapes):
        raise ValueError(f"{what}: recv_shapes with None dims need at least one input.")

    def recv_shape(j):
        dims = recv_shapes[j]
        if all(d is not None for d in dims):
            return tf.constant(dims, tf.int32)
        ref = tf.shape(inputs[0], out_type=tf.int32)
        return tf.stack([ref[a] if d is None else tf.constant(d) for a, d in enumerate(dims)])

    def forward(xs):
        outs = [tf.zeros(recv_shape(j), recv_dtype) for j in range(len(recv_shapes))]
        sent, received = _exchange(
            call, p2p.NEIGHBOR_TAG, plan.moves(links, me), lambda i: xs[i], recv_shape, recv_dtype
        )
        for j, r in received:
            outs[j] = r
        return [p2p._after(o, sent) for o in outs]

    def backward(dys, xs, ys):
        dxs = [tf.zeros_like(x) for x in xs]
        sent, received = _exchange(
            call,
            p2p.NEIGHBOR_TAG,
            plan.moves(links, me, reverse=True),
            lambda j: dys[j],
            lambda i: tf.shape(xs[i]),
            recv_dtype,
        )
        for i, r in received:
            dxs[i] = r
        return [p2p._after(d, sent) for d in dxs]

    if not inputs:
        # Nothing to differentiate (custom_gradient needs an input).
        return _collective.run(lambda: forward([]))
    return list(D.everywhere(inputs, forward, backward))


def _region(x, axes, region):
    """Slices x along the spatial axes; region is ((row0, row1), (col0, col1))."""
    (r0, r1), (c0, c1) = region
    begin = [0] * x.shape.rank
    size = [-1] * x.shape.rank
    begin[axes[0]], size[axes[0]] = r0, r1 - r0
    begin[axes[1]], size[axes[1]] = c0, c1 - c0
    return tf.slice(x, begin, size)


def _place(x, axes, region, height, width):
    """Zero-pads x so that it sits at `region` of a height x width plane."""
    (r0, r1), (c0, c1) = region
    pads = [[0, 0]] * x.shape.rank
    pads[axes[0]] = [r0, height - r1]
    pads[axes[1]] = [c0, width - c1]
    return tf.pad(x, pads)


def _region_shape(x, axes, region):
    """x's dynamic shape with the spatial dims of `region`."""
    (r0, r1), (c0, c1) = region
    s = tf.unstack(tf.shape(x))
    s[axes[0]], s[axes[1]] = r1 - r0, c1 - c0
    return tf.stack(s)


def halo_exchange(
    x,
    send_rank_ids,
    send_lens,
    recv_rank_ids,
    recv_lens,
    data_format="NCHW",
    group=None,
    *,
    timeout=None,
    name=None,
):
    """Pads an image tile with its neighbours' border strips (8 directions).

    Each rank holds one tile of an image split over a 2-D grid of ranks.
    Directions are [top, top_right, right, bottom_right, bottom,
    bottom_left, left, top_left]; `send_lens` and `recv_lens` are [top,
    bottom, left, right] in rows/columns. A rank sends its ``send_lens[top]``
    top rows to its top neighbour, its top-right ``send_lens[top] x
    send_lens[right]`` corner to the top-right one, and so on, and places
    the strips it receives around its tile. The rank tables hold one row of
    8 ranks (-1 = none) per group member; `halo_rank_ids(rows, cols)` builds
    them for a row-major grid. MindSpore: NeighborExchangeV2.

    Forward: the tile padded by `recv_lens` on every side, each halo filled
    with the strip its neighbour sent; a side without a neighbour stays zero
    (as zero "same" padding at the image border), so every rank's output
    has the same shape.
    Backward: the same exchange reversed: each halo's gradient goes back to
    the neighbour that sent the strip and is added into that strip of dx;
    dx's interior is dy's interior. The exact adjoint.

    Args:
        x: a 4-D tile, NCHW or NHWC (Keras's channels_last) per
            `data_format`; height and width static.
        send_rank_ids, recv_rank_ids: one row of 8 ranks per group member.
        send_lens, recv_lens: 4 ints [top, bottom, left, right].
        data_format: "NCHW" or "NHWC".
        group: member ranks (rows follow ascending ranks); None = the world.
        timeout: seconds before DeadlineExceeded.
        name: op name (the layer's name).

    Returns:
        The padded tile: H + top + bottom rows, W + left + right columns
        (recv_lens).

    Raises:
        ValueError: a malformed or inconsistent table, lens that do not
            match across neighbours or exceed the tile, or a non-4-D `x`.
    """
    what = _checks.what("halo_exchange", name)
    data_format = plan.check_data_format(data_format)
    group = topology.as_group(group)
    ranks, _, send_lens, _, recv_lens, links = plan.halo_plan(
        send_rank_ids, send_lens, recv_rank_ids, recv_lens, group
    )
    x = tf.convert_to_tensor(x)
    if x.shape.rank != 4:
        raise ValueError(f"{what}: `x` must be 4-D ({data_format}). Received: x.shape={tuple(x.shape)}")
    axes = (2, 3) if data_format == "NCHW" else (1, 2)
    height, width = x.shape[axes[0]], x.shape[axes[1]]
    if height is None or width is None:
        raise ValueError(f"{what}: the tile's height and width must be static. Received: x.shape={tuple(x.shape)}")
    st, sb, sl, sr = send_lens
    if st > height or sb > height or sl > width or sr > width:
        raise ValueError(
            f"{what}: send_lens={list(send_lens)} exceed the tile of {height}x{width}. "
            f"Received: x.shape={tuple(x.shape)}"
        )
    call, me, links = _my_links(ranks, group, links, timeout, name, what, "the rank tables")
    strips, halos, interior = plan.halo_regions(height, width, send_lens, recv_lens)
    rt, rb, rl, rr = recv_lens
    ph, pw = rt + height + rb, rl + width + rr
    pad_spec = [[0, 0]] * 4
    pad_spec[axes[0]], pad_spec[axes[1]] = [rt, rb], [rl, rr]
    tag = p2p.NEIGHBOR_V2_TAG

    def forward(x):
        sent, received = _exchange(
            call,
            tag,
            plan.moves(links, me),
            lambda d: _region(x, axes, strips[d]),
            lambda e: _region_shape(x, axes, halos[e]),
            x.dtype,
        )
        y = tf.pad(x, pad_spec)
        for e, r in received:
            y = y + _place(r, axes, halos[e], ph, pw)
        return p2p._after(y, sent)

    def backward(dy, x, y):
        sent, received = _exchange(
            call,
            tag,
            plan.moves(links, me, reverse=True),
            lambda e: _region(dy, axes, halos[e]),
            lambda d: _region_shape(x, axes, strips[d]),
            dy.dtype,
        )
        dx = _region(dy, axes, interior)
        for d, r in received:
            dx = dx + _place(r, axes, strips[d], height, width)
        return p2p._after(dx, sent)

    return D.everywhere(x, forward, backward)


# The MindSpore name (NeighborExchangeV2), kept as an alias.
neighbor_exchange_v2 = halo_exchange

__all__ = ["halo_exchange", "halo_rank_ids", "neighbor_exchange", "neighbor_exchange_v2"]
