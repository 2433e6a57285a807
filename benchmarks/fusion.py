"""Fusion groups: what packing the backward all-reduces of M mirrors buys.

Worker side (`measure`, run inside each TensorFlow worker): for M float32
"parameters" w_1..w_M (equal sizes, S bytes in all) every step is the
forward and backward of their mirrors -- ``tape.gradient`` of the mirrored
copies with an upstream gradient dy_i per parameter -- so its communication
is the M backward all-reduces and nothing else. Three compiled steps run
interleaved in the same processes, each timed from the untimed barrier of
`benchmarks.collectives` (order rotated every iteration):

* ``unfused``    -- ``mirror_operator(w, fusion=0)`` each: M all-reduces;
* ``fused``      -- ``mirror_operator(w, fusion=1)`` inside `fusion_scope`:
  keras_comm packs them into one all-reduce of the concatenation;
* ``raw_packed`` -- the raw TF reference: the local gradients flattened,
  concatenated, sent as ONE ``collective_ops.all_reduce_v2`` (ordering
  token, as tf.distribute calls it) and split back -- what MWMS does with
  its gradients under ``bytes_per_pack``.

Before timing, each (M, size) is checked once, and the benchmark fails if
the check does: the fused step's graph holds exactly one CollectiveReduceV2
per replica (unfused: M, raw: 1), and the fused, unfused and raw gradients
agree.

``kind="all_gather"`` measures the same for M parameter *shards* gathered
by ``all_gather`` (each step: M forward all-gathers and M backward
reduce-scatters, an all-to-all each on CPU): ``unfused`` (fusion=0) against
``fused`` (fusion=1, one all-gather and one all-to-all per step); the check
counts both kinds of op. There is no raw TF reference for it. Run it alone
with ``keras-comm-run -n 2 -m benchmarks.fusion --kind all_gather``.

Driver side (`summarize`): per-iteration maximum over ranks, medians, and
the paired ratios unfused/fused (what fusion buys) and fused/raw_packed
(what keras_comm's packing costs over TF's).
"""

from benchmarks import _stats
from benchmarks import collectives

GATHER_VARIANTS = ("unfused", "fused")

VARIANTS = ("unfused", "fused", "raw_packed")
_FUSION_ID = 1


def parameter_shapes(count, size_mb):
    """Shapes of `count` equal float32 parameters totalling about `size_mb` MB.

    Rows of `_stats.COLS` columns, at least one row each.
    """
    rows = max(1, round(size_mb * _stats.MIB / (count * _stats.COLS * _stats.ITEMSIZE)))
    return [(rows, _stats.COLS)] * count


def _build_steps(strategy, raw, shapes, rank):
    """The compiled steps of every variant, their inputs, and one check."""
    import tensorflow as tf

    from keras_comm import ops as kc_ops

    ws = [tf.random.stateless_uniform(s, seed=[rank, 2 * i + 1]) for i, s in enumerate(shapes)]
    dys = [tf.random.stateless_uniform(s, seed=[rank, 2 * i + 2]) for i, s in enumerate(shapes)]

    def mirrored(fusion):
        def step(ws, dys):
            with tf.GradientTape() as tape:
                tape.watch(ws)
                ys = [kc_ops.mirror_operator(w, mean=False, fusion=fusion) for w in ws]
            return tape.gradient(ys, ws, output_gradients=dys)

        return step

    def fused_step(ws, dys):
        with kc_ops.fusion_scope():
            return mirrored(_FUSION_ID)(ws, dys)

    def raw_step(ws, dys, key):
        with tf.GradientTape() as tape:
            tape.watch(ws)
            ys = [tf.identity(w) for w in ws]
        local = tape.gradient(ys, ws, output_gradients=dys)
        with tf.device(raw.device):
            packed = raw.all_reduce(tf.concat([tf.reshape(g, [-1]) for g in local], 0), key)
            pieces = tf.split(packed, [g.shape.num_elements() for g in local])
        return [tf.reshape(p, g.shape) for p, g in zip(pieces, local)]

    fns = {
        "unfused": tf.function(lambda ws, dys: strategy.run(mirrored(0), args=(ws, dys))),
        "fused": tf.function(lambda ws, dys: strategy.run(fused_step, args=(ws, dys))),
        "raw_packed": tf.function(lambda ws, dys, k: strategy.run(raw_step, args=(ws, dys, k))),
    }

    def caller(name):
        fn = fns[name]
        if name == "raw_packed":
            return lambda: fn(ws, dys, raw.keys())
        return lambda: fn(ws, dys)

    def graphs():
        """{variant: traced graph}, traced with the arguments the timed calls use."""
        return {
            name: (fn.get_concrete_function(ws, dys, raw.keys()) if name == "raw_packed"
                   else fn.get_concrete_function(ws, dys)).graph
            for name, fn in fns.items()
        }

    return {name: caller(name) for name in fns}, graphs


