"""Turns the merged results into benchmarks.md and PNG plots (matplotlib).

`write_markdown(results, path)` and `write_plots(results, out_dir)` read only
the JSON-able dict `benchmarks.run` builds, so a report can be regenerated
from a saved ``benchmarks.json`` without rerunning anything:

    python -m benchmarks.report results/benchmarks.json
"""

import json
import sys
from pathlib import Path

from benchmarks import _stats

TARGET_RATIO = 1.05

LIMITS = [
    "**keras_comm and raw TF columns** run on TensorFlow's CPU collectives: a ring over gRPC "
    "between processes (loopback TCP, tensors serialised into protobuf messages). That transport "
    "sets their bandwidth; compare raw TF with MPI to see its cost, and keras_comm with raw TF to "
    "see ours.",
    "**The keras_comm / raw TF ratio** isolates our code: custom_gradient wrapping, the ordering-token "
    "chain, reshapes/copies around the collective (AlltoAll splits and stacks its chunks; "
    "ReduceScatter is all-to-all + local sum on CPU as in raw TF). Both are timed interleaved in "
    "the same processes, order rotated every iteration, each step timed from an untimed barrier "
    "(so a step whose ranks finish unevenly, like a broadcast's root before its receivers, does not "
    "charge the skew to the next step); the ratio is the median of per-iteration ratios (the ratio "
    "of medians is in the JSON).",
    "**MPI** (mpi4py + MPICH from PyPI) uses shared memory between processes: the reference for what "
    "this machine can move. It runs as its own mpiexec job (TF workers cannot join an MPI world), "
    "once before and once after the TensorFlow jobs; the table shows the median of both runs' medians.",
    "**The machine** has few cores and is shared: with more workers than cores, workers time-share "
    "the CPUs, so 4-worker and training-scaling figures measure contention as much as communication.",
    "**Times** are the slowest rank's per iteration (a collective ends when its last rank does), "
    "median over the timed iterations after warm-up. algbw = S / t with S the nccl-tests per-rank "
    "size (all-gather: output; reduce-scatter: input; others: the buffer); busbw = algbw x "
    "2(n-1)/n (all-reduce), (n-1)/n (all-gather, reduce-scatter, all-to-all), 1 (broadcast). "
    "1 MB = 2^20 bytes; GB/s = 1e9 bytes/s.",
    "Speed is never asserted by a test; these figures describe one run on one machine.",
]


def _fmt(value, spec=".2f", missing="–"):
    if value is None or (isinstance(value, float) and value != value):
        return missing
    return format(value, spec)


def _mpi_median(results, n, op, size):
    """Median of the before/after MPI medians for (n, op, size), or None."""
    values = []
    for run in results.get("mpi", {}).get(str(n), {}).get("runs", []):
        entry = run.get("ops", {}).get(op, {}).get(size)
        if entry:
            values.append(entry)
    if not values:
        return None
    med = sorted(v["median_s"] for v in values)
    t = med[len(med) // 2] if len(med) % 2 else 0.5 * (med[len(med) // 2 - 1] + med[len(med) // 2])
    return {"median_s": t, **_stats.bandwidths(op, values[0]["size_bytes"], int(n), t)}


def _table(header, rows):
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    lines += ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]
    return "\n".join(lines)


FUSION_METHOD = (
    "Each step is the forward and backward of M mirrored float32 parameters of equal size "
    "(`tape.gradient` of the mirrors' outputs with a random upstream gradient per parameter), so "
    "its only communication is the parameters' backward all-reduces. Three steps, timed "
    "interleaved in the same processes from the same barrier as above: **unfused** "
    "(`mirror_operator(w, fusion=0)` each: M all-reduces), **fused** (`mirror_operator(w, fusion=1)` "
    "inside `fusion_scope()`: keras_comm packs them into one all-reduce of the concatenation), and "
    "**raw packed** (the local gradients flattened, concatenated, sent as one raw "
    "`collective_ops.all_reduce_v2` and split back: what MultiWorkerMirroredStrategy does with "
    "`bytes_per_pack`). unfused / fused is what fusion buys; fused / raw packed is what keras_comm's "
    "packing costs over TF's own (target ≤ {target}). Before timing, the run checked each case "
    "once and would have failed otherwise: the traced fused step holds one CollectiveReduceV2 per "
    "replica (the collectives column, unfused / fused / raw packed) and its gradients equal the "
    "unfused ones. Ratios are medians of per-iteration ratios."
)


