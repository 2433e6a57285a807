"""Exchange plans: who sends what to whom, in which order (pure Python).

`neighbor_exchange` and `halo_exchange` are built from two-member transfers.
Under SPMD every rank knows the whole pattern (one table row per group
member), so every rank derives the same list of `Link`s and runs its own
share of them (`moves`) in one global order: links sorted by (lower rank,
higher rank, sender, slot). The globally first unfinished transfer always
has both of its ranks waiting at it, so an exchange cannot deadlock, in one
process or across processes.

A link moves piece `send_slot` of the sender into piece `recv_slot` of the
receiver. The backward pass runs the same links reversed: the receiver sends
the gradient of its piece `recv_slot` back into piece `send_slot` of the
sender (`moves(..., reverse=True)`).

Nothing here imports TensorFlow: plans are checked when a layer is built and
tested without a cluster.
"""

import collections

from keras_comm import _validation
from keras_comm.ops import _checks

Link = collections.namedtuple("Link", "src dst send_slot recv_slot")
"""One transfer: `src`'s piece `send_slot` becomes `dst`'s piece `recv_slot`."""

Move = collections.namedtuple("Move", "kind peer slot")
"""This rank's part of a link: "send" piece `slot` to `peer`, or "recv" it."""

DIRECTIONS = ("top", "top_right", "right", "bottom_right", "bottom", "bottom_left", "left", "top_left")
# Which rows / columns of the tile each direction touches.
_VERT = ("top", "top", "all", "bottom", "bottom", "bottom", "all", "top")
_HORZ = ("all", "right", "right", "right", "all", "left", "left", "left")
DATA_FORMATS = ("NCHW", "NHWC")


def moves(links, me, reverse=False):
    """Rank `me`'s sends and receives, in the links' global order.

    With `reverse`, every link runs from its receiver back to its sender
    (the backward pass of the forward exchange).
    """
    out = []
    for link in links:
        src, dst, out_slot, in_slot = link
        if reverse:
            src, dst, out_slot, in_slot = dst, src, in_slot, out_slot
        if src == me:
            out.append(Move("send", dst, out_slot))
        elif dst == me:
            out.append(Move("recv", src, in_slot))
    return out


def _sorted(links):
    return sorted(links, key=lambda t: (min(t.src, t.dst), max(t.src, t.dst), t.src, t.send_slot))


def _members(rows, group, tables):
    """The ranks the table rows belong to: `group`'s, or 0..rows-1."""
    if group is None:
        return tuple(range(rows))
    ranks = tuple(sorted(getattr(group, "ranks", group)))
    if len(ranks) != rows:
        raise ValueError(
            f"{tables} must have one row per member of `group` {list(ranks)}. "
            f"Received: {rows} rows"
        )
    return ranks


def _is_list(value):
    return not isinstance(value, (str, bytes)) and hasattr(value, "__iter__")


def normalize_shape(shape, name):
    """A shape as a tuple of ints >= 0 and None."""
    if not _is_list(shape):
        raise TypeError(f"`{name}` must be a list of ints (or None). Received: {name}={shape!r}")
    out = []
    for d in shape:
        if d is not None and (isinstance(d, bool) or not isinstance(d, int) or d < 0):
            raise ValueError(
                f"`{name}` entries must be ints >= 0 or None. Received: {name}={shape!r}"
            )
        out.append(None if d is None else int(d))
    return tuple(out)


def normalize_table(table, width, name, none_value=None):
    """A list of rows (one per group member) of `width` ranks or None."""
    if not _is_list(table):
        raise TypeError(
            f"`{name}` must be a list with one row (list of ranks) per group "
            f"member. Received: {name}={table!r}"
        )
    rows = []
    for p, row in enumerate(table):
        if not _is_list(row):
            raise TypeError(f"`{name}[{p}]` must be a list of ranks. Received: {name}={table!r}")
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
                out.append(_validation.rank(r, f"{name}[{p}] entry"))
        rows.append(tuple(out))
    if not rows:
        raise ValueError(f"`{name}` must not be empty. Received: {name}={table!r}")
    return tuple(rows)


# ---------------------------------------------------------------------------
# neighbor_exchange: k input slots, m output slots per rank.
# ---------------------------------------------------------------------------


