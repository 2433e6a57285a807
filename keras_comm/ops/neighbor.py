"""Differentiable neighbour exchanges: `neighbor_exchange` and the 2-D halo
exchange `neighbor_exchange_v2`.

Both are built from two-member point-to-point transfers. Every rank knows the
whole exchange pattern (SPMD: one table row per group member), so every rank
derives the same list of transfers and runs its own share of them in one
global order: pairs sorted by (lower rank, higher rank, sender, slot). The
globally first unfinished transfer always has both of its ranks waiting at
it, so the exchange cannot deadlock, in one process or across processes.
"""

import collections

import tensorflow as tf

from keras_comm import topology
from keras_comm.ops import _collective
from keras_comm.ops import point_to_point as p2p


def _what(fn_name, name):
    return p2p._what(fn_name, name)  # pylint: disable=protected-access


def _check_world(ranks, world, what):
    try:
        topology.Group(ranks).check_world(world)
    except ValueError as e:
        raise ValueError(f"{what}: {e}") from None


# ---------------------------------------------------------------------------
# NeighborExchange.
# ---------------------------------------------------------------------------

_Route = collections.namedtuple("_Route", "src dst send_slot recv_slot")


def _normalize_shape(shape, name):
    if isinstance(shape, (str, bytes)) or not hasattr(shape, "__iter__"):
        raise TypeError(f"`{name}` must be a list of ints (or None). Received: {name}={shape!r}")
    out = []
    for d in shape:
        if d is not None and (isinstance(d, bool) or not isinstance(d, int) or d < 0):
            raise ValueError(
                f"`{name}` entries must be ints >= 0 or None. Received: {name}={shape!r}"
            )
        out.append(None if d is None else int(d))
    return tuple(out)


def _normalize_table(table, width, name, none_value=None):
    """A list of rows (one per group member) of `width` ranks or None."""
    if isinstance(table, (str, bytes)) or not hasattr(table, "__iter__"):
        raise TypeError(
            f"`{name}` must be a list with one row (list of ranks) per group "
            f"member. Received: {name}={table!r}"
        )
    rows = []
    for p, row in enumerate(table):
        if isinstance(row, (str, bytes)) or not hasattr(row, "__iter__"):
            raise TypeError(
                f"`{name}[{p}]` must be a list of ranks. Received: {name}={table!r}"
            )
        row = list(row)
        if len(row) != width:
            raise ValueError(
                f"`{name}[{p}]` must have {width} entries (one per slot). "
                f"Received: {name}[{p}]={row!r}"
            )
        out = []
        for r in row:
            if r is None or r == none_value and none_value is not None:
                out.append(None)
            else:
                out.append(p2p.validate_rank(r, f"{name}[{p}] entry"))
        rows.append(tuple(out))
    if not rows:
        raise ValueError(f"`{name}` must not be empty. Received: {name}={table!r}")
    return tuple(rows)


