"""Collective bandwidth and layer overhead: keras_comm layers vs raw TF collectives.

Worker side (`measure`, run inside each TensorFlow worker): for every op and
size, five kinds of compiled step run interleaved in the same processes,
their order rotated every iteration so no variant always goes first, each
timed from a barrier (see `_Barrier`):

* ``layer_fwd``     -- the keras_comm layer's forward;
* ``raw_fwd``       -- the raw `collective_ops.*_v2` call doing the same
  communication, placed on the replica's device with an ordering token, as
  tf.distribute's own ``CollectiveReplicaLauncher`` calls it;
* ``layer_fwd_bwd`` -- forward and backward of the layer (GradientTape with
  an upstream gradient);
* ``raw_fwd_bwd``   -- the raw collectives of that forward and backward, the
  backward ordered after the forward;
* ``raw_allreduce_slice`` (reduce_scatter only) -- all-reduce then keep this
  rank's slice: what a reduce-scatter costs without our all-to-all.

Every step is ``tf.function(lambda ...: strategy.run(...))``; raw steps get
their instance keys as a call argument, ours draw them at call time
(``capture_call_time_value``), so both pay one small host tensor per call.

Steps do not end at the same moment on every rank: a broadcast's root
returns once its data is handed over, while the receivers are still
copying. Without a barrier that skew is charged to whichever step runs
next, and rotating the order does not spread it, because a rotation keeps
every variant's predecessor (e.g. ``layer_fwd_bwd`` always ran right after
``raw_fwd``, and measured up to 1.2x ``raw_fwd_bwd`` for broadcast at 64 MB,
with the two steps doing the same communication and local work). So every
timed call starts right after an untimed barrier that all ranks leave
together.

Driver side (`summarize`): per-iteration maximum over ranks, medians,
algbw/busbw with nccl-tests' factors, and paired keras_comm/raw ratios.
"""

import contextlib
import time

from benchmarks import _stats

VARIANTS = ("layer_fwd", "raw_fwd", "layer_fwd_bwd", "raw_fwd_bwd")
RS_EXTRA = "raw_allreduce_slice"

# Raw TF group key: above tf.distribute's keys (counted from 1) and above the
# range keras_comm's topology.group_key hashes into (< 2**30).
_RAW_GROUP_KEY = (1 << 30) + 17
_BARRIER_GROUP_KEY = _RAW_GROUP_KEY + 1
# Every collective with a timeout -- keras_comm's always have one -- makes
# TensorFlow start two watchdog threads that sleep for the whole timeout
# (Env::SchedClosureAfter). A worker holds about 2 x collectives/s x timeout
# of them; at keras_comm's default 300 s, the thousands of collectives of the
# collectives and fusion families pass the ~32k threads a process can map
# (vm.max_map_count 65530) and TensorFlow aborts ("Resource temporarily
# unavailable"). So the timed families run raw and keras_comm collectives
# alike with this shorter timeout: same watchdog cost per call, fewer alive.
_TIMEOUT_SECONDS = 30.0


@contextlib.contextmanager
def short_timeout():
    """keras_comm's default collective timeout is `_TIMEOUT_SECONDS` inside."""
    import keras_comm

    previous = keras_comm.get_timeout()
    keras_comm.set_timeout(_TIMEOUT_SECONDS)
    try:
        yield
    finally:
        keras_comm.set_timeout(previous)