def _build_gather_steps(strategy, shapes, rank):
    """The compiled unfused / fused all-gather steps (forward and backward)."""
    import tensorflow as tf

    from keras_comm import ops as kc_ops

    n = strategy.num_replicas_in_sync
    ws = [tf.random.stateless_uniform(s, seed=[rank, 2 * i + 1]) for i, s in enumerate(shapes)]
    dys = [
        tf.random.stateless_uniform([n * s[0]] + list(s[1:]), seed=[rank, 2 * i + 2])
        for i, s in enumerate(shapes)
    ]

    def gathered(fusion):
        def step(ws, dys):
            with kc_ops.fusion_scope():
                with tf.GradientTape() as tape:
                    tape.watch(ws)
                    ys = [kc_ops.all_gather(w, fusion=fusion) for w in ws]
                return tape.gradient(ys, ws, output_gradients=dys)

        return step

    fns = {
        name: tf.function(lambda ws, dys, f=f: strategy.run(gathered(f), args=(ws, dys)))
        for name, f in (("unfused", 0), ("fused", _FUSION_ID))
    }

    def graphs():
        return {name: fn.get_concrete_function(ws, dys).graph for name, fn in fns.items()}

    return {name: (lambda fn=fn: fn(ws, dys)) for name, fn in fns.items()}, graphs


def _check_gather(calls, graphs, count, local_replicas):
    """Fails unless the fused step sends one gather and one all-to-all, and values agree."""
    import numpy as np

    counts = {}
    for name, g in graphs().items():
        counts[name] = {
            op: collectives_per_replica(g, local_replicas, op)
            for op in ("CollectiveGatherV2", "CollectiveAllToAllV2")
        }
    expected = {
        "unfused": {"CollectiveGatherV2": count, "CollectiveAllToAllV2": count},
        "fused": {"CollectiveGatherV2": 1, "CollectiveAllToAllV2": 1},
    }
    if counts != expected:
        raise RuntimeError(
            f"fusion benchmark (all_gather): collectives per replica of {count} gathers "
            f"should be {expected}. Received: {counts}"
        )
    grads = {name: [g.numpy() for g in calls[name]()] for name in GATHER_VARIANTS}
    for i, (a, b) in enumerate(zip(grads["fused"], grads["unfused"])):
        np.testing.assert_array_equal(a, b, err_msg=f"fused gradient {i} of {count} differs")
    return {name: c["CollectiveGatherV2"] for name, c in counts.items()}


def collectives_per_replica(graph, replicas, op_type="CollectiveReduceV2"):
    """Ops of `op_type` in `graph`, per replica traced into it."""
    return sum(1 for op in graph.get_operations() if op.type == op_type) / replicas


def _check(calls, graphs, count, local_replicas):
    """Fails loudly unless fusion packs as promised and changes no value.

    Returns:
        {variant: CollectiveReduceV2 ops per replica in its traced step}.
    """
    import numpy as np

    counts = {name: collectives_per_replica(g, local_replicas) for name, g in graphs().items()}
    expected = {"unfused": count, "fused": 1, "raw_packed": 1}
    if counts != expected:
        raise RuntimeError(
            f"fusion benchmark: CollectiveReduceV2 per replica in the traced steps of {count} "
            f"mirrors should be {expected}. Received: {counts}"
        )
    grads = {name: [g.numpy() for g in calls[name]()] for name in VARIANTS}
    for name in ("fused", "raw_packed"):
        for i, (a, b) in enumerate(zip(grads[name], grads["unfused"])):
            # Same sums; only a ring's chunk boundaries (n > 2) may reorder them.
            np.testing.assert_allclose(
                a, b, rtol=1e-6, atol=0,
                err_msg=f"fusion benchmark: {name} gradient {i} of {count} differs from unfused",
            )
    return counts


def measure(strategy, counts, sizes_mb, iters, warmup, log=print, kind="mirror"):
    """Times the variants for every (parameter count, total size) on this rank.

    `kind`: "mirror" (the mirrors' backward all-reduces, three variants) or
    "all_gather" (all-gathers and their backward reduce-scatters: unfused
    and fused).

    Returns:
        {str(count): {str(size_mb): {"size_bytes", "shape", "collectives_per_replica",
        "times": {variant: [seconds]}}}}
    """
    with collectives.short_timeout():
        return _measure(strategy, counts, sizes_mb, iters, warmup, log, kind)


