"""Turns the merged results into tables and PNG plots (matplotlib).

`write_markdown(results, path)`, `write_results(results, out_dir)` and
`write_plots(results, out_dir)` read only the JSON-able dict
`benchmarks.run` builds, so a report can be regenerated from a saved
``benchmarks.json`` without rerunning anything:

    python -m benchmarks.report results/benchmarks.json [--out DIR]

`write_results` makes the documentation's tables: one docs/results/NAME.json
per table (title, date, machine, command, columns, rows), which
docs/_hooks.py renders where a page says ``<!-- results: NAME -->``.
"""

import json
import sys
from pathlib import Path

from benchmarks import _stats
from benchmarks import memory
from benchmarks import fsdp_speed

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


def _ratio_cell(row, kind):
    """'1.032 ✓ (0.97–1.10)': the median paired ratio, its verdict, its p10–p90 spread."""
    mid = row[f"ratio_{kind}"]
    cell = _fmt(mid, ".3f") + (" ✓" if mid <= TARGET_RATIO else " ✗")
    lo, hi = row.get(f"ratio_{kind}_p10"), row.get(f"ratio_{kind}_p90")
    if lo is not None and hi is not None:
        cell += f" ({lo:.2f}–{hi:.2f})"
    return cell


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
        + f". keras_comm source: {results.get('source', {}).get('keras_comm', '?')}."
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
        out.append("In brackets: p10–p90 of the per-iteration ratios, the run-to-run spread.")
        out.append("")
        rows = []
        for op in _stats.OPS:
            for size, row in ops.get(op, {}).items():
                v = row["variants"]
                rows.append([
                    op, size,
                    _ratio_cell(row, "fwd"), _ratio_cell(row, "fwd_bwd"),
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
    out += _peers_section(results.get("peers"))
    out += memory.markdown_section(results.get("memory"))
    out += fsdp_speed.markdown_section(results.get("fsdp"))
    plots = results.get("plots", [])
    if plots:
        out.append("## Plots")
        out.append("")
        out += [f"![{Path(p).stem}]({Path(p).name})" for p in plots]
        out.append("")
    return "\n".join(out)


def _peers_section(peers):
    """Keras 3 + keras_comm next to tf-keras (benchmarks/peers.py)."""
    if not peers:
        return []
    out = ["## 6. model.fit next to tf-keras", ""]
    if "error" in peers:
        return out + [f"Failed: {peers['error']}", ""]
    if "skipped" in peers:
        return out + [f"Skipped: {peers['skipped']}.", ""]
    p = peers.get("parameters", {})
    out.append(
        f"784-1024-1024-10 MLP, Adam, global batch {p.get('global_batch')}, {p.get('samples')} "
        f"samples per epoch from `Dataset.cache()`, {p.get('epochs')} epochs per job; each "
        "framework under its own MultiWorkerMirroredStrategy in its own worker processes, jobs "
        "alternating. samples/s: median over jobs of each job's median epoch after the first "
        "(slowest rank), each epoch timed end to end (from one epoch's end to the next, so "
        "what either framework does between epochs counts); ratio > 1: keras_comm faster. "
        "'inside epochs': the same ratio from on_epoch_begin to on_epoch_end only (leaves out "
        "tf-keras's iterator creation, keeps Keras 3's). 'worst excess': the slowest later "
        "epoch minus the median epoch, worst job (a stall shows here)."
    )
    out.append("")
    rows = []
    for r in peers.get("rows", []):
        kc, tk = r.get("keras_comm", {}), r.get("tf_keras", {})
        rows.append([
            r["workers"], _fmt(kc.get("samples_per_s"), ".0f"), _fmt(tk.get("samples_per_s"), ".0f"),
            _fmt(r.get("ratio"), ".3f"),
            " ".join(_fmt(x, ".2f") for x in r.get("ratio_runs", [])),
            _fmt(r.get("in_epoch_ratio"), ".3f"),
            _fmt(kc.get("worst_epoch_excess_s")), _fmt(tk.get("worst_epoch_excess_s")),
            f"{kc.get('runs', 0)} / {tk.get('runs', 0)}",
        ])
    out.append(_table(
        ["workers", "keras_comm samples/s", "tf-keras samples/s", "ratio (median)",
         "ratio per round", "ratio inside epochs", "keras_comm worst excess s", "tf-keras worst excess s", "jobs"],
        rows,
    ))
    out.append("")
    return out


def write_markdown(results, path):
    Path(path).write_text(markdown(results))
    return path


# The docs show a plot at most ~800 px wide; plots are drawn for that width
# (8 inches at 150 dpi, shown at about two thirds) with fonts that stay readable.
PLOT_WIDTH_IN = 8.0
PLOT_DPI = 150
PLOT_STYLE = {
    "font.size": 12, "axes.titlesize": 13, "axes.labelsize": 12, "xtick.labelsize": 11,
    "ytick.labelsize": 11, "legend.fontsize": 11, "figure.titlesize": 14,
}
SPREAD_NOTE = "bars: p10–p90 of the timed iterations"
OVERHEAD_XMAX = 2.0


def _busbw_spread(op, n, variant):
    """(lower, upper) busbw error-bar lengths from the p90 and p10 times."""
    lo = _stats.bandwidths(op, variant["size_bytes"], n, variant["p90_s"])["busbw_GBps"]
    hi = _stats.bandwidths(op, variant["size_bytes"], n, variant["p10_s"])["busbw_GBps"]
    mid = variant["busbw_GBps"]
    return max(0.0, mid - lo), max(0.0, hi - mid)


def _plot_busbw(plt, results, n, ops, present):
    from matplotlib import ticker

    cols = 3
    rows_n = -(-len(present) // cols)
    fig, axes = plt.subplots(rows_n, cols, figsize=(PLOT_WIDTH_IN, 3.0 * rows_n + 0.8), squeeze=False)
    handles = None
    for ax, op in zip(axes.flat, present):
        sizes = sorted(ops[op], key=float)
        xs = [float(s) for s in sizes]
        for label, key, marker in (("keras_comm", "layer_fwd", "o"), ("raw TF", "raw_fwd", "^")):
            ys, lower, upper = [], [], []
            for s in sizes:
                variant = dict(ops[op][s]["variants"][key], size_bytes=ops[op][s]["size_bytes"])
                ys.append(variant["busbw_GBps"])
                lo, hi = _busbw_spread(op, int(n), variant) if "p10_s" in variant else (0.0, 0.0)
                lower.append(lo)
                upper.append(hi)
            ax.errorbar(xs, ys, yerr=[lower, upper], marker=marker, capsize=3, label=label)
        mpi = [_mpi_median(results, n, op, s) for s in sizes]
        if any(mpi):
            ax.plot([x for x, m in zip(xs, mpi) if m], [m["busbw_GBps"] for m in mpi if m],
                    marker="s", label="MPI (shared memory)")
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xticks(xs, [f"{x:g}" for x in xs])
        # Plain numbers at 1-2-5 steps: a narrow log range otherwise gets one label.
        ax.yaxis.set_major_locator(ticker.LogLocator(base=10, subs=(1.0, 2.0, 5.0)))
        ax.yaxis.set_major_formatter(ticker.FuncFormatter(lambda v, _: f"{v:g}"))
        ax.yaxis.set_minor_locator(ticker.NullLocator())
        ax.xaxis.set_minor_locator(ticker.NullLocator())
        ax.set_title(op)
        ax.set_xlabel("size (MB)")
        ax.grid(True, which="major", alpha=0.3)
        handles = ax.get_legend_handles_labels()
    for ax in axes[:, 0]:
        ax.set_ylabel("busbw (GB/s)")
    for ax in list(axes.flat)[len(present):]:
        ax.axis("off")
    spare = list(axes.flat)[len(present):]
    if spare and handles:
        spare[0].legend(*handles, loc="center", title=SPREAD_NOTE, title_fontsize=10)
    elif handles:
        fig.legend(*handles, loc="lower center", ncol=3)
    fig.suptitle(f"Collective bus bandwidth, {n} workers (forward; higher is better)")
    fig.tight_layout()
    return fig


def _plot_overhead(plt, n, ops, present):
    labels, fwd, fb, fwd_err, fb_err = [], [], [], [[], []], [[], []]
    for op in present:
        for s in sorted(ops[op], key=float):
            row = ops[op][s]
            labels.append(f"{op} {s} MB")
            for kind, values, err in (("fwd", fwd, fwd_err), ("fwd_bwd", fb, fb_err)):
                mid = row[f"ratio_{kind}"]
                values.append(mid)
                lo, hi = row.get(f"ratio_{kind}_p10"), row.get(f"ratio_{kind}_p90")
                err[0].append(mid - lo if lo is not None else 0.0)
                err[1].append(hi - mid if hi is not None else 0.0)
    # Horizontal bars: one readable label per row, however many sizes ran.
    fig, ax = plt.subplots(figsize=(PLOT_WIDTH_IN, 1.2 + 0.42 * len(labels)))
    idx = list(range(len(labels)))
    has_spread = any(e for e in fwd_err[0] + fwd_err[1] + fb_err[0] + fb_err[1])
    kw = {"capsize": 2, "error_kw": {"elinewidth": 1, "alpha": 0.7}} if has_spread else {}
    ax.barh([i - 0.2 for i in idx], fwd, 0.4, xerr=fwd_err if has_spread else None, label="forward", **kw)
    ax.barh([i + 0.2 for i in idx], fb, 0.4, xerr=fb_err if has_spread else None, label="forward+backward", **kw)
    ax.axvline(1.0, color="black", lw=0.8)
    ax.axvline(TARGET_RATIO, color="red", ls="--", lw=1, label=f"target {TARGET_RATIO}")
    ax.set_yticks(idx, labels)
    ax.invert_yaxis()
    values = [v for v in fwd + fb if v == v]
    spread_hi = [v + e for v, e in zip(fwd + fb, fwd_err[1] + fb_err[1]) if v == v]
    spread_lo = [v - e for v, e in zip(fwd + fb, fwd_err[0] + fb_err[0]) if v == v]
    # The axis stops at OVERHEAD_XMAX: one noisy iteration must not squash every bar.
    clipped = bool(values) and max(spread_hi) > OVERHEAD_XMAX
    if values:
        ax.set_xlim(max(0.0, min(0.8, min(spread_lo) - 0.02)), min(OVERHEAD_XMAX, max(1.2, max(spread_hi) + 0.02)))
    ax.set_xlabel("keras_comm time / raw TF time (lower is better)")
    title = f"Layer overhead, {n} workers: median of paired ratios"
    note = SPREAD_NOTE + (f", cut at {OVERHEAD_XMAX:g}" if clipped else "")
    ax.set_title(title + (f"\n({note})" if has_spread else ""))
    ax.grid(True, axis="x", alpha=0.3)
    ax.legend(loc="upper center", bbox_to_anchor=(0.5, -0.09 - 0.5 / len(labels)), ncol=3, frameon=False)
    fig.tight_layout()
    return fig


def _plot_reduce_scatter(plt, rs):
    from matplotlib import ticker

    fig, ax = plt.subplots(figsize=(PLOT_WIDTH_IN, 4.2))
    labels = [f"{r['workers']} workers\n{r['size_mb']:g} MB" for r in rs]
    idx = list(range(len(rs)))
    ax.bar([i - 0.2 for i in idx], [r["ours_a2a_sum_s"] * 1e3 for r in rs], 0.4,
           label="keras_comm (all-to-all + sum)")
    ax.bar([i + 0.2 for i in idx], [r["allreduce_slice_s"] * 1e3 for r in rs], 0.4,
           label="all-reduce + slice")
    ax.set_xticks(idx, labels)
    ax.set_ylabel("ms (median, lower is better)")
    ax.set_yscale("log")
    ax.yaxis.set_major_formatter(ticker.FuncFormatter(lambda v, _: f"{v:g}"))
    ax.yaxis.set_minor_formatter(ticker.NullFormatter())
    ax.set_title("ReduceScatter on CPU")
    ax.legend(loc="upper left")
    ax.set_ylim(top=ax.get_ylim()[1] * 3)  # room for the legend above the bars
    fig.tight_layout()
    return fig


def _bar(lengths):
    """Error-bar lengths, never negative.

    The plotted value is a median over the whole run while the bars come
    from per-round extremes, so on a loaded machine a value can fall just
    outside its own [slowest, fastest] round; matplotlib refuses a negative
    length (a smoke run failed on it), and a zero-length bar says the truth.
    """
    return [max(0.0, x) for x in lengths]


def _plot_scaling(plt, scaling):
    fig, ax = plt.subplots(figsize=(PLOT_WIDTH_IN, 4.2))
    for model in sorted({r["model"] for r in scaling}):
        rows = [r for r in scaling if r["model"] == model]
        ys = [r["samples_per_s"] for r in rows]
        if all("step_min_s" in r for r in rows):
            lower = _bar([y - r["global_batch"] / r["step_max_s"] for y, r in zip(ys, rows)])
            upper = _bar([r["global_batch"] / r["step_min_s"] - y for y, r in zip(ys, rows)])
            ax.errorbar([r["workers"] for r in rows], ys, yerr=[lower, upper], marker="o", capsize=4, label=model)
        else:
            ax.plot([r["workers"] for r in rows], ys, marker="o", label=model)
    workers = sorted({r["workers"] for r in scaling})
    ax.set_xticks(workers)
    ax.set_xlabel("workers")
    ax.set_ylabel("samples/s (higher is better)")
    ax.set_title("model.fit throughput, fixed per-replica batch\n(bars: slowest and fastest round)")
    ax.grid(True, alpha=0.3)
    ax.legend()
    fig.tight_layout()
    return fig


def _po_label(config):
    return "plain fit" if config is None else f"accum. {config[0]}\nZeRO {config[1]}"


def _plot_parallel_optimizer(plt, rows, n):
    labels = [_po_label(r["config"]) for r in rows]
    idx = list(range(len(rows)))
    fig, (a1, a2) = plt.subplots(2, 1, figsize=(PLOT_WIDTH_IN, 7.5), sharex=True)
    ys = [r["time_per_sample_us"] for r in rows]
    if all("micro_batch_min_s" in r for r in rows):
        per = [r["global_micro_batch"] / 1e6 for r in rows]
        err = [_bar([y - r["micro_batch_min_s"] / p for y, r, p in zip(ys, rows, per)]),
               _bar([r["micro_batch_max_s"] / p - y for y, r, p in zip(ys, rows, per)])]
        a1.bar(idx, ys, yerr=err, capsize=4)
        a1.set_title("time per sample (bars: slowest and fastest round)")
    else:
        a1.bar(idx, ys)
        a1.set_title("time per sample")
    a1.set_ylabel("µs per sample")
    bottom = [0.0] * len(rows)
    for part in ("optimizer", "master", "accumulation"):
        values = [(r.get("state_breakdown") or {}).get(part, 0) / _stats.MIB for r in rows]
        if any(values):
            a2.bar(idx, values, bottom=bottom, label=part)
            bottom = [b + v for b, v in zip(bottom, values)]
    for i, r in enumerate(rows):
        if r.get("state_bytes") is None:
            a2.text(i, 0, "not\nrecorded", ha="center", va="bottom", fontsize=10)
    a2.set_ylabel("MiB per replica")
    a2.set_title("optimizer state per replica (what ZeRO shards)")
    a2.legend()
    a2.set_xticks(idx, labels)
    fig.suptitle(f"ParallelOptimizer, {n} workers (MLP)")
    fig.tight_layout()
    return fig


def _plot_peers(plt, rows):
    fig, ax = plt.subplots(figsize=(PLOT_WIDTH_IN, 4.2))
    width = 0.38
    for k, (framework, label) in enumerate((("keras_comm", "Keras 3 + keras_comm"), ("tf_keras", "tf-keras"))):
        xs = [i + (k - 0.5) * width for i in range(len(rows))]
        ys = [r.get(framework, {}).get("samples_per_s") or 0 for r in rows]
        runs = [r.get(framework, {}).get("samples_per_s_runs") or [y] for r, y in zip(rows, ys)]
        err = [[y - min(v) for y, v in zip(ys, runs)], [max(v) - y for y, v in zip(ys, runs)]]
        ax.bar(xs, ys, width, yerr=err, capsize=4, label=label)
        for x, y, r in zip(xs, ys, rows):
            if framework == "keras_comm" and r.get("ratio"):
                ax.text(x + width / 2, y, f"{r['ratio']:.2f}x", ha="center", va="bottom")
    ax.set_xticks(range(len(rows)), [f"{r['workers']} worker{'s' if r['workers'] > 1 else ''}" for r in rows])
    ax.set_ylabel("samples/s (higher is better)")
    ax.set_title("model.fit, MLP under MultiWorkerMirroredStrategy\n(bars: slowest and fastest job)")
    ax.grid(True, axis="y", alpha=0.3)
    ax.legend(loc="lower right")
    fig.tight_layout()
    return fig


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

    def save(fig, name):
        path = out_dir / name
        fig.savefig(path, dpi=PLOT_DPI)
        plt.close(fig)
        paths.append(path)

    with matplotlib.rc_context(PLOT_STYLE):
        coll = results.get("collectives", {})
        for n, ops in sorted(coll.items(), key=lambda kv: int(kv[0])):
            if "error" in ops:
                continue
            present = [op for op in _stats.OPS if op in ops]
            save(_plot_busbw(plt, results, n, ops, present), f"busbw_{n}workers.png")
            save(_plot_overhead(plt, n, ops, present), f"overhead_{n}workers.png")
        rs = results.get("reduce_scatter", [])
        if rs:
            save(_plot_reduce_scatter(plt, rs), "reduce_scatter.png")
        tr = results.get("training", {})
        scaling = tr.get("scaling")
        if isinstance(scaling, list) and scaling:
            save(_plot_scaling(plt, scaling), "training_scaling.png")
        po = tr.get("parallel_optimizer", {})
        if isinstance(po, dict) and po.get("rows"):
            save(_plot_parallel_optimizer(plt, po["rows"], tr.get("parallel_optimizer_workers")),
                 "parallel_optimizer.png")
        peers = results.get("peers", {})
        if isinstance(peers, dict) and peers.get("rows"):
            save(_plot_peers(plt, peers["rows"]), "peers_tf_keras.png")
        if (results.get("memory") or {}).get("rows"):
            save(memory.plot(plt, results["memory"]["rows"]), "memory.png")
    return [str(p) for p in paths]


# ---------------------------------------------------------------------------
# docs/results/NAME.json: the tables the documentation shows.
#
# Every figure a page quotes lives in one such file (docs/_hooks.py renders
# it, with its date, machine and command). `results_files` makes them from a
# run's results; `benchmarks.run --docs` writes them into docs/results/ (only
# the families the run measured: the others keep the run that measured them).

def machine_line(machine):
    """'a 2-core CPU machine (AMD EPYC 7B13, 23.5 GB; TensorFlow 2.21.0, Keras 3.15.1)'."""
    versions = machine.get("versions", {})
    parts = [machine.get("cpu_model") or "CPU model unknown"]
    if machine.get("memory_gb"):
        parts[0] += f", {machine['memory_gb']} GB"
    software = ", ".join(f"{label} {versions[name]}" for name, label in
                         (("tensorflow", "TensorFlow"), ("keras", "Keras")) if versions.get(name))
    return f"a {machine.get('cpu_count', '?')}-core CPU machine ({parts[0]}" + (f"; {software})" if software else ")")


def _spread(mid, lo, hi, spec=".2f"):
    """'1.03 [0.97, 1.10]': a median and its spread."""
    if lo is None or hi is None:
        return _fmt(mid, spec)
    return f"{_fmt(mid, spec)} [{_fmt(lo, spec)}, {_fmt(hi, spec)}]"


def _collective_files(results):
    files = {}
    for n, ops in sorted(results.get("collectives", {}).items(), key=lambda kv: int(kv[0])):
        if "error" in ops:
            continue
        bandwidth, overhead, iters = [], [], set()
        for op in _stats.OPS:
            for size, row in ops.get(op, {}).items():
                v = row["variants"]
                mpi = _mpi_median(results, n, op, size)
                ours, raw = v["layer_fwd"], v["raw_fwd"]
                iters.add(ours["iters"])
                key = f"{op}, {size} MB"
                bandwidth.append([
                    key, _fmt(ours["median_s"] * 1e3), _fmt(raw["median_s"] * 1e3),
                    _fmt(ours["busbw_GBps"], ".3f"), _fmt(raw["busbw_GBps"], ".3f"),
                    _fmt(mpi and mpi["busbw_GBps"], ".3f"),
                ])
                overhead.append([
                    key,
                    _spread(row["ratio_fwd"], row.get("ratio_fwd_p10"), row.get("ratio_fwd_p90")),
                    _spread(row["ratio_fwd_bwd"], row.get("ratio_fwd_bwd_p10"), row.get("ratio_fwd_bwd_p90")),
                    _fmt(v["layer_fwd_bwd"]["median_s"] * 1e3), _fmt(v["raw_fwd_bwd"]["median_s"] * 1e3),
                ])
        timing = (f"Slowest rank per iteration, median of {'/'.join(str(i) for i in sorted(iters))} "
                  "timed iterations after warm-up.")
        mpi_note = results.get("mpi_note") or "MPI not run."
        files[f"bench_collectives_{n}w"] = {
            "title": f"Collective bandwidth, {n} workers (forward; busbw in GB/s)",
            "columns": ["op, size", "keras_comm ms", "raw TF ms", "keras_comm busbw", "raw TF busbw",
                        "MPI busbw"],
            "rows": bandwidth,
            "note": f"{timing} busbw by the nccl-tests formula; 1 MB = 2^20 bytes, GB/s = 1e9 bytes/s. "
                    f"MPI: {mpi_note}",
        }
        files[f"bench_layer_overhead_{n}w"] = {
            "title": f"Layer overhead, {n} workers: keras_comm time / raw TF time",
            "columns": ["op, size", "forward [p10, p90]", "forward + backward [p10, p90]",
                        "keras_comm forward + backward ms", "raw TF forward + backward ms"],
            "rows": overhead,
            "note": f"Median of the per-iteration ratios, both timed interleaved in the same "
                    f"processes; in brackets the 10th and 90th percentiles. {timing}",
        }
    rs = results.get("reduce_scatter") or []
    if rs:
        files["bench_reduce_scatter"] = {
            "title": "ReduceScatter on CPU: all-to-all plus a local sum against all-reduce then slice",
            "columns": ["workers, size", "keras_comm ms", "raw all-to-all + sum ms", "all-reduce + slice ms",
                        "MiB sent per rank: ours / all-reduce", "all-reduce + slice ÷ ours"],
            "rows": [[f"{r['workers']} workers, {r['size_mb']:g} MB", _fmt(r["ours_a2a_sum_s"] * 1e3),
                      _fmt(r["raw_a2a_sum_s"] * 1e3), _fmt(r["allreduce_slice_s"] * 1e3),
                      f"{_fmt(r['ours_bytes_sent_per_rank'] / _stats.MIB)} / "
                      f"{_fmt(r['allreduce_bytes_sent_per_rank'] / _stats.MIB)}",
                      _fmt(r["speedup_vs_allreduce_slice"])] for r in rs],
            "note": "Medians of the slowest rank's time per iteration.",
        }
    return files


def _fusion_file(fusion):
    if not fusion or "error" in fusion or not fusion.get("rows"):
        return {}
    rows = []
    for r in fusion["rows"]:
        v, c = r["variants"], r["collectives_per_replica"]
        rows.append([
            f"{r['count']} × {_fmt(r['size_bytes'] / r['count'] / 1024, '.0f')} KB",
            _fmt(v["unfused"]["median_s"] * 1e3), _fmt(v["fused"]["median_s"] * 1e3),
            _fmt(v["raw_packed"]["median_s"] * 1e3), _fmt(r["unfused_over_fused"]),
            _fmt(r["fused_over_raw_packed"]), " / ".join(f"{c[k]:g}" for k in ("unfused", "fused", "raw_packed")),
        ])
    return {"bench_fusion": {
        "title": f"Fusion: the backward all-reduces of M mirrored parameters, {fusion['workers']} workers",
        "columns": ["M parameters × size", "unfused ms", "fused ms", "raw packed ms", "unfused ÷ fused",
                    "fused ÷ raw packed", "all-reduces per replica (unfused / fused / raw packed)"],
        "rows": rows,
        "note": "One step is the forward and backward of M mirrored float32 parameters; medians of "
                "the per-iteration ratios, the three variants interleaved.",
    }}


def _training_files(tr):
    files = {}
    scaling = tr.get("scaling")
    if isinstance(scaling, list) and scaling:
        files["bench_fit_scaling"] = {
            "title": "`model.fit` throughput, fixed batch per replica",
            "columns": ["model, workers", "global batch", "step ms [fastest, slowest round]", "samples/s",
                        "speedup", "efficiency"],
            "rows": [[f"{r['model']} ({r['params'] / 1e6:.2f}M parameters), {r['workers']} "
                      f"worker{'s' if r['workers'] > 1 else ''}",
                      str(r["global_batch"]),
                      _spread(r["step_s"] * 1e3, r.get("step_min_s", 0) * 1e3 or None,
                              r.get("step_max_s", 0) * 1e3 or None, ".1f"),
                      _fmt(r["samples_per_s"], ".0f"), _fmt(r["speedup"]), _fmt(r["efficiency"])]
                     for r in scaling],
            "note": "Median over rounds of the slowest rank's step; speedup over 1 worker, "
                    "efficiency = speedup / workers.",
        }
    po = tr.get("parallel_optimizer") or {}
    if po.get("rows"):
        rows = []
        for r in po["rows"]:
            c = r["config"]
            full = r.get("unsharded_state_bytes")
            rows.append([
                "plain `fit`" if c is None else f"`accumulation_steps={c[0]}`, `zero_stage={c[1]}`",
                _fmt(r["micro_batch_s"] * 1e3, ".1f"), _fmt(r.get("vs_plain_fit")),
                _fmt(r.get("gradient_collectives_per_sample"), ".4f"),
                _fmt(r["state_bytes"] / _stats.MIB if r.get("state_bytes") is not None else None),
                _fmt(sum(full.values()) / _stats.MIB if full else None),
            ])
        files["bench_parallel_optimizer"] = {
            "title": f"`ParallelOptimizer` on {tr.get('parallel_optimizer_workers')} workers: time and "
                     "optimizer state",
            "columns": ["configuration", "ms / micro-batch", "vs plain `fit`",
                        "gradient collectives / sample", "state MiB / replica", "unsharded MiB"],
            "rows": rows,
            "note": f"784-1024-1024-10 MLP, Adam, global micro-batch {po['rows'][0]['global_micro_batch']}; "
                    "median over rounds of the slowest rank.",
        }
    nt = tr.get("nontrainable") or {}
    if "workers" in nt:
        files["bn_sync_cost"] = {
            "title": "The per-step mean of BatchNormalization's moving statistics: its cost",
            "columns": ["workers", "step, not synced", "step, synced", "synced ÷ not synced [min, max]",
                        "the sync alone", "bytes per sync"],
            "rows": [[str(nt["workers"]), f"{nt['step_s_per_replica'] * 1e3:.1f} ms",
                      f"{nt['step_s_synced'] * 1e3:.1f} ms",
                      _spread(nt["ratio"], nt["ratio_min"], nt["ratio_max"]),
                      f"{nt['sync_alone_s'] * 1e3:.2f} ms", str(nt["sync_bytes"])]],
            "note": f"ResNet-style CNN of `benchmarks/nontrainable.py` ({nt['bn_layers']} BatchNormalization "
                    f"layers, {nt['params'] / 1e3:.0f}k parameters), global batch {nt['global_batch']}; "
                    f"median of {nt['rounds']} interleaved rounds, slowest rank.",
        }
    return files


def _peers_file(peers):
    if not peers or not peers.get("rows"):
        return {}
    p = peers.get("parameters", {})
    epochs = p.get("epochs")
    rows = []
    for r in peers["rows"]:
        kc, tk = r.get("keras_comm", {}), r.get("tf_keras", {})
        fit = (f"{_fmt(kc.get('fit_s'), '.1f')} s vs {_fmt(tk.get('fit_s'), '.1f')} s")
        rows.append([str(r["workers"]), _fmt(kc.get("samples_per_s"), ".0f"),
                     _fmt(tk.get("samples_per_s"), ".0f"), _fmt(r.get("ratio")),
                     _fmt(r.get("in_epoch_ratio")), fit])
    return {"fit_vs_tf_keras": {
        "title": "`model.fit` against tf-keras, samples per second",
        "columns": ["workers", "keras_comm", "tf-keras", "ratio, end to end", "ratio inside epochs",
                    f"`fit` of {epochs} epochs"],
        "rows": rows,
        "note": f"784-1024-1024-10 MLP, Adam, global batch {p.get('global_batch')}, {p.get('samples')} "
                f"samples per epoch; medians of {p.get('rounds')} rounds × {epochs} epochs, frameworks "
                "alternating; samples/s from the slowest rank, over the epochs after the first.",
    }}


FSDP_VARIANTS = {"plain": "ZeRO-0 (plain fit)", "zero3": "ZeRO-3", "zero3_noprefetch": "ZeRO-3, no prefetch"}


def _fsdp_files(fsdp):
    by_model = {}
    for n, s in sorted((fsdp or {}).items(), key=lambda kv: int(kv[0])):
        if "error" in s:
            continue
        for r in s["rows"]:
            vs = r.get("step_vs_zero0")
            by_model.setdefault(s["model"], (s, []))[1].append([
                f"{n} workers, {FSDP_VARIANTS.get(r['variant'], r['variant'])}",
                f"{r['step_s'] * 1e3:.0f} ({r['step_min_s'] * 1e3:.0f}–{r['step_max_s'] * 1e3:.0f})",
                f"{r['cpu_s_per_step']:.3f}", f"{r['sent_bytes_per_step'] / _stats.MIB:.2f}",
                f"{r['sent_over_param_bytes']:.3f}",
                "" if vs is None else f"{vs:.2f} ({r['step_vs_zero0_min']:.2f}–{r['step_vs_zero0_max']:.2f})",
                "" if vs is None else f"{r['cpu_vs_zero0']:.2f}",
            ])
    files = {}
    for model, (s, rows) in by_model.items():
        name = model.replace("mlp", "", 1) if model.startswith("mlp") else model
        files[f"fsdp_speed_{name}"] = {
            "title": "Fully sharded (ZeRO-3) against plain data parallelism, step time, CPU and bytes",
            "columns": ["workers, variant", "ms / step, median (min–max)", "CPU s / step per worker",
                        "sent MiB / step (counted = formula)", "sent / parameter bytes",
                        "step vs ZeRO-0 (min–max)", "CPU vs ZeRO-0"],
            "rows": rows,
            "note": f"{model}: {s['params'] / 1e6:.1f}M parameters, Adam, {s['global_batch'] // s['workers']} "
                    f"samples per replica, {s['steps']} steps × {s['rounds']} rounds, the variants "
                    "alternating in the same workers.",
        }
    return files


MEMORY_LABELS = {
    "plain": "plain `fit`", "zero0": "`zero_stage=0`", "zero1": "`zero_stage=1`", "zero2": "`zero_stage=2`",
    "zero1_acc2": "`zero_stage=1`, `accumulation_steps=2`",
    "zero2_acc2": "`zero_stage=2`, `accumulation_steps=2`",
    "zero3": "ZeRO-3 (`FullyShard` on every Dense)",
}


def memory_tables(mem):
    """{NAME: table} for the memory family: one table per model, a column pair per worker count."""
    rows = (mem or {}).get("rows") or []
    files = {}
    for model in sorted({r["model"] for r in rows}):
        group = [r for r in rows if r["model"] == model]
        workers = sorted({r["workers"] for r in group})
        configs = list(dict.fromkeys(r["config"] for r in group))
        table = []
        for config in configs:
            cells, states = [MEMORY_LABELS.get(config, memory._label(config))], []
            for n in workers:
                r = next((x for x in group if (x["config"], x["workers"]) == (config, n)), None)
                plain = next((x["peak_rss_mib"] for x in group if (x["config"], x["workers"]) == ("plain", n)), None)
                cells.append(_fmt(r and r["peak_rss_mib"], ".0f"))
                cells.append("–" if r is None or plain is None or config == "plain"
                             else f"{round(r['peak_rss_mib']) - round(plain):+d}".replace("-", "−"))
                state = r and r.get("state_bytes")
                states.append(f"{sum(state.values()) / _stats.MIB:.0f}" if state else "–")
            cells.append(" / ".join(states) if any(s != "–" for s in states) else "–")
            table.append(cells)
        columns = ["configuration"]
        for n in workers:
            columns += [f"{n} workers: peak MiB", f"{n} workers: vs plain `fit`"]
        columns.append(f"state MiB per replica ({' / '.join(str(n) for n in workers)} workers)")
        name = model.replace("mlp", "", 1) if model.startswith("mlp") else model
        files[f"po_memory_{name}"] = {
            "title": f"Peak resident memory per worker, {model} ({group[0]['params'] / 1e6:.0f}M parameters), Adam",
            "columns": columns,
            "rows": table,
            "note": "One fresh launch per row, the largest rank's `ru_maxrss` over building the model "
                    "and a few `fit` steps. State: what `ParallelOptimizer.state_bytes()` says a "
                    "replica holds; for ZeRO-3, `replica_state_bytes` (its weights and slots).",
        }
    return files


def _pipeline_files(pipeline):
    summaries = (pipeline or {}).get("summaries") or []
    if not summaries:
        return {}
    ms = sorted({r["micro_batches"] for s in summaries for r in s["rows"]})
    rows = []
    for s in summaries:
        for schedule in dict.fromkeys(r["schedule"] for r in s["rows"]):
            by_m = {r["micro_batches"]: r for r in s["rows"] if r["schedule"] == schedule}
            cells = [f"{s['stages']} stages, {schedule}"]
            for m in ms:
                r = by_m.get(m)
                cells.append("–" if r is None else f"{r['measured_bubble']:.2f} ({r['ideal_bubble']:.2f})")
            first, last = by_m.get(ms[0]), by_m.get(ms[-1])
            cells.append(f"{_fmt(first and first['step_seconds'] * 1e3, '.0f')} → "
                         f"{_fmt(last and last['step_seconds'] * 1e3, '.0f')} ms")
            rows.append(cells)
    return {"pipeline_bubble": {
        "title": "Pipeline bubble, measured (ideal), by micro-batches m",
        "columns": ["stages, schedule"] + [f"m = {m}" for m in ms] + [f"step, m = {ms[0]} → {ms[-1]}"],
        "rows": rows,
        "note": "Measured bubble = 1 − m·t/step, t being one stage's forward and backward of one "
                "micro-batch alone (communication counts as idle); ideal (p−1)/(m+p−1). The slowest "
                "rank's step, mean bubble over the stages.",
    }}


def results_files(results):
    """{NAME: the docs/results/NAME.json dict} for every family this run measured."""
    files = {}
    files.update(_collective_files(results))
    files.update(_fusion_file(results.get("fusion")))
    files.update(_training_files(results.get("training") or {}))
    files.update(_peers_file(results.get("peers")))
    files.update(_fsdp_files(results.get("fsdp")))
    files.update(memory_tables(results.get("memory")))
    files.update(_pipeline_files(results.get("pipeline")))
    common = {
        "date": results["started"][:10],
        "machine": machine_line(results["machine"]),
        "command": results.get("command", "python -m benchmarks.run"),
    }
    return {name: {"title": f["title"], **common, "columns": f["columns"], "rows": f["rows"],
                   "note": f["note"]} for name, f in files.items()}


def write_results(results, out_dir):
    """Writes `results_files(results)` as OUT_DIR/NAME.json; returns the paths."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    paths = []
    for name, data in results_files(results).items():
        path = out_dir / f"{name}.json"
        path.write_text(json.dumps(data, indent=1, ensure_ascii=False) + "\n")
        paths.append(path)
    return paths


def main(argv=None):
    import argparse

    parser = argparse.ArgumentParser(
        prog="python -m benchmarks.report",
        description="Redraw benchmarks.md, the docs' tables (results/*.json) and the plots "
                    "from a saved benchmarks.json.",
    )
    parser.add_argument("results", type=Path, help="a benchmarks.json written by benchmarks.run")
    parser.add_argument("--out", type=Path, default=None,
                        help="directory for benchmarks.md, results/ and the PNGs (default: the JSON's)")
    args = parser.parse_args(sys.argv[1:] if argv is None else argv)
    out = args.out or args.results.parent
    out.mkdir(parents=True, exist_ok=True)
    results = json.loads(args.results.read_text())
    results["plots"] = write_plots(results, out)
    write_markdown(results, out / "benchmarks.md")
    write_results(results, out / "results")
    return 0


if __name__ == "__main__":
    sys.exit(main())