class _Raw:
    """Raw TF collectives for one replica: fixed group key, keys per call."""

    def __init__(self, n):
        import tensorflow as tf
        from tensorflow.python.distribute import device_util
        from tensorflow.python.ops import resource_variable_ops

        self.n = n
        self.device = device_util.canonicalize("/device:CPU:0", device_util.current())
        with tf.device(self.device):
            self.token = resource_variable_ops.ResourceVariable(
                0.0, trainable=False, name="bench_raw_ordering_token"
            )
    # Instance keys must never repeat within the group, across every _Raw.
    _next = 1

    def keys(self):
        """Two fresh instance keys (forward, backward) for one call."""
        import tensorflow as tf

        key = _Raw._next
        _Raw._next += 2
        return tf.constant(key, tf.int32)

    def _common(self, key):
        return dict(
            group_size=self.n,
            group_key=_RAW_GROUP_KEY,
            instance_key=key,
            communication_hint="auto",
            timeout=_TIMEOUT_SECONDS,
        )

    def all_reduce(self, x, key):
        from tensorflow.python.ops import collective_ops

        return collective_ops.all_reduce_v2(
            x, merge_op="Add", final_op="Id", ordering_token=self.token.handle, **self._common(key)
        )

    def all_gather(self, x, key):
        from tensorflow.python.ops import collective_ops

        return collective_ops.all_gather_v2(x, ordering_token=self.token.handle, **self._common(key))

    def all_to_all(self, x, key):
        """Row block i to rank i (x's rows split in n; a reshape, no copy)."""
        import tensorflow as tf
        from tensorflow.python.ops import collective_ops

        chunks = tf.reshape(x, [self.n, -1, x.shape[-1]])
        out = collective_ops.all_to_all_v2(chunks, ordering_token=self.token.handle, **self._common(key))
        return tf.reshape(out, x.shape)

    def reduce_scatter(self, x, key):
        """TF has no CPU reduce-scatter kernel: all-to-all + local sum."""
        import tensorflow as tf
        from tensorflow.python.ops import collective_ops

        chunks = tf.reshape(x, [self.n, -1, x.shape[-1]])
        out = collective_ops.all_to_all_v2(chunks, ordering_token=self.token.handle, **self._common(key))
        return tf.reduce_sum(out, axis=0)

    def all_reduce_slice(self, x, key, index):
        rows = x.shape[0] // self.n
        return self.all_reduce(x, key)[index * rows:(index + 1) * rows]

    def broadcast(self, x, key, is_root):
        import tensorflow as tf
        from tensorflow.python.ops import collective_ops

        if is_root:
            return collective_ops.broadcast_send_v2(x, **self._common(key))
        return collective_ops.broadcast_recv_v2(tf.shape(x), x.dtype, **self._common(key))


class _Barrier:
    """Returns on every rank only once every rank has called it.

    A one-float all-reduce on its own group key, compiled once; all ranks
    leave it within a small message's latency of each other, so the step
    timed after it starts together everywhere.
    """

    def __init__(self, strategy):
        import tensorflow as tf
        from tensorflow.python.distribute import device_util
        from tensorflow.python.ops import collective_ops

        n = strategy.num_replicas_in_sync
        device = device_util.canonicalize("/device:CPU:0", device_util.current())

        def step(k):
            with tf.device(device):
                return collective_ops.all_reduce_v2(
                    tf.constant(1.0), group_size=n, group_key=_BARRIER_GROUP_KEY,
                    instance_key=k, merge_op="Add", final_op="Id", timeout=_TIMEOUT_SECONDS,
                )

        self._fn = tf.function(lambda k: strategy.run(step, args=(k,)))

    # Instance keys must never repeat within the barrier's group, across
    # every _Barrier of the process (each benchmark family builds its own).
    _next = 1

    def __call__(self):
        import tensorflow as tf

        key = _Barrier._next
        _Barrier._next += 1
        self._fn(tf.constant(key, tf.int32))


def _layer(op, n):
    from keras_comm import layers

    return {
        "all_reduce": lambda: layers.AllReduce("sum", name="bench_all_reduce"),
        "all_gather": lambda: layers.AllGather(name="bench_all_gather"),
        "reduce_scatter": lambda: layers.ReduceScatter(name="bench_reduce_scatter"),
        "all_to_all": lambda: layers.AlltoAll(n, 0, 0, name="bench_all_to_all"),
        "broadcast": lambda: layers.Broadcast(0, name="bench_broadcast"),
    }[op]()