def exchange_plan(send_ranks, recv_ranks, send_shapes, recv_shapes, group=None):
    """Validates a `neighbor_exchange` pattern; returns its links in order.

    Args:
        send_ranks: one row per group member (ascending ranks); row p lists,
            for each input slot, the global rank that member sends it to, or
            None.
        recv_ranks: one row per group member; for each output slot, the
            global rank it is received from, or None (the output is zeros).
        send_shapes: one shape per input slot (the same on every rank).
        recv_shapes: one shape per output slot; None dims are the first
            input's dims at run time.
        group: a `Group` (or its sorted ranks), or None for ranks
            0..len(rows)-1.

    Returns:
        (ranks, send_ranks, recv_ranks, send_shapes, recv_shapes, links):
        the rows' ranks, the normalized tables and shapes, and the `Link`s
        (slot = input / output index) in the order every rank follows.

    Raises:
        TypeError, ValueError: naming the argument and the value.
    """
    send_shapes = [normalize_shape(s, f"send_shapes[{i}]") for i, s in enumerate(send_shapes)]
    recv_shapes = [normalize_shape(s, f"recv_shapes[{i}]") for i, s in enumerate(recv_shapes)]
    send_ranks = normalize_table(send_ranks, len(send_shapes), "send_ranks")
    recv_ranks = normalize_table(recv_ranks, len(recv_shapes), "recv_ranks")
    if len(send_ranks) != len(recv_ranks):
        raise ValueError(
            "`send_ranks` and `recv_ranks` must have one row per group member "
            f"each. Received: len(send_ranks)={len(send_ranks)}, "
            f"len(recv_ranks)={len(recv_ranks)}"
        )
    ranks = _members(len(send_ranks), group, "`send_ranks` and `recv_ranks`")
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
    links = []
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
            links.append(Link(key[0], key[1], i, j))
    return ranks, send_ranks, recv_ranks, send_shapes, recv_shapes, _sorted(links)


# ---------------------------------------------------------------------------
# halo_exchange: 8 directions around a tile of a 2-D grid.
# ---------------------------------------------------------------------------


def halo_rank_ids(grid_rows, grid_cols, periodic=False):
    """The 8-neighbour table of a row-major 2-D grid of ranks.

    Rank ``r = row * grid_cols + col`` holds tile (row, col) of the image.
    Returns one row per rank of 8 neighbour ranks in the order [top,
    top_right, right, bottom_right, bottom, bottom_left, left, top_left],
    -1 where there is none. The same table serves as `send_rank_ids` and
    `recv_rank_ids` (the tile above sends its bottom rows to you and you
    send your top rows to it).

    Args:
        grid_rows, grid_cols: ints >= 1.
        periodic: wrap around the edges (a torus). A neighbour that would be
            the rank itself is -1.
    """
    for v, n in ((grid_rows, "grid_rows"), (grid_cols, "grid_cols")):
        _validation.positive_int(v, n)
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


def check_data_format(data_format):
    """Returns `data_format` if it is "NCHW" or "NHWC"."""
    if data_format not in DATA_FORMATS:
        raise ValueError(
            f"`data_format` must be 'NCHW' or 'NHWC'. Received: data_format={data_format!r}"
        )
    return data_format


def normalize_lens(value, name):
    """4 ints >= 0: [top, bottom, left, right]."""
    if not _is_list(value) or len(value) != 4:
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
    """Validates a `halo_exchange` pattern; returns its links in order.

    Returns (ranks, send table, send_lens, recv table, recv_lens, links):
    a link's `send_slot` is the sender's direction d (0..7, its strip) and
    its `recv_slot` the opposite direction (d + 4) % 8 (the receiver's halo).
    A strip of zero rows or columns is not sent.
    """
    send_lens = normalize_lens(send_lens, "send_lens")
    recv_lens = normalize_lens(recv_lens, "recv_lens")
    send = normalize_table(send_rank_ids, 8, "send_rank_ids", none_value=-1)
    recv = normalize_table(recv_rank_ids, 8, "recv_rank_ids", none_value=-1)
    if len(send) != len(recv):
        raise ValueError(
            "`send_rank_ids` and `recv_rank_ids` must have one row per group member. "
            f"Received: {len(send)} and {len(recv)} rows"
        )
    ranks = _members(len(send), group, "`send_rank_ids`")
    pos = {r: p for p, r in enumerate(ranks)}
    links = []
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
                        links.append(Link(me, peer, d, opposite))
    return ranks, send, send_lens, recv, recv_lens, _sorted(links)


def halo_regions(height, width, send_lens, recv_lens):
    """Where each direction's strip and halo lie, as ((row0, row1), (col0, col1)).

    Returns (strips, halos, interior): ``strips[d]`` is the strip a tile
    sends in direction d, in tile coordinates (height x width); ``halos[e]``
    the halo it receives on side e and ``interior`` the tile itself, in the
    coordinates of the padded output (height + top + bottom rows, width +
    left + right columns of `recv_lens`).
    """
    st, sb, sl, sr = send_lens
    rt, rb, rl, rr = recv_lens
    ph, pw = rt + height + rb, rl + width + rr
    strip_rows = {"top": (0, st), "bottom": (height - sb, height), "all": (0, height)}
    strip_cols = {"left": (0, sl), "right": (width - sr, width), "all": (0, width)}
    halo_rows = {"top": (0, rt), "bottom": (rt + height, ph), "all": (rt, rt + height)}
    halo_cols = {"left": (0, rl), "right": (rl + width, pw), "all": (rl, rl + width)}
    strips = [(strip_rows[_VERT[d]], strip_cols[_HORZ[d]]) for d in range(8)]
    halos = [(halo_rows[_VERT[e]], halo_cols[_HORZ[e]]) for e in range(8)]
    return strips, halos, ((rt, rt + height), (rl, rl + width))