def exchange_plan(send_ranks, recv_ranks, send_shapes, recv_shapes, group=None):
    """Validates a NeighborExchange pattern; returns its transfers in order.

    Pure function (no TensorFlow): the layer calls it at construction and the
    op at trace time, so a bad pattern fails before any communication.

    Args:
        send_ranks: one row per group member (ascending ranks); row p lists,
            for each input slot, the global rank that member sends it to, or
            None.
        recv_ranks: one row per group member; for each output slot, the
            global rank it is received from, or None (the output is zeros).
        send_shapes: one shape per input slot (the same on every rank).
        recv_shapes: one shape per output slot; None dims are the first
            input's dims at run time.
        group: a rank list / Group, or None for ranks 0..len(rows)-1.

    Returns:
        (rows' ranks, normalized tables and shapes, transfers) where transfers
        is a list of `_Route(src, dst, send_slot, recv_slot)` in the global
        order every rank follows.

    Raises:
        TypeError, ValueError: naming the argument and the value.
    """
    send_shapes = [_normalize_shape(s, f"send_shapes[{i}]") for i, s in enumerate(send_shapes)]
    recv_shapes = [_normalize_shape(s, f"recv_shapes[{i}]") for i, s in enumerate(recv_shapes)]
    send_ranks = _normalize_table(send_ranks, len(send_shapes), "send_ranks")
    recv_ranks = _normalize_table(recv_ranks, len(recv_shapes), "recv_ranks")
    if len(send_ranks) != len(recv_ranks):
        raise ValueError(
            "`send_ranks` and `recv_ranks` must have one row per group member "
            f"each. Received: len(send_ranks)={len(send_ranks)}, "
            f"len(recv_ranks)={len(recv_ranks)}"
        )
    group = topology.as_group(group)
    ranks = tuple(range(len(send_ranks))) if group is None else group.ranks
    if len(ranks) != len(send_ranks):
        raise ValueError(
            f"`send_ranks` and `recv_ranks` must have one row per member of "
            f"`group` {list(ranks)}. Received: {len(send_ranks)} rows"
        )
    members = set(ranks)
    sends = collections.defaultdict(list)
    recvs = collections.defaultdict(list)
    for table, name, store, is_send in (
        (send_ranks, "send_ranks", sends, True),
        (recv_ranks, "recv_ranks", recvs, False),
    ):
        for p, row in enumerate(table):
            me = ranks[p]
            for slot, peer in enumerate(row):
                if peer is None:
                    continue
                if peer not in members:
                    raise ValueError(
                        f"`{name}[{p}]` (rank {me}) names rank {peer}, which is not "
                        f"in the group {list(ranks)}. Received: {name}[{p}]={list(row)}"
                    )
                if peer == me:
                    raise ValueError(
                        f"`{name}[{p}]` names rank {me} itself. "
                        f"Received: {name}[{p}]={list(row)}"
                    )
                key = (me, peer) if is_send else (peer, me)
                store[key].append(slot)
    transfers = []
    for key in sorted(set(sends) | set(recvs)):
        s_slots, r_slots = sends.get(key, []), recvs.get(key, [])
        if len(s_slots) != len(r_slots):
            raise ValueError(
                f"Rank {key[0]} sends {len(s_slots)} tensor(s) to rank {key[1]} "
                f"(send_ranks) but rank {key[1]} receives {len(r_slots)} from rank "
                f"{key[0]} (recv_ranks). Received: send_ranks={[list(r) for r in send_ranks]}, "
                f"recv_ranks={[list(r) for r in recv_ranks]}"
            )
        for i, j in zip(s_slots, r_slots):
            a, b = send_shapes[i], recv_shapes[j]
            if len(a) != len(b) or any(
                x is not None and y is not None and x != y for x, y in zip(a, b)
            ):
                raise ValueError(
                    f"Rank {key[0]} sends input {i} of shape {a} to rank {key[1]}, "
                    f"which receives it as output {j} of shape {b}: the shapes must "
                    f"match. Received: send_shapes[{i}]={a}, recv_shapes[{j}]={b}"
                )
            transfers.append(_Route(key[0], key[1], i, j))
    transfers.sort(key=lambda t: (min(t.src, t.dst), max(t.src, t.dst), t.src, t.send_slot))
    return ranks, send_ranks, recv_ranks, send_shapes, recv_shapes, transfers


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

    The reference's ``NeighborExchange(send_rank_ids, recv_rank_ids,
    recv_shapes, send_shapes, recv_type, group)`` is built by each process
    with its own lists; under SPMD every rank runs the same model, so here
    `send_ranks` / `recv_ranks` hold one row per group member and each rank
    uses its own row. Input slot i goes to ``send_ranks[p][i]`` from member
    p; output slot j comes from ``recv_ranks[p][j]``. The n-th slot member a
    sends to b is the n-th slot b receives from a.

    Forward: output j = the tensor its source sent (zeros where the slot is
    None, and on ranks outside the group). Backward: NeighborExchange with
    sends and receives swapped: each receiver sends the gradient of output j
    back, and it becomes the gradient of the input slot that was sent (zeros
    for input slots that were not sent). Exact adjoint; same as the
    reference.

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
    """
    what = _what("neighbor_exchange", name)
    ranks, send_ranks, recv_ranks, send_shapes, recv_shapes, transfers = exchange_plan(
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
    call = _collective.resolve(None, timeout, name)
    world = call.replica.world_size
    if world > 1 and group is not None:
        _check_world(ranks, world, what)
    if world == 1:
        # One replica (or no strategy): nothing to exchange; received slots are zeros.
        transfers = []
    elif group is None and len(ranks) != world:
        raise ValueError(
            f"{what}: `send_ranks`/`recv_ranks` have {len(ranks)} rows but the "
            f"world has {world} replicas; give one row per rank."
        )
    me = call.replica.rank

    def recv_shape(j):
        dims = recv_shapes[j]
        if all(d is not None for d in dims):
            return tf.constant(dims, tf.int32)
        ref = tf.shape(inputs[0], out_type=tf.int32)
        return tf.stack([ref[a] if d is None else tf.constant(d) for a, d in enumerate(dims)])

    def zeros(j):
        return tf.zeros(recv_shape(j), recv_dtype)

    mine = [t for t in transfers if me in (t.src, t.dst)]
    if not inputs and any(None in s for s in recv_shapes):
        raise ValueError(f"{what}: recv_shapes with None dims need at least one input.")

    @tf.custom_gradient
    def fn(*xs):
        def forward():
            outs = [zeros(j) for j in range(len(recv_shapes))]
            plan = [
                p2p._Transfer("send", t.dst, p2p.NEIGHBOR_TAG, xs[t.send_slot], None, None)
                if t.src == me
                else p2p._Transfer("recv", t.src, p2p.NEIGHBOR_TAG, None,
                                   recv_shape(t.recv_slot), recv_dtype)
                for t in mine
            ]
            results = p2p._run_transfers(call, plan) if plan else []
            sent = [r for t, r in zip(mine, results) if t.src == me]
            for t, r in zip(mine, results):
                if t.dst == me:
                    outs[t.recv_slot] = r
            return [p2p._after(o, sent) for o in outs]

        ys = _collective.run(forward)

        def grad(*dys):
            def backward():
                dxs = [tf.zeros_like(x) for x in xs]
                plan = [
                    p2p._Transfer("send", t.src, p2p.NEIGHBOR_TAG, dys[t.recv_slot], None, None)
                    if t.dst == me
                    else p2p._Transfer("recv", t.dst, p2p.NEIGHBOR_TAG, None,
                                       tf.shape(xs[t.send_slot]), recv_dtype)
                    for t in mine
                ]
                results = p2p._run_transfers(call, plan) if plan else []
                sent = [r for t, r in zip(mine, results) if t.dst == me]
                for t, r in zip(mine, results):
                    if t.src == me:
                        dxs[t.send_slot] = r
                return [p2p._after(d, sent) for d in dxs]

            return _collective.run(backward)

        return ys, grad

    if not inputs:
        # custom_gradient needs an input; with none there is nothing to differentiate.
        return _collective.run(lambda: _forward_only(call, mine, me, recv_shape, recv_dtype, len(recv_shapes)))
    return list(fn(*inputs))


def _forward_only(call, mine, me, recv_shape, dtype, m):
    outs = [tf.zeros(recv_shape(j), dtype) for j in range(m)]
    plan = [p2p._Transfer("recv", t.src, p2p.NEIGHBOR_TAG, None, recv_shape(t.recv_slot), dtype)
            for t in mine]
    for t, r in zip(mine, p2p._run_transfers(call, plan) if plan else []):
        outs[t.recv_slot] = r
    return outs


# ---------------------------------------------------------------------------
# NeighborExchangeV2: 8-direction halo exchange.
# ---------------------------------------------------------------------------

DIRECTIONS = ("top", "top_right", "right", "bottom_right", "bottom", "bottom_left", "left", "top_left")
# Which rows / columns of the tile each direction touches.
_VERT = ("top", "top", "all", "bottom", "bottom", "bottom", "all", "top")
_HORZ = ("all", "right", "right", "right", "all", "left", "left", "left")

_Halo = collections.namedtuple("_Halo", "src dst direction")


def halo_rank_ids(grid_rows, grid_cols, periodic=False):
    """The 8-neighbour table of a row-major 2-D grid of ranks.

    Rank ``r = row * grid_cols + col`` holds tile (row, col) of the image.
    Returns one row per rank of 8 neighbour ranks in the reference's order
    [top, top_right, right, bottom_right, bottom, bottom_left, left,
    top_left], -1 where there is none. The same table serves as
    `send_rank_ids` and `recv_rank_ids` (the tile above sends its bottom rows
    to you and you send your top rows to it).

    Args:
        grid_rows, grid_cols: ints >= 1.
        periodic: wrap around the edges (a torus). A neighbour that would be
            the rank itself is -1.
    """
    for v, n in ((grid_rows, "grid_rows"), (grid_cols, "grid_cols")):
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            raise ValueError(f"`{n}` must be an int >= 1. Received: {n}={v!r}")
    offsets = [(-1, 0), (-1, 1), (0, 1), (1, 1), (1, 0), (1, -1), (0, -1), (-1, -1)]
    table = []
    for r in range(grid_rows):
        for c in range(grid_cols):
            row = []
            for dr, dc in offsets:
                rr, cc = r + dr, c + dc
                if periodic:
                    rr, cc = rr % grid_rows, cc % grid_cols
                if 0 <= rr < grid_rows and 0 <= cc < grid_cols and (rr, cc) != (r, c):
                    row.append(rr * grid_cols + cc)
                else:
                    row.append(-1)
            table.append(row)
    return table


def _lens(value, name):
    if isinstance(value, (str, bytes)) or not hasattr(value, "__iter__") or len(value) != 4:
        raise ValueError(
            f"`{name}` must be 4 ints [top, bottom, left, right]. Received: {name}={value!r}"
        )
    out = []
    for v in value:
        if isinstance(v, bool) or not isinstance(v, int) or v < 0:
            raise ValueError(f"`{name}` entries must be ints >= 0. Received: {name}={value!r}")
        out.append(int(v))
    return tuple(out)


def _strip_lens(lens, d):
    """(rows, cols) lengths of the strip/halo in direction d; None = whole side."""
    top, bottom, left, right = lens
    rows = {"top": top, "bottom": bottom, "all": None}[_VERT[d]]
    cols = {"left": left, "right": right, "all": None}[_HORZ[d]]
    return rows, cols


def halo_plan(send_rank_ids, send_lens, recv_rank_ids, recv_lens, group=None):
    """Validates a NeighborExchangeV2 pattern; returns its transfers in order.

    Pure function. Returns (ranks, send table, send_lens, recv table,
    recv_lens, transfers) with transfers a list of `_Halo(src, dst,
    direction)`, direction being the sender's (0..7).
    """
    send_lens = _lens(send_lens, "send_lens")
    recv_lens = _lens(recv_lens, "recv_lens")
    send = _normalize_table(send_rank_ids, 8, "send_rank_ids", none_value=-1)
    recv = _normalize_table(recv_rank_ids, 8, "recv_rank_ids", none_value=-1)
    if len(send) != len(recv):
        raise ValueError(
            "`send_rank_ids` and `recv_rank_ids` must have one row per group member. "
            f"Received: {len(send)} and {len(recv)} rows"
        )
    group = topology.as_group(group)
    ranks = tuple(range(len(send))) if group is None else group.ranks
    if len(ranks) != len(send):
        raise ValueError(
            f"`send_rank_ids` must have one row per member of `group` {list(ranks)}. "
            f"Received: {len(send)} rows"
        )
    pos = {r: p for p, r in enumerate(ranks)}
    transfers = []
    for table, other, name, other_name, is_send in (
        (send, recv, "send_rank_ids", "recv_rank_ids", True),
        (recv, send, "recv_rank_ids", "send_rank_ids", False),
    ):
        for p, row in enumerate(table):
            me = ranks[p]
            for d, peer in enumerate(row):
                if peer is None:
                    continue
                if peer not in pos or peer == me:
                    raise ValueError(
                        f"`{name}[{p}]` (rank {me}) direction {DIRECTIONS[d]} names "
                        f"rank {peer}, which is {'itself' if peer == me else 'not in the group ' + str(list(ranks))}. "
                        f"Received: {name}[{p}]={[-1 if v is None else v for v in row]}"
                    )
                opposite = (d + 4) % 8
                if other[pos[peer]][opposite] != me:
                    raise ValueError(
                        f"Rank {me} {'sends' if is_send else 'receives'} direction "
                        f"{DIRECTIONS[d]} {'to' if is_send else 'from'} rank {peer}, but "
                        f"`{other_name}[{pos[peer]}]` (rank {peer}) direction "
                        f"{DIRECTIONS[opposite]} is {other[pos[peer]][opposite]}, not {me}. "
                        f"Received: {name}={[[-1 if v is None else v for v in r] for r in table]}"
                    )
                if is_send:
                    s_rows, s_cols = _strip_lens(send_lens, d)
                    r_rows, r_cols = _strip_lens(recv_lens, opposite)
                    if s_rows != r_rows or s_cols != r_cols:
                        raise ValueError(
                            f"Direction {DIRECTIONS[d]}: the strip sent (send_lens "
                            f"gives rows={s_rows}, cols={s_cols}) must equal the halo "
                            f"received on the {DIRECTIONS[opposite]} side (recv_lens "
                            f"gives rows={r_rows}, cols={r_cols}); None is the whole "
                            f"side. Received: send_lens={list(send_lens)}, "
                            f"recv_lens={list(recv_lens)}"
                        )
                    if s_rows != 0 and s_cols != 0:
                        transfers.append(_Halo(me, peer, d))
    transfers.sort(key=lambda t: (min(t.src, t.dst), max(t.src, t.dst), t.src, t.direction))
    return ranks, send, send_lens, recv, recv_lens, transfers


def _axes(data_format):
    return (2, 3) if data_format == "NCHW" else (1, 2)


def _validate_format(data_format):
    if data_format not in ("NCHW", "NHWC"):
        raise ValueError(
            f"`data_format` must be 'NCHW' or 'NHWC'. Received: data_format={data_format!r}"
        )
    return data_format


def _region(x, axes, rows, cols):
    """Slices x along the spatial axes; rows/cols are (start, stop)."""
    begin = [0] * x.shape.rank
    size = [-1] * x.shape.rank
    begin[axes[0]], size[axes[0]] = rows[0], rows[1] - rows[0]
    begin[axes[1]], size[axes[1]] = cols[0], cols[1] - cols[0]
    return tf.slice(x, begin, size)


def _place(x, axes, rows, cols, height, width):
    """Zero-pads x so that it sits at rows/cols of a height x width plane."""
    pads = [[0, 0]] * x.shape.rank
    pads[axes[0]] = [rows[0], height - rows[1]]
    pads[axes[1]] = [cols[0], width - cols[1]]
    return tf.pad(x, pads)


def neighbor_exchange_v2(
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
    """Halo exchange of a spatially split image over up to 8 neighbours.

    Each rank holds one tile of an image split over a 2-D grid of ranks.
    Directions are the reference's [top, top_right, right, bottom_right,
    bottom, bottom_left, left, top_left]; `send_lens` and `recv_lens` are
    [top, bottom, left, right] in rows/columns. As in the reference, a rank
    sends its ``send_lens[top]`` top rows to its top neighbour, its top-right
    ``send_lens[top] x send_lens[right]`` corner to the top-right one, and so
    on, and concatenates the received halos around its tile.

    Under SPMD the rank tables hold one row of 8 ranks (-1 = none) per group
    member; `halo_rank_ids(rows, cols)` builds them for a row-major grid.

    Forward: the tile padded by `recv_lens` on every side, the halos filled
    with the neighbours' strips. Backward: the halo gradients are sent back
    to the neighbours that sent those strips and added into the border
    strips of dx; dx's interior is dy's interior. Exact adjoint, as the
    reference's NeighborExchangeV2Grad.

    Difference from the reference: the reference only grows a side that has
    a neighbour; here every side grows by its `recv_lens` entry and a missing
    neighbour leaves zeros (as zero "same" padding at the image border), so
    that every rank's output has the same shape, which one SPMD model needs.

    Args:
        x: a 4-D tile, NCHW (the reference's layout) or NHWC (Keras's
            channels_last default) per `data_format`.
        send_rank_ids, recv_rank_ids: one row of 8 ranks per group member.
        send_lens, recv_lens: 4 ints [top, bottom, left, right].
        data_format: "NCHW" or "NHWC".
        group: member ranks (rows follow ascending ranks); None = the world.
        timeout: seconds before DeadlineExceeded.
        name: op name (the layer's name).

    Returns:
        The padded tile: H + top + bottom rows, W + left + right columns
        (recv_lens).
    """
    what = _what("neighbor_exchange_v2", name)
    data_format = _validate_format(data_format)
    ranks, _, send_lens, _, recv_lens, transfers = halo_plan(
        send_rank_ids, send_lens, recv_rank_ids, recv_lens, group
    )
    x = tf.convert_to_tensor(x)
    if x.shape.rank != 4:
        raise ValueError(f"{what}: `x` must be 4-D ({data_format}). Received: x.shape={tuple(x.shape)}")
    axes = _axes(data_format)
    height, width = x.shape[axes[0]], x.shape[axes[1]]
    if height is None or width is None:
        raise ValueError(f"{what}: the tile's height and width must be static. Received: x.shape={tuple(x.shape)}")
    st, sb, sl, sr = send_lens
    if st > height or sb > height or sl > width or sr > width:
        raise ValueError(
            f"{what}: send_lens={list(send_lens)} exceed the tile of {height}x{width}. "
            f"Received: x.shape={tuple(x.shape)}"
        )
    rt, rb, rl, rr = recv_lens
    ph, pw = rt + height + rb, rl + width + rr
    call = _collective.resolve(None, timeout, name)
    if call.replica.world_size > 1 and group is not None:
        _check_world(ranks, call.replica.world_size, what)
    if call.replica.world_size == 1:
        # One replica: the tile is the whole image; halos are the zero border.
        transfers = []
    elif group is None and len(ranks) != call.replica.world_size:
        raise ValueError(
            f"{what}: the rank tables have {len(ranks)} rows but the world has "
            f"{call.replica.world_size} replicas; give one row per rank."
        )
    me = call.replica.rank
    mine = [t for t in transfers if me in (t.src, t.dst)]

    def strip(d):
        # The sender's strip for direction d, in tile coordinates.
        r = {"top": (0, st), "bottom": (height - sb, height), "all": (0, height)}[_VERT[d]]
        c = {"left": (0, sl), "right": (width - sr, width), "all": (0, width)}[_HORZ[d]]
        return r, c

    def halo(e):
        # The receiver's halo for direction e, in padded coordinates.
        r = {"top": (0, rt), "bottom": (rt + height, ph), "all": (rt, rt + height)}[_VERT[e]]
        c = {"left": (0, rl), "right": (rl + width, pw), "all": (rl, rl + width)}[_HORZ[e]]
        return r, c

    def shape_of(t, rows, cols):
        s = tf.unstack(tf.shape(t))
        s[axes[0]], s[axes[1]] = rows[1] - rows[0], cols[1] - cols[0]
        return tf.stack(s)

    tag = p2p.NEIGHBOR_V2_TAG
    pad_spec = [[0, 0]] * 4
    pad_spec[axes[0]], pad_spec[axes[1]] = [rt, rb], [rl, rr]

    @tf.custom_gradient
    def fn(x):
        def forward():
            plan = []
            for t in mine:
                if t.src == me:
                    r, c = strip(t.direction)
                    plan.append(p2p._Transfer("send", t.dst, tag, _region(x, axes, r, c), None, None))
                else:
                    r, c = halo((t.direction + 4) % 8)
                    plan.append(p2p._Transfer("recv", t.src, tag, None, shape_of(x, r, c), x.dtype))
            results = p2p._run_transfers(call, plan) if plan else []
            y = tf.pad(x, pad_spec)
            sent = []
            for t, res in zip(mine, results):
                if t.src == me:
                    sent.append(res)
                else:
                    r, c = halo((t.direction + 4) % 8)
                    y = y + _place(res, axes, r, c, ph, pw)
            return p2p._after(y, sent)

        y = _collective.run(forward)

        def grad(dy):
            def backward():
                plan = []
                for t in mine:
                    if t.dst == me:
                        r, c = halo((t.direction + 4) % 8)
                        plan.append(p2p._Transfer("send", t.src, tag, _region(dy, axes, r, c), None, None))
                    else:
                        r, c = strip(t.direction)
                        plan.append(p2p._Transfer("recv", t.dst, tag, None, shape_of(x, r, c), dy.dtype))
                results = p2p._run_transfers(call, plan) if plan else []
                dx = _region(dy, axes, (rt, rt + height), (rl, rl + width))
                sent = []
                for t, res in zip(mine, results):
                    if t.dst == me:
                        sent.append(res)
                    else:
                        r, c = strip(t.direction)
                        dx = dx + _place(res, axes, r, c, height, width)
                return p2p._after(dx, sent)

            return _collective.run(backward)

        return y, grad

    return fn(x)


__all__ = ["halo_rank_ids", "neighbor_exchange", "neighbor_exchange_v2"]