def _raw_steps(op, raw, rank):
    """(forward(x, key), forward_backward(x, w, key)) for one op, raw TF."""
    import tensorflow as tf

    def after(y, fn):
        # The backward runs after the forward, as in a real step.
        with tf.control_dependencies([y]):
            return fn()

    if op == "all_reduce":
        fwd = raw.all_reduce
        bwd = raw.all_reduce
    elif op == "all_gather":
        fwd = raw.all_gather
        bwd = raw.reduce_scatter
    elif op == "reduce_scatter":
        fwd = raw.reduce_scatter
        bwd = raw.all_gather
    elif op == "all_to_all":
        fwd = raw.all_to_all
        bwd = raw.all_to_all
    elif op == "broadcast":
        def fwd(x, key):
            return raw.broadcast(x, key, rank == 0)

        def bwd(w, key):
            total = raw.all_reduce(w, key)
            return total if rank == 0 else tf.zeros_like(total)
    else:
        raise ValueError(op)

    def forward(x, w, key):
        with tf.device(raw.device):
            return fwd(x, key)

    def forward_backward(x, w, key):
        with tf.device(raw.device):
            y = fwd(x, key)
            dx = after(y, lambda: bwd(w, key + 1))
        return y, dx

    return forward, forward_backward


def _on(device, fn):
    import tensorflow as tf

    def placed(*args):
        with tf.device(device):
            return fn(*args)

    return placed


def _build_steps(strategy, op, size_mb, n, rank):
    """The compiled steps of every variant of (op, size), and their inputs."""
    import tensorflow as tf

    in_shape, out_shape, size_bytes = _stats.shapes(op, size_mb, n)
    x = tf.random.stateless_uniform(in_shape, seed=[rank, 1])
    w = tf.random.stateless_uniform(out_shape, seed=[rank, 2])
    layer = _layer(op, n)
    raw = _Raw(n)
    raw_fwd, raw_fwd_bwd = _raw_steps(op, raw, rank)

    def layer_fwd_bwd(x, w):
        with tf.GradientTape() as tape:
            tape.watch(x)
            y = layer(x)
        return y, tape.gradient(y, x, output_gradients=w)

    fns = {
        "layer_fwd": tf.function(lambda x, w: strategy.run(layer, args=(x,))),
        "raw_fwd": tf.function(lambda x, w, k: strategy.run(raw_fwd, args=(x, w, k))),
        "layer_fwd_bwd": tf.function(lambda x, w: strategy.run(layer_fwd_bwd, args=(x, w))),
        "raw_fwd_bwd": tf.function(lambda x, w, k: strategy.run(raw_fwd_bwd, args=(x, w, k))),
    }
    if op == "reduce_scatter":
        fns[RS_EXTRA] = tf.function(
            lambda x, w, k: strategy.run(_on(raw.device, lambda x, k: raw.all_reduce_slice(x, k, rank)), args=(x, k))
        )

    def caller(name):
        fn = fns[name]
        if name.startswith("raw"):
            return lambda: fn(x, w, raw.keys())
        return lambda: fn(x, w)

    return {name: caller(name) for name in fns}, size_bytes


def time_interleaved(calls, barrier, iters, warmup):
    """Times the steps in `calls` ({name: no-argument callable}) side by side.

    Each iteration runs every step once, the order rotated every iteration
    so no variant always runs first (every rank uses the same order), each
    call timed from right after `barrier()`, which keeps one step's uneven
    end across ranks out of the next step's time.

    Returns:
        {name: [seconds]}, `iters` timings per name.
    """
    names = list(calls)
    for _ in range(warmup):
        for name in names:
            barrier()
            calls[name]()
    times = {name: [] for name in names}
    for i in range(iters):
        shift = i % len(names)
        for name in names[shift:] + names[:shift]:
            barrier()
            start = time.perf_counter()
            calls[name]()
            times[name].append(time.perf_counter() - start)
    return times