def _measure(strategy, counts, sizes_mb, iters, warmup, log, kind="mirror"):
    n = strategy.num_replicas_in_sync
    rank = strategy.cluster_resolver.task_id or 0
    barrier = collectives._Barrier(strategy)  # pylint: disable=protected-access
    raw = collectives._Raw(n)  # pylint: disable=protected-access
    out = {}
    for count in counts:
        out[str(count)] = {}
        for size_mb in sizes_mb:
            shapes = parameter_shapes(count, size_mb)
            local = len(strategy.extended.worker_devices)  # a worker's graph: its replicas only
            if kind == "all_gather":
                calls, graphs = _build_gather_steps(strategy, shapes, rank)
                per_replica = _check_gather(calls, graphs, count, local)
            else:
                calls, graphs = _build_steps(strategy, raw, shapes, rank)
                per_replica = _check(calls, graphs, count, local)
            times = collectives.time_interleaved(calls, barrier, iters, warmup)
            size_bytes = sum(r * c for r, c in shapes) * _stats.ITEMSIZE
            out[str(count)][f"{size_mb:g}"] = {
                "size_bytes": size_bytes, "shape": list(shapes[0]),
                "collectives_per_replica": per_replica, "times": times,
            }
            if rank == 0:
                med = {k: f"{_stats.summary(v)['median_s'] * 1e3:.1f}ms" for k, v in times.items()}
                log(f"[fusion {kind} n={n}] {count} x {size_mb / count * 1024:g} KB: {med}")
    return out


def summarize(per_rank, n):
    """Merges the ranks' `measure` outputs into the report's rows.

    Returns:
        {"workers": n, "rows": [{"count", "size_mb", "size_bytes", "shape",
        "collectives_per_replica", "variants": {variant: summary},
        "unfused_over_fused", "fused_over_raw_packed", "*_of_medians"}]}
    """
    rows = []
    for count, by_size in per_rank[0].items():
        for size, entry in by_size.items():
            merged = {
                name: _stats.per_iteration_max([r[count][size]["times"][name] for r in per_rank])
                for name in entry["times"]
            }
            variants = {name: _stats.summary(t) for name, t in merged.items()}
            med = {name: v["median_s"] for name, v in variants.items()}
            rows.append({
                "count": int(count),
                "size_mb": float(size),
                "size_bytes": entry["size_bytes"],
                "shape": entry["shape"],
                "collectives_per_replica": entry["collectives_per_replica"],
                "variants": variants,
                "unfused_over_fused": _stats.paired_ratio(merged["unfused"], merged["fused"]),
                "unfused_over_fused_of_medians": med["unfused"] / med["fused"],
            })
            if "raw_packed" in merged:  # not measured for kind="all_gather"
                rows[-1]["fused_over_raw_packed"] = _stats.paired_ratio(
                    merged["fused"], merged["raw_packed"]
                )
                rows[-1]["fused_over_raw_packed_of_medians"] = med["fused"] / med["raw_packed"]
    rows.sort(key=lambda r: (r["size_mb"], r["count"]))
    return {"workers": n, "rows": rows}


def main(argv=None):
    """One worker of ``keras-comm-run -n N -m benchmarks.fusion [--kind K]``.

    Measures on this worker; rank 0 gathers every rank's times through the
    strategy and prints the summary as JSON.
    """
    import argparse
    import json

    import tensorflow as tf

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--kind", choices=("mirror", "all_gather"), default="mirror")
    parser.add_argument("--counts", type=int, nargs="+", default=[8, 32])
    parser.add_argument("--sizes", type=float, nargs="+", default=[4])
    parser.add_argument("--iters", type=int, default=20)
    parser.add_argument("--warmup", type=int, default=3)
    args = parser.parse_args(argv)
    strategy = tf.distribute.MultiWorkerMirroredStrategy()
    mine = measure(strategy, args.counts, args.sizes, args.iters, args.warmup, kind=args.kind)
    n = strategy.num_replicas_in_sync
    # Every rank's times, through one all-gather of their JSON bytes (padded).
    from keras_comm import ops as kc_ops

    text = json.dumps(mine).encode()
    length = tf.constant([len(text)], tf.int64)
    lengths = strategy.run(lambda: kc_ops.all_gather(length))
    lengths = strategy.experimental_local_results(lengths)[0].numpy()
    padded = tf.constant(list(text.ljust(int(lengths.max()))), tf.int32)
    everyone = strategy.experimental_local_results(
        strategy.run(lambda: kc_ops.all_gather(padded[tf.newaxis]))
    )[0].numpy()
    per_rank = [
        json.loads(bytes(row[: int(k)].astype("uint8").tolist()).decode())
        for row, k in zip(everyone, lengths)
    ]
    if (strategy.cluster_resolver.task_id or 0) == 0:
        print(json.dumps(summarize(per_rank, n), indent=1))


if __name__ == "__main__":
    main()
