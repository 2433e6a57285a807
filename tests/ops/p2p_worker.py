"""Multi-process check of the point-to-point family against float64 references.

Run by tests/ops/test_p2p_multiprocess.py through `run_cluster` (TF_CONFIG set by
the launcher). Every worker computes the single-process simulation of all n
replicas locally (inputs are deterministic functions of the rank) and writes
per-case max errors with `write_result`.

The case builders (`cases(n)`) are also used by the in-process tests, so both
levels check the same references. Importing this module has no side effects.
"""


import numpy as np
import tensorflow as tf

from keras_comm import ops


def _rank_input(shape, scale=1.0):
    def make(rank, n):
        size = int(np.prod(shape))
        return (np.arange(size, dtype=np.float64).reshape(shape) + 1 + 100 * rank) * scale
    return make


# --- send / receive ---------------------------------------------------------

def p2p_routes(n):
    """{receiver: sender}: pairs (0->1), (2->3), ...; with odd n, n-1 -> 0."""
    routes = {r + 1: r for r in range(0, n - 1, 2)}
    if n % 2:
        routes[0] = n - 1
    return routes


def send_receive_case(n):
    recv_from = p2p_routes(n)
    send_to = {s: d for d, s in recv_from.items()}

    def op_fn(x):
        y = ops.send(x, send_to, tag=3, timeout=60)
        return ops.receive(y, recv_from, tag=3, timeout=60)

    def ref_fn(xs):
        # Rank 0 may both send (to 1) and receive (from n-1): send first.
        return [xs[recv_from[r]] if r in recv_from else xs[r] for r in range(n)]

    return op_fn, ref_fn, _rank_input([2, 3])


# --- neighbour exchange -------------------------------------------------------

def ring_pattern(n):
    send = [[(r + 1) % n] for r in range(n)]
    recv = [[(r - 1) % n] for r in range(n)]
    return send, recv


def asymmetric_pattern(n):
    """Two input slots, two output slots, uneven fan-in/fan-out."""
    send = [[None, None] for _ in range(n)]
    recv = [[None, None] for _ in range(n)]
    # rank 0 sends both slots to rank 1 (two transfers on one pair, in slot order)
    send[0] = [1, 1]
    recv[1] = [0, 0]
    if n >= 3:
        # rank 2 sends slot 1 to rank 0; rank n-1 sends slot 0 to rank 2 if distinct
        send[2][1] = 0
        recv[0][0] = 2
    if n >= 4:
        send[3][0] = 2
        recv[2][1] = 3
        send[1][0] = 3
        recv[3][0] = 1
    return send, recv


def _exchange_ref(send, recv, n, k, m, group=None):
    """The exchange simulated from the op's definition, not from keras_comm's plan.

    Row p of the tables belongs to group member p. Output slot j of member b
    receives from a = recv[b][j]; if it is the c-th slot of b that receives
    from a, it holds the c-th input slot of a that a sends to b. Zeros where
    the slot is None and on ranks outside the group.
    """
    members = list(range(n)) if group is None else sorted(group)

    def ref_fn(xs):
        ys = [[tf.zeros([3], xs[0].dtype) for _ in range(m)] for _ in range(n)]
        for b, row in enumerate(recv):
            for j, a in enumerate(row):
                if a is None:
                    continue
                c = sum(1 for src in row[:j] if src == a)
                to_b = [i for i, dst in enumerate(send[members.index(a)]) if dst == members[b]]
                ys[members[b]][j] = xs[a][to_b[c]]
        return [tf.stack(y) for y in ys]

    return ref_fn


def neighbor_case(n, pattern, group=None):
    send, recv = pattern(n) if callable(pattern) else pattern
    k, m = len(send[0]), len(recv[0])

    def op_fn(x):
        outs = ops.neighbor_exchange(
            [x[i] for i in range(k)], send, recv, [[3]] * m, [[3]] * k,
            recv_dtype=x.dtype, group=group, timeout=60,
        )
        return tf.stack(outs)

    return op_fn, _exchange_ref(send, recv, n, k, m, group), _rank_input([k, 3])


# --- halo exchange ------------------------------------------------------------