def measure(strategy, ops, sizes_mb, iters, warmup, log=print):
    """Times every variant of every (op, size) on this rank.

    Returns:
        {op: {str(size_mb): {"size_bytes": S, "times": {variant: [seconds]}}}}
    """
    with short_timeout():
        return _measure(strategy, ops, sizes_mb, iters, warmup, log)


def _measure(strategy, ops, sizes_mb, iters, warmup, log):
    n = strategy.num_replicas_in_sync
    rank = strategy.cluster_resolver.task_id or 0
    barrier = _Barrier(strategy)
    out = {}
    for op in ops:
        out[op] = {}
        for size_mb in sizes_mb:
            calls, size_bytes = _build_steps(strategy, op, size_mb, n, rank)
            times = time_interleaved(calls, barrier, iters, warmup)
            out[op][_size_key(size_mb)] = {"size_bytes": size_bytes, "times": times}
            if rank == 0:
                med = {k: f"{_stats.summary(v)['median_s'] * 1e3:.1f}ms" for k, v in times.items()}
                log(f"[collectives n={n}] {op} {size_mb} MB: {med}")
    return out


def _size_key(size_mb):
    return f"{size_mb:g}"


def summarize(per_rank, n):
    """Merges the ranks' `measure` outputs into the report's numbers.

    Returns:
        {op: {size: {"size_bytes", "variants": {variant: {median_s, p10_s,
        p90_s, iters, algbw_GBps, busbw_GBps}}, "ratio_fwd", "ratio_fwd_bwd",
        "ratio_fwd_of_medians", "ratio_fwd_bwd_of_medians"}}}
    """
    ops = per_rank[0]
    out = {}
    for op, by_size in ops.items():
        out[op] = {}
        for size, entry in by_size.items():
            size_bytes = entry["size_bytes"]
            merged = {
                name: _stats.per_iteration_max([r[op][size]["times"][name] for r in per_rank])
                for name in entry["times"]
            }
            variants = {}
            for name, times in merged.items():
                s = _stats.summary(times)
                if "bwd" not in name:
                    s.update(_stats.bandwidths(op, size_bytes, n, s["median_s"]))
                variants[name] = s
            row = {"size_bytes": size_bytes, "variants": variants}
            for kind in ("fwd", "fwd_bwd"):
                a, b = merged[f"layer_{kind}"], merged[f"raw_{kind}"]
                row[f"ratio_{kind}"] = _stats.paired_ratio(a, b)
                row[f"ratio_{kind}_p10"], row[f"ratio_{kind}_p90"] = _stats.paired_ratio_spread(a, b)
                row[f"ratio_{kind}_of_medians"] = (
                    variants[f"layer_{kind}"]["median_s"] / variants[f"raw_{kind}"]["median_s"]
                )
            out[op][size] = row
    return out


def reduce_scatter_comparison(summary_by_n):
    """Rows: ours (all-to-all + sum) vs all-reduce-then-slice, per n and size."""
    rows = []
    for n, ops in sorted(summary_by_n.items()):
        for size, row in ops.get("reduce_scatter", {}).items():
            v = row["variants"]
            if RS_EXTRA not in v:
                continue
            s = row["size_bytes"]
            rows.append(
                {
                    "workers": n,
                    "size_mb": float(size),
                    "ours_a2a_sum_s": v["layer_fwd"]["median_s"],
                    "raw_a2a_sum_s": v["raw_fwd"]["median_s"],
                    "allreduce_slice_s": v[RS_EXTRA]["median_s"],
                    "ours_bytes_sent_per_rank": _stats.bytes_sent_per_rank("all_to_all", s, n),
                    "allreduce_bytes_sent_per_rank": _stats.bytes_sent_per_rank("all_reduce", s, n),
                    "speedup_vs_allreduce_slice": v[RS_EXTRA]["median_s"] / v["layer_fwd"]["median_s"],
                }
            )
    return rows