def _fusion_section(fusion):
    """Section 5 lines: M mirrors' backward all-reduces, unfused / fused / raw packed."""
    if not fusion:
        return []
    n = fusion.get("workers")
    out = [f"## 5. Fusion groups: M mirrored parameters, {n} workers", ""]
    if "error" in fusion:
        return out + [f"**Failed**: {fusion['error']}", ""]
    out += [FUSION_METHOD.format(target=TARGET_RATIO), ""]
    rows = []
    for r in fusion["rows"]:
        v = r["variants"]
        c = r["collectives_per_replica"]
        rows.append([
            r["count"], f"{r['size_mb']:g}", _fmt(r["size_bytes"] / r["count"] / 1024, ".0f"),
            _fmt(v["unfused"]["median_s"] * 1e3), _fmt(v["fused"]["median_s"] * 1e3),
            _fmt(v["raw_packed"]["median_s"] * 1e3),
            _fmt(r["unfused_over_fused"]),
            _fmt(r["fused_over_raw_packed"], ".3f")
            + (" ✓" if r["fused_over_raw_packed"] <= TARGET_RATIO else " ✗"),
            " / ".join(f"{c[k]:g}" for k in ("unfused", "fused", "raw_packed")),
            f"{v['fused']['iters']}",
        ])
    out.append(_table(
        ["M", "MB in all", "KB each", "unfused ms", "fused ms", "raw packed ms", "unfused / fused",
         "fused / raw packed", "collectives / replica", "iters"],
        rows,
    ))
    out.append("")
    return out