def halo_case(n, data_format="NCHW", send_lens=(1, 2, 1, 2), recv_lens=(2, 1, 2, 1)):
    rows, cols = (2, 2) if n == 4 else (1, n)
    h, w, c = 3, 4, 2
    ids = ops.halo_rank_ids(rows, cols)
    t, b, l, r = recv_lens

    def global_image():
        a = np.arange(rows * h * cols * w * c, dtype=np.float64) + 1
        return a.reshape(1, c, rows * h, cols * w)  # NCHW

    def to_format(a):
        return a if data_format == "NCHW" else np.transpose(a, (0, 2, 3, 1))

    def make(rank, n_):
        i, j = divmod(rank, cols)
        return to_format(global_image()[:, :, i * h:(i + 1) * h, j * w:(j + 1) * w]).copy()

    def op_fn(x):
        return ops.neighbor_exchange_v2(
            x, ids, list(send_lens), ids, list(recv_lens), data_format=data_format, timeout=60
        )

    def ref_fn(xs):
        # Reassemble the global image from the tiles (differentiably), pad by
        # recv_lens with zeros, and cut each rank's window.
        ha, wa = (2, 3) if data_format == "NCHW" else (1, 2)
        grid = [tf.concat(xs[i * cols:(i + 1) * cols], axis=wa) for i in range(rows)]
        image = tf.concat(grid, axis=ha)
        pads = [[0, 0]] * 4
        pads[ha], pads[wa] = [t, b], [l, r]
        padded = tf.pad(image, pads)
        out = []
        for rank in range(n):
            i, j = divmod(rank, cols)
            begin = [0, 0, 0, 0]
            size = [-1, -1, -1, -1]
            begin[ha], size[ha] = i * h, t + h + b
            begin[wa], size[wa] = j * w, l + w + r
            out.append(tf.slice(padded, begin, size))
        return out

    return op_fn, ref_fn, make


# --- all_swap ------------------------------------------------------------------

def swap_sizes(n):
    return [[(i + 2 * j) % 3 for j in range(n)] for i in range(n)]


def all_swap_case(n, with_recv=True, group=None):
    ranks = list(range(n)) if group is None else sorted(group)
    g = len(ranks)
    sizes = swap_sizes(g)

    def make(rank, n_):
        rows = sum(sizes[ranks.index(rank)]) if rank in ranks else 2
        return _rank_input([rows, 2])(rank, n_)

    def op_fn(x):
        from keras_comm import rank as current_rank
        me = current_rank()
        if me not in ranks:
            return ops.all_swap(x, [1] * g, group=group, timeout=60)  # non-member: pass through
        p = ranks.index(me)
        recv = [sizes[i][p] for i in range(g)] if with_recv else None
        return ops.all_swap(x, sizes[p], recv, group=group, timeout=60)

    def ref_fn(xs):
        out = list(xs)
        for p, rank in enumerate(ranks):
            pieces = []
            for i, src in enumerate(ranks):
                off = sum(sizes[i][:p])
                pieces.append(xs[src][off:off + sizes[i][p]])
            out[rank] = tf.concat(pieces, 0)
        return out

    return op_fn, ref_fn, make


# --- host collectives -----------------------------------------------------------

def host_case(n, which, group=None):
    ranks = list(range(n)) if group is None else sorted(group)
    g = len(ranks)

    if which == "gather":
        make = _rank_input([2, 3])

        def op_fn(x):
            return ops.host_all_gather(x, group=group, timeout=60)

        def ref_fn(xs):
            full = tf.concat([xs[r] for r in ranks], 0)
            return [full if r in ranks else xs[r] for r in range(n)]
    else:
        make = _rank_input([2 * g, 3])

        def op_fn(x):
            return ops.host_reduce_scatter(x, group=group, timeout=60)

        def ref_fn(xs):
            total = tf.add_n([xs[r] for r in ranks])
            return [total[2 * ranks.index(r):2 * ranks.index(r) + 2] if r in ranks else xs[r]
                    for r in range(n)]

    return op_fn, ref_fn, make


