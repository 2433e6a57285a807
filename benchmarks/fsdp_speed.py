"""ZeRO-3 (FullyShard) next to ZeRO-0 (plain data parallel): step time, CPU
time and bytes moved per step, measured side by side in the same processes.

The `fsdp` family of `benchmarks.run` (one job per worker count; full mode:
2 and 4 workers). Every worker builds each variant of the same
`benchmarks.memory` model -- ``plain`` (ZeRO-0: plain data parallelism,
model.fit's one all-reduce of the gradients), ``zero3`` (every Dense in FullyShard,
gathers prefetched one layer early) and ``zero3_noprefetch`` -- compiles it
with Adam and warms it up (tracing, the first steps). Then `rounds` rounds:
in each, a timed `fit` of `steps` steps of every variant, the order reversed
every other round so that the variants share the machine's load.

Per variant and round: wall seconds per step, and this process's CPU
seconds per step (`time.process_time`, every thread) -- the figure that
load from other processes inflates least. Bytes per step are counted in the
traced step (`benchmarks.collective_bytes`: the collectives' real tensors,
padding and the loss's scalars included, ring algorithms' bytes sent per
replica) and set beside `benchmarks.memory.bytes_per_step`'s formula
(3 (N-1)/N S for ZeRO-3, 2 (N-1)/N S for an all-reduce).

Standalone worker (through the launcher, which sets TF_CONFIG):
``python -m keras_comm_run -n 4 -m benchmarks.fsdp_speed --model mlp42m``
prints rank 0's JSON result.
"""

import argparse
import json
import statistics
import time

# ZeRO-0 is "plain": model.fit under the strategy, one all-reduce of the
# gradients, its train function traced once. (ParallelOptimizer(zero_stage=0)
# moves the same bytes, but sets up its step per fit: a timed fit of a few
# steps would time that too.)
VARIANTS = ("plain", "zero3", "zero3_noprefetch")


def measure(strategy, model, variants=VARIANTS, steps=4, rounds=5, per_replica_batch=32, warmup=2,
            log=print):
    """Worker side: this rank's timings and counts (see the module docstring)."""
    from benchmarks import collective_bytes
    from benchmarks import memory

    n = strategy.num_replicas_in_sync
    ds = memory.dataset(model, per_replica_batch, n)
    built = {}
    for v in variants:
        m, callbacks = memory.CONFIGS[v](strategy, model)
        capture = collective_bytes.CaptureStep()
        m.fit(ds, epochs=1, steps_per_epoch=warmup, verbose=0, callbacks=[capture] + callbacks)
        counts = collective_bytes.count(capture.functions, n)
        built[v] = (m, callbacks, counts)
        log(f"[fsdp n={n}] {v} built and warmed up")
    wall = {v: [] for v in variants}
    cpu = {v: [] for v in variants}
    for r in range(rounds):
        for v in variants if r % 2 == 0 else variants[::-1]:
            m, callbacks, _ = built[v]
            c0, t0 = time.process_time(), time.perf_counter()
            m.fit(ds, epochs=1, steps_per_epoch=steps, verbose=0, callbacks=callbacks)
            wall[v].append((time.perf_counter() - t0) / steps)
            cpu[v].append((time.process_time() - c0) / steps)
        log(f"[fsdp n={n}] round {r + 1}/{rounds}: "
            + ", ".join(f"{v} {wall[v][-1] * 1e3:.0f} ms" for v in variants))
    spec = memory.MODELS[model]
    return {
        "model": model, "params": memory.params_of(spec), "workers": n, "steps": steps,
        "rounds": rounds, "global_batch": per_replica_batch * n,
        "variants": {
            v: {
                "seconds_per_step": wall[v],
                "cpu_seconds_per_step": cpu[v],
                "sent_bytes_per_step": sum(c["sent"] for c in built[v][2].values()),
                "collective_ops": {k: c["ops"] for k, c in built[v][2].items()},
                "formula_bytes_per_step": memory.bytes_per_step(v, spec, n),
            }
            for v in variants
        },
    }


def _paired(a, b):
    """Median, min and max over rounds of a[i] / b[i]."""
    ratios = [x / y for x, y in zip(a, b)]
    return statistics.median(ratios), min(ratios), max(ratios)