def markdown(results):
    m = results["machine"]
    out = ["# keras_comm benchmarks", ""]
    out.append(
        f"Run {results['started']} ({results['mode']} mode, {results['seconds']:.0f} s). "
        f"Machine: {m['cpu_count']} cores ({m.get('cpu_model', '?')}), {m.get('memory_gb', '?')} GB, "
        f"{m['platform']}; Python {m['python']}; "
        + ", ".join(f"{k} {v}" for k, v in m["versions"].items() if v)
        + f". Load average before/after: {m.get('loadavg_before')} / {m.get('loadavg_after')}."
        + f" keras_comm source: {results.get('source', {}).get('keras_comm', '?')}."
    )
    out.append("")
    out.append("## What limits each figure")
    out.append("")
    out += [f"- {line}" for line in LIMITS]
    out.append("")
    for note in results.get("notes", []):
        out.append(f"> {note}")
        out.append("")

    coll = results.get("collectives", {})
    out.append("## 1. Collective bandwidth (forward)")
    out.append("")
    for n, ops in sorted(coll.items(), key=lambda kv: int(kv[0])):
        if "error" in ops:
            out.append(f"{n} workers: **failed** ({ops['error']})")
            continue
        out.append(f"### {n} workers")
        out.append("")
        rows = []
        for op in _stats.OPS:
            for size, row in ops.get(op, {}).items():
                v = row["variants"]
                mpi = _mpi_median(results, n, op, size)
                ours, raw = v["layer_fwd"], v["raw_fwd"]
                rows.append([
                    op, size,
                    _fmt(ours["median_s"] * 1e3, ".2f"), _fmt(raw["median_s"] * 1e3, ".2f"),
                    _fmt(mpi and mpi["median_s"] * 1e3, ".2f"),
                    _fmt(ours["algbw_GBps"], ".3f"), _fmt(raw["algbw_GBps"], ".3f"),
                    _fmt(ours["busbw_GBps"], ".3f"), _fmt(raw["busbw_GBps"], ".3f"),
                    _fmt(mpi and mpi["busbw_GBps"], ".3f"),
                    _fmt(mpi and raw["busbw_GBps"] / mpi["busbw_GBps"], ".3f"),
                ])
        out.append(_table(
            ["op", "MB", "keras_comm ms", "raw TF ms", "MPI ms", "keras_comm algbw GB/s",
             "raw TF algbw", "keras_comm busbw GB/s", "raw TF busbw", "MPI busbw", "raw TF / MPI busbw"],
            rows,
        ))
        out.append("")
    if results.get("mpi_note"):
        out.append(f"MPI: {results['mpi_note']}")
        out.append("")

    out.append(f"## 2. Layer overhead: keras_comm / raw TF (target ≤ {TARGET_RATIO})")
    out.append("")
    for n, ops in sorted(coll.items(), key=lambda kv: int(kv[0])):
        if "error" in ops:
            continue
        out.append(f"### {n} workers")
        out.append("")
        rows = []
        for op in _stats.OPS:
            for size, row in ops.get(op, {}).items():
                v = row["variants"]
                rows.append([
                    op, size,
                    _fmt(row["ratio_fwd"], ".3f") + (" ✓" if row["ratio_fwd"] <= TARGET_RATIO else " ✗"),
                    _fmt(row["ratio_fwd_bwd"], ".3f")
                    + (" ✓" if row["ratio_fwd_bwd"] <= TARGET_RATIO else " ✗"),
                    _fmt(v["layer_fwd_bwd"]["median_s"] * 1e3), _fmt(v["raw_fwd_bwd"]["median_s"] * 1e3),
                    f"{v['layer_fwd']['iters']}",
                ])
        out.append(_table(
            ["op", "MB", "fwd ratio", "fwd+bwd ratio", "keras_comm fwd+bwd ms", "raw TF fwd+bwd ms",
             "iters"],
            rows,
        ))
        out.append("")

    out.append("## 3. ReduceScatter on CPU: all-to-all + local sum vs all-reduce then slice")
    out.append("")
    rs = results.get("reduce_scatter", [])
    out.append(_table(
        ["workers", "MB", "keras_comm ms", "raw a2a+sum ms", "all-reduce+slice ms",
         "MB sent/rank (ours)", "MB sent/rank (all-reduce)", "all-reduce+slice / ours"],
        [[r["workers"], f"{r['size_mb']:g}", _fmt(r["ours_a2a_sum_s"] * 1e3), _fmt(r["raw_a2a_sum_s"] * 1e3),
          _fmt(r["allreduce_slice_s"] * 1e3), _fmt(r["ours_bytes_sent_per_rank"] / _stats.MIB),
          _fmt(r["allreduce_bytes_sent_per_rank"] / _stats.MIB), _fmt(r["speedup_vs_allreduce_slice"], ".2f")]
         for r in rs],
    ))
    out.append("")

    tr = results.get("training", {})
    out.append("## 4. Training")
    out.append("")
    if "skipped" in tr:
        out.append(f"Skipped: {tr['skipped']}")
    scaling = tr.get("scaling", [])
    if isinstance(scaling, dict) and "error" in scaling:
        out.append(f"Scaling failed: {scaling['error']}")
    elif scaling:
        out.append("### model.fit throughput (weak scaling: fixed per-replica batch)")
        out.append("")
        out.append(_table(
            ["model", "params", "workers", "global batch", "step ms", "samples/s", "speedup",
             "efficiency"],
            [[r["model"], r["params"], r["workers"], r["global_batch"], _fmt(r["step_s"] * 1e3, ".1f"),
              _fmt(r["samples_per_s"], ".0f"), _fmt(r["speedup"]), _fmt(r["efficiency"])]
             for r in scaling],
        ))
        for error in tr.get("scaling_errors", []):
            out.append(f"\n{error}")
        out.append("")
    po = tr.get("parallel_optimizer", {})
    if po:
        out.append(f"### ParallelOptimizer (MLP, {tr.get('parallel_optimizer_workers')} workers)")
        out.append("")
        if "skipped" in po:
            out.append(f"Skipped: {po['skipped']}")
        elif "error" in po:
            out.append(f"Failed: {po['error']}")
        else:
            rows = []
            for r in po["rows"]:
                c = r["config"]
                label = "plain fit" if c is None else f"accumulation {c[0]}, zero_stage {c[1]}"
                full = r.get("unsharded_state_bytes")
                rows.append([
                    label, r["global_micro_batch"], _fmt(r["micro_batch_s"] * 1e3, ".1f"),
                    _fmt(r["time_per_sample_us"], ".1f"), _fmt(r.get("vs_plain_fit")),
                    _fmt(r.get("collectives_per_sample"), ".4f"),
                    _fmt(r.get("gradient_collectives_per_sample"), ".4f"),
                    _fmt(r["state_bytes"] / _stats.MIB if r.get("state_bytes") is not None else None),
                    _fmt(sum(full.values()) / _stats.MIB if full else None),
                ])
            out.append(_table(
                ["configuration", "global micro-batch", "ms / micro-batch", "µs / sample",
                 "vs plain fit", "collectives / sample (all)", "gradient collectives / sample",
                 "state MiB / replica", "unsharded MiB"],
                rows,
            ))
        out.append("")
    out += _fusion_section(results.get("fusion"))
    plots = results.get("plots", [])
    if plots:
        out.append("## Plots")
        out.append("")
        out += [f"![{Path(p).stem}]({Path(p).name})" for p in plots]
        out.append("")
    return "\n".join(out)