def cases(n):
    """Every (name, op_fn, ref_fn, make_input) the multi-process run checks."""
    out = [
        ("send_receive", *send_receive_case(n)),
        ("ring", *neighbor_case(n, ring_pattern)),
        ("asymmetric", *neighbor_case(n, asymmetric_pattern)),
        ("halo_nchw", *halo_case(n, "NCHW")),
        ("halo_nhwc", *halo_case(n, "NHWC")),
        ("all_swap", *all_swap_case(n)),
        ("all_swap_subgroup", *all_swap_case(n, group=[0, n - 1])),
        ("host_gather", *host_case(n, "gather")),
        ("host_reduce_scatter", *host_case(n, "scatter")),
        ("host_gather_subgroup", *host_case(n, "gather", group=[0, n - 1])),
    ]
    return out


# --- worker main -------------------------------------------------------------------

def _loss(rank, y):
    w = tf.random.stateless_uniform(tf.shape(y), seed=[rank, 2024], minval=0.5,
                                    maxval=1.5, dtype=y.dtype)
    return tf.reduce_sum(w * y)


def _reference(n, ref_fn, make):
    xs = [tf.constant(make(r, n)) for r in range(n)]
    with tf.GradientTape() as tape:
        for x in xs:
            tape.watch(x)
        ys = ref_fn(xs)
        total = tf.add_n([_loss(r, y) for r, y in enumerate(ys)])
    grads = tape.gradient(total, xs, unconnected_gradients=tf.UnconnectedGradients.ZERO)
    return [(np.asarray(y), np.asarray(g)) for y, g in zip(ys, grads)]


def results(strategy):
    """Every case's errors and the timeout's outcome on this worker. Run it
    last in a launch: the timed-out receive aborts this process's
    collectives (see below)."""
    import keras_comm
    from _cluster import rank as cluster_rank

    n = strategy.num_replicas_in_sync
    me = cluster_rank()
    result = {"n": n, "errors": {}}
    all_cases = cases(n)
    wants = {name: _reference(n, ref_fn, make)[me] for name, _, ref_fn, make in all_cases}

    def replica_fn():
        # Every case in one step: one trace and one call per mode.
        r = keras_comm.rank()
        out = {}
        for name, op_fn, _, make in all_cases:
            x = tf.constant(make(r, n))
            with tf.GradientTape() as tape:
                tape.watch(x)
                y = op_fn(x)
                loss = _loss(r, y)
            out[name] = (y, tape.gradient(loss, x, unconnected_gradients=tf.UnconnectedGradients.ZERO))
        return out

    for mode in ("function", "eager"):
        if mode == "function":
            got = tf.function(lambda: strategy.run(replica_fn))()
        else:
            got = strategy.run(replica_fn)
        for name, (y, g) in got.items():
            y, g = np.asarray(y), np.asarray(g)
            want = wants[name]
            ok_shape = y.shape == want[0].shape and g.shape == want[1].shape
            err = float(max(np.max(np.abs(y - want[0]), initial=0.0),
                            np.max(np.abs(g - want[1]), initial=0.0))) if ok_shape else float("inf")
            result["errors"][f"{name}/{mode}"] = err
    # Last, because a timed-out collective aborts this process's collective
    # executor: a receive whose sender never sends fails after `timeout`.
    import time

    def orphan_receive():
        return ops.receive(tf.ones([1]), 0, tag=77, dest=1, timeout=1.0)

    start = time.time()
    try:
        tf.function(lambda: strategy.run(orphan_receive))()
        result["timeout_error"] = None
    except tf.errors.DeadlineExceededError:
        result["timeout_error"] = "DeadlineExceededError"
    result["timeout_seconds"] = time.time() - start
    return result


if __name__ == "__main__":
    # One group alone (the suite runs it in tests/acceptance/shared_launch_worker.py).
    from _cluster import finish, write_result
    from _strategy import strategy

    write_result(results(strategy))
    # Rank 1's receive first resolves its group through task 0; if task 0
    # exited meanwhile, rank 1 would see "Socket closed" (UnavailableError)
    # instead of its timeout. finish() keeps every rank up until all wrote.
    finish()