def summarize(ranks):
    """One figure per variant from every rank's `measure`: per round, the
    slowest rank's step (the step ends when the last replica does) and the
    ranks' mean CPU seconds; medians over rounds; ratios paired per round."""
    first = ranks[0]
    variants = list(first["variants"])
    rounds = first["rounds"]
    wall = {v: [max(r["variants"][v]["seconds_per_step"][i] for r in ranks) for i in range(rounds)]
            for v in variants}
    cpu = {v: [statistics.mean(r["variants"][v]["cpu_seconds_per_step"][i] for r in ranks)
               for i in range(rounds)] for v in variants}
    params_bytes = first["params"] * 4
    rows = []
    for v in variants:
        got = first["variants"][v]
        row = {
            "variant": v,
            "step_s": statistics.median(wall[v]), "step_min_s": min(wall[v]), "step_max_s": max(wall[v]),
            "cpu_s_per_step": statistics.median(cpu[v]),
            "sent_bytes_per_step": got["sent_bytes_per_step"],
            "formula_bytes_per_step": got["formula_bytes_per_step"],
            "sent_over_param_bytes": got["sent_bytes_per_step"] / params_bytes,
            "collective_ops": got["collective_ops"],
        }
        if v != "plain" and "plain" in wall:
            row["step_vs_zero0"], row["step_vs_zero0_min"], row["step_vs_zero0_max"] = _paired(
                wall[v], wall["plain"])
            row["cpu_vs_zero0"] = _paired(cpu[v], cpu["plain"])[0]
        rows.append(row)
    out = {k: first[k] for k in ("model", "params", "workers", "steps", "rounds", "global_batch")}
    out["rows"] = rows
    if "zero3" in wall and "zero3_noprefetch" in wall:
        out["prefetch_over_none"] = dict(zip(("median", "min", "max"),
                                             _paired(wall["zero3"], wall["zero3_noprefetch"])))
    return out


def markdown_section(fsdp):
    """The report's section (a list of Markdown lines); `fsdp` is
    ``{workers: summarize(...) or {"error": ...}}``."""
    if not fsdp:
        return []
    out = ["## 7. Fully sharded (ZeRO-3) next to ZeRO-0: step time and bytes", ""]
    out.append(
        "Each variant built in the same worker processes, rounds interleaved (order reversed "
        "every other round). ms / step: median over rounds of the slowest rank's step "
        "(min-max in brackets); CPU s / step: the ranks' mean process CPU time per step "
        "(least sensitive to other load); sent: bytes one replica sends per step by ring "
        "algorithms for the collectives in the traced step, and that over the parameter bytes "
        "(ZeRO-3 ~ 3 (N-1)/N, an all-reduce 2 (N-1)/N); vs ZeRO-0 (the plain data-parallel fit): "
        "median of per-round ratios."
    )
    out.append("")
    header = ["workers", "model", "variant", "ms / step", "CPU s / step", "sent MiB / step",
              "formula MiB", "sent / param bytes", "step vs ZeRO-0", "CPU vs ZeRO-0"]
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    notes = []
    for n, s in sorted(fsdp.items(), key=lambda kv: int(kv[0])):
        if "error" in s:
            notes.append(f"{n} workers: failed: {s['error']}")
            continue
        for r in s["rows"]:
            vs = r.get("step_vs_zero0")
            lines.append("| " + " | ".join([
                str(n), s["model"], r["variant"],
                f"{r['step_s'] * 1e3:.1f} ({r['step_min_s'] * 1e3:.1f}-{r['step_max_s'] * 1e3:.1f})",
                f"{r['cpu_s_per_step']:.3f}",
                f"{r['sent_bytes_per_step'] / 2**20:.2f}", f"{r['formula_bytes_per_step'] / 2**20:.2f}",
                f"{r['sent_over_param_bytes']:.3f}",
                "" if vs is None else f"{vs:.2f} ({r['step_vs_zero0_min']:.2f}-{r['step_vs_zero0_max']:.2f})",
                "" if vs is None else f"{r['cpu_vs_zero0']:.2f}",
            ]) + " |")
        p = s.get("prefetch_over_none")
        if p:
            notes.append(f"{n} workers: prefetch / no prefetch step time {p['median']:.2f} "
                         f"(rounds {p['min']:.2f}-{p['max']:.2f}).")
    return out + lines + [""] + [f"- {x}" for x in notes] + ([""] if notes else [])


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="mlp42m")
    parser.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=VARIANTS)
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--per-replica-batch", type=int, default=32)
    args = parser.parse_args(argv)

    import tensorflow as tf

    import keras_comm  # noqa: F401  (model.fit under MWMS)

    strategy = tf.distribute.MultiWorkerMirroredStrategy()
    result = measure(strategy, args.model, args.variants, args.steps, args.rounds,
                     args.per_replica_batch)
    if (strategy.cluster_resolver.task_id or 0) == 0:
        print(json.dumps(result), flush=True)


if __name__ == "__main__":
    main()
