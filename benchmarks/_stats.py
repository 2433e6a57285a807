"""Pure helpers shared by the driver and the workers: sizes, bandwidths, medians.

No TensorFlow, no MPI: importable anywhere, testable without a cluster.
"""

import statistics

MIB = 1 << 20
COLS = 256  # float32 columns of every benchmark buffer
ITEMSIZE = 4  # float32

OPS = ("all_reduce", "all_gather", "reduce_scatter", "all_to_all", "broadcast")

# nccl-tests' bus-bandwidth factors (doc/PERFORMANCE.md of NVIDIA/nccl-tests):
# busbw = algbw * factor, the bandwidth a ring link must sustain.
def bus_factor(op, n):
    """nccl-tests' busbw / algbw factor for `op` on `n` ranks."""
    if op == "all_reduce":
        return 2.0 * (n - 1) / n
    if op in ("all_gather", "reduce_scatter", "all_to_all"):
        return (n - 1) / n
    if op == "broadcast":
        return 1.0
    raise ValueError(f"unknown op {op!r}")


def rows_for(size_mb, n):
    """Rows of the nccl-tests buffer (the larger of input and output).

    Rounded up to a multiple of `n` so every op can split it evenly.
    """
    rows = max(1, round(size_mb * MIB / (COLS * ITEMSIZE)))
    return -(-rows // n) * n


def shapes(op, size_mb, n):
    """(input shape, output shape, S in bytes) for one rank, nccl-tests sizes.

    S is the per-rank size nccl-tests reports (and divides by the time to get
    algbw): the all-gather's output, the reduce-scatter's input, the whole
    buffer for all-reduce, all-to-all and broadcast.
    """
    rows = rows_for(size_mb, n)
    full = (rows, COLS)
    part = (rows // n, COLS)
    size_bytes = rows * COLS * ITEMSIZE
    if op == "all_gather":
        return part, full, size_bytes
    if op == "reduce_scatter":
        return full, part, size_bytes
    if op in ("all_reduce", "all_to_all", "broadcast"):
        return full, full, size_bytes
    raise ValueError(f"unknown op {op!r}")


def bytes_sent_per_rank(algorithm, size_bytes, n):
    """Bytes each rank sends for one collective of nccl-tests size S.

    ring all-reduce: 2(n-1)/n S; all-to-all, all-gather, reduce-scatter:
    (n-1)/n S.
    """
    if algorithm == "all_reduce":
        return 2 * (n - 1) * size_bytes // n
    return (n - 1) * size_bytes // n


def per_iteration_max(per_rank):
    """Per-iteration maximum over ranks (a collective ends when its last rank does)."""
    per_rank = [list(t) for t in per_rank if t]
    if not per_rank:
        return []
    length = min(len(t) for t in per_rank)
    return [max(t[i] for t in per_rank) for i in range(length)]


def quantile(values, q):
    values = sorted(values)
    if not values:
        return float("nan")
    pos = q * (len(values) - 1)
    lo = int(pos)
    hi = min(lo + 1, len(values) - 1)
    return values[lo] + (values[hi] - values[lo]) * (pos - lo)


def summary(times):
    """Median and spread of a list of seconds."""
    return {
        "median_s": statistics.median(times) if times else float("nan"),
        "p10_s": quantile(times, 0.1),
        "p90_s": quantile(times, 0.9),
        "iters": len(times),
    }


def bandwidths(op, size_bytes, n, seconds):
    """algbw and busbw in GB/s (1e9 bytes/s, as nccl-tests prints)."""
    if not seconds or seconds != seconds:
        return {"algbw_GBps": float("nan"), "busbw_GBps": float("nan")}
    algbw = size_bytes / seconds / 1e9
    return {"algbw_GBps": algbw, "busbw_GBps": algbw * bus_factor(op, n)}


def paired_ratio(a, b):
    """Median of per-iteration ratios a_i / b_i (interleaved A/B timings)."""
    pairs = [x / y for x, y in zip(a, b) if y > 0]
    return statistics.median(pairs) if pairs else float("nan")


def paired_ratio_spread(a, b):
    """(p10, p90) of the per-iteration ratios a_i / b_i: their run-to-run spread."""
    pairs = [x / y for x, y in zip(a, b) if y > 0]
    return quantile(pairs, 0.1), quantile(pairs, 0.9)