def write_markdown(results, path):
    Path(path).write_text(markdown(results))
    return path


def write_plots(results, out_dir):
    """Writes the PNGs; returns their paths ([] without matplotlib)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return []
    out_dir = Path(out_dir)
    paths = []
    coll = results.get("collectives", {})
    for n, ops in sorted(coll.items(), key=lambda kv: int(kv[0])):
        if "error" in ops:
            continue
        present = [op for op in _stats.OPS if op in ops]
        fig, axes = plt.subplots(1, len(present), figsize=(3.2 * len(present), 3.2), squeeze=False)
        for ax, op in zip(axes[0], present):
            sizes = sorted(ops[op], key=float)
            xs = [float(s) for s in sizes]
            for label, key in (("keras_comm", "layer_fwd"), ("raw TF", "raw_fwd")):
                ax.plot(xs, [ops[op][s]["variants"][key]["busbw_GBps"] for s in sizes], marker="o", label=label)
            mpi = [_mpi_median(results, n, op, s) for s in sizes]
            if any(mpi):
                ax.plot([x for x, m in zip(xs, mpi) if m], [m["busbw_GBps"] for m in mpi if m],
                        marker="s", label="MPI")
            ax.set_xscale("log", base=2)
            ax.set_yscale("log")
            ax.set_title(op)
            ax.set_xlabel("size (MB)")
        axes[0][0].set_ylabel("busbw (GB/s)")
        axes[0][0].legend(fontsize=8)
        fig.suptitle(f"Collective bus bandwidth, {n} workers (forward)")
        fig.tight_layout()
        path = out_dir / f"busbw_{n}workers.png"
        fig.savefig(path, dpi=110)
        plt.close(fig)
        paths.append(path)

        fig, ax = plt.subplots(figsize=(max(6, 0.5 * sum(len(ops[o]) for o in present)), 3.4))
        labels, fwd, fb = [], [], []
        for op in present:
            for s in sorted(ops[op], key=float):
                labels.append(f"{op}\n{s} MB")
                fwd.append(ops[op][s]["ratio_fwd"])
                fb.append(ops[op][s]["ratio_fwd_bwd"])
        idx = range(len(labels))
        ax.bar([i - 0.2 for i in idx], fwd, 0.4, label="forward")
        ax.bar([i + 0.2 for i in idx], fb, 0.4, label="forward+backward")
        ax.axhline(1.0, color="black", lw=0.8)
        ax.axhline(TARGET_RATIO, color="red", ls="--", lw=0.8, label=f"target {TARGET_RATIO}")
        ax.set_xticks(list(idx))
        ax.set_xticklabels(labels, fontsize=6)
        ax.set_ylabel("keras_comm / raw TF time")
        ax.set_title(f"Layer overhead, {n} workers (median of paired ratios)")
        ax.legend(fontsize=8)
        fig.tight_layout()
        path = out_dir / f"overhead_{n}workers.png"
        fig.savefig(path, dpi=110)
        plt.close(fig)
        paths.append(path)

    rs = results.get("reduce_scatter", [])
    if rs:
        fig, ax = plt.subplots(figsize=(6, 3.4))
        labels = [f"n={r['workers']}\n{r['size_mb']:g} MB" for r in rs]
        idx = range(len(rs))
        ax.bar([i - 0.2 for i in idx], [r["ours_a2a_sum_s"] * 1e3 for r in rs], 0.4, label="keras_comm (all-to-all + sum)")
        ax.bar([i + 0.2 for i in idx], [r["allreduce_slice_s"] * 1e3 for r in rs], 0.4, label="all-reduce + slice")
        ax.set_xticks(list(idx))
        ax.set_xticklabels(labels, fontsize=7)
        ax.set_ylabel("ms")
        ax.set_yscale("log")
        ax.set_title("ReduceScatter on CPU")
        ax.legend(fontsize=8)
        fig.tight_layout()
        path = out_dir / "reduce_scatter.png"
        fig.savefig(path, dpi=110)
        plt.close(fig)
        paths.append(path)

    tr = results.get("training", {})
    scaling = tr.get("scaling")
    if isinstance(scaling, list) and scaling:
        fig, ax = plt.subplots(figsize=(5, 3.4))
        for model in sorted({r["model"] for r in scaling}):
            rows = [r for r in scaling if r["model"] == model]
            ax.plot([r["workers"] for r in rows], [r["samples_per_s"] for r in rows], marker="o", label=model)
        ax.set_xlabel("workers")
        ax.set_ylabel("samples/s")
        ax.set_title("model.fit throughput (fixed per-replica batch)")
        ax.legend(fontsize=8)
        fig.tight_layout()
        path = out_dir / "training_scaling.png"
        fig.savefig(path, dpi=110)
        plt.close(fig)
        paths.append(path)
    po = tr.get("parallel_optimizer", {})
    if isinstance(po, dict) and po.get("rows"):
        rows = po["rows"]
        labels = ["plain" if r["config"] is None else f"acc{r['config'][0]}/z{r['config'][1]}" for r in rows]
        fig, (a1, a2) = plt.subplots(1, 2, figsize=(8, 3.2))
        a1.bar(labels, [r["time_per_sample_us"] for r in rows])
        a1.set_ylabel("µs per sample")
        a1.set_title("time per sample")
        a2.bar(labels, [(r["state_bytes"] or 0) / _stats.MIB for r in rows])
        a2.set_ylabel("MiB per replica")
        a2.set_title("optimizer state (state_bytes)")
        for a in (a1, a2):
            a.tick_params(axis="x", labelsize=7)
        fig.suptitle(f"ParallelOptimizer, {tr.get('parallel_optimizer_workers')} workers")
        fig.tight_layout()
        path = out_dir / "parallel_optimizer.png"
        fig.savefig(path, dpi=110)
        plt.close(fig)
        paths.append(path)
    return [str(p) for p in paths]


def main(argv=None):
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) != 1:
        print("usage: python -m benchmarks.report results/benchmarks.json", file=sys.stderr)
        return 2
    path = Path(argv[0])
    results = json.loads(path.read_text())
    results["plots"] = write_plots(results, path.parent)
    write_markdown(results, path.parent / "benchmarks.md")
    return 0


if __name__ == "__main__":
    sys.exit(main())
