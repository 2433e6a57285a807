"""Memory ledger: each training mode's peak memory per worker next to its ideal.

For one configuration of `benchmarks.memory` (plain fit, ParallelOptimizer
ZeRO-0/1/2, FullyShard (ZeRO-3), tensor-parallel, pipeline) each worker
reports, measured by the process:

* its baseline: the high-water mark of its resident memory (``ru_maxrss``,
  the kernel's VmHWM) after TensorFlow and the strategy are up and before
  the model is built;
* its peak above that baseline over building the model and a few `fit` steps;
* each step's peak above the baseline: the resident memory sampled every
  2 ms while the step ran, and the high-water mark when it ended (growth
  from one step to the next means something is kept across steps);

next to the ideal: the state the mode must hold (weights, gradients and
Adam's two slots, each at its shard size) plus its largest transient (one
bucket or one gathered layer, and the activations at the batch), see
`ideal`. The ratio is measured / ideal.

One configuration per launch (a high-water mark only grows):

    python -m keras_comm_run -n 2 -m benchmarks.memory_ledger --config zero1

prints the configuration's ledger row (rank 0) and appends every rank's
figures to ``--out`` (JSON lines). Without TF_CONFIG the module is the
driver: it launches the configurations one after another and prints the
table:

    python -m benchmarks.memory_ledger --workers 2 --configs plain zero1 zero3
"""

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

from benchmarks import memory

MIB = 2**20
FLOAT32 = 4

#: The ledger's configurations, in table order.
CONFIGS = ("plain", "zero0", "zero1", "zero2", "zero1_acc2", "zero2_acc2", "zero3",
           "tensor_parallel", "pipeline")


def _layers(model):
    """``[(inputs, outputs), ...]`` of the MLP's Dense layers."""
    features, hidden, outputs = memory.MODELS[model]
    widths = [features, *hidden, outputs]
    return list(zip(widths, widths[1:]))


def _padded(size, n):
    return -(-size // n) * n


def ideal(config, model, n, per_replica_batch, gradient_bucket_bytes=8 << 20,
          optimizer_bucket_bytes=16 << 20):
    """What `config` must hold per worker for `model` on `n` workers, in bytes.

    Returns ``{"state": {...}, "transient": {...}, "total": bytes}``. Every
    tensor is float32; Adam keeps two slots per weight.

    * state: weights, gradients and slots at their shard sizes. Plain fit and
      ZeRO-0 hold all three whole (16 P bytes for P parameters); ZeRO-1/2
      whole weights and gradients and 1/n of the slots (8 P + 8 P / n);
      accumulation adds its buffer (P, or P / n at ZeRO-2); ZeRO-3 1/n of
      everything (16 P / n, each weight padded to a multiple of n);
      tensor-parallel 1/n of the split weights and all of the replicated
      ones; a pipeline stage its stage buffer (the largest stage) whole.
    * transient, the largest of: one gradient bucket being reduced (a
      gradient larger than the bucket is a bucket of its own, and no bucket
      is larger than all the gradients); ZeRO-3's
      gathered layer (its weights, the next layer's prefetched weights and
      its full gradient: 12 x the largest layer); a pipeline stage's largest
      layer gradient; plus the activations kept for the backward at the
      batch (every layer's input and output, n x the batch for the
      gathering tensor-parallel and pipeline layers).
    """
    layers = _layers(model)
    sizes = [s for a, b in layers for s in (a * b, b)]
    params = sum(sizes)
    largest_layer = max(a * b + b for a, b in layers)
    largest_weight = max(sizes)
    widths = [layers[0][0]] + [b for _, b in layers]
    activations = FLOAT32 * per_replica_batch * sum(widths)
    state, transient = {}, {}
    if config in ("plain", "zero0"):
        state = {"weights": FLOAT32 * params, "gradients": FLOAT32 * params,
                 "slots": 2 * FLOAT32 * params}
        bucket = gradient_bucket_bytes if config == "plain" else optimizer_bucket_bytes
        transient["bucket"] = min(max(bucket, FLOAT32 * largest_weight), FLOAT32 * params)
    elif config.startswith(("zero1", "zero2")):
        shard = sum(_padded(s, n) for s in sizes) // n
        state = {"weights": FLOAT32 * params, "gradients": FLOAT32 * params,
                 "slots": 2 * FLOAT32 * shard}
        if config.endswith("_acc2"):
            state["accumulation"] = FLOAT32 * (shard if config.startswith("zero2") else n * shard)
        transient["bucket"] = min(max(optimizer_bucket_bytes, FLOAT32 * largest_weight),
                                  FLOAT32 * params)
    elif config.startswith("zero3"):
        shard = sum(_padded(s, n) for s in sizes) // n
        state = {"weights": FLOAT32 * shard, "gradients": FLOAT32 * shard,
                 "slots": 2 * FLOAT32 * shard}
        transient["gathered layer"] = 3 * FLOAT32 * largest_layer
    elif config == "tensor_parallel":
        split, replicated = 0, 0
        for i, (a, b) in enumerate(layers):
            if i % 2 == 0 and i < len(layers) - 1:  # column: kernel and bias split
                split += a * b + b
            elif i % 2 == 1:  # row: kernel split, bias whole
                split += a * b
                replicated += b
            else:
                replicated += a * b + b
        per_replica = split // n + replicated
        state = {"weights": FLOAT32 * per_replica, "gradients": FLOAT32 * per_replica,
                 "slots": 2 * FLOAT32 * per_replica}
        activations *= n
    elif config == "pipeline":
        stage = max(_stage_params(model, n))
        state = {"weights": FLOAT32 * stage, "gradients": FLOAT32 * stage,
                 "slots": 2 * FLOAT32 * stage}
        transient["layer gradient"] = FLOAT32 * largest_layer
        activations *= n
    else:
        raise ValueError(f"`config` must be one of {CONFIGS}. Received: config={config!r}")
    biggest = max(transient.values(), default=0)
    transient = {k: v for k, v in transient.items() if v == biggest}
    transient["activations"] = activations
    total = sum(state.values()) + sum(transient.values())
    return {"state": state, "transient": transient, "total": total}


def _stage_params(model, n):
    """Parameters of each pipeline stage (`memory.pipeline_stages`)."""
    features = memory.MODELS[model][0]
    out, inputs = [], features
    for layers in memory.pipeline_stages(model, n):
        total = 0
        for units, _ in layers:
            total += inputs * units + units
            inputs = units
        out.append(total)
    return out


def rank_figures(result):
    """One rank's measured figures (MiB above its baseline) from
    `memory.measure`'s result."""
    base = result["peak_rss_before_build"]
    allocator = result.get("phase_allocator_mib", {})
    steps = sorted((p for p in result["phase_peak_mib"] if p.startswith("step ")),
                   key=lambda p: int(p.split()[1]))
    return {
        "rank": result["rank"],
        "baseline_mib": base / MIB,
        "peak_mib": (result["peak_rss"] - base) / MIB,
        "after_build_mib": (result["peak_rss_after_build"] - base) / MIB,
        # Sampled RSS peak while step k ran, and the high-water mark at its end.
        "step_peak_mib": [result["phase_peak_mib"][p] - base / MIB for p in steps],
        "step_high_water_mib": [
            result["phase_high_water_mib"].get(p, 0.0) - base / MIB for p in steps
        ],
        # TensorFlow's live tensors (its allocator's count, from zero): the
        # peak over build and fit, and each step's. Empty where TensorFlow
        # does not count (the system allocator).
        "allocator_peak_mib": max((a["peak"] for a in allocator.values()), default=None),
        "step_allocator_peak_mib": [allocator[p]["peak"] for p in steps if p in allocator],
    }


def row(config, model, n, per_replica_batch, ranks):
    """The ledger row of one configuration from every rank's `rank_figures`."""
    want = ideal(config, model, n, per_replica_batch)
    peaks = [r["peak_mib"] for r in ranks]
    worst = max(peaks)
    steps = [max(r["step_peak_mib"][k] for r in ranks)
             for k in range(min(len(r["step_peak_mib"]) for r in ranks))]
    high = [max(r["step_high_water_mib"][k] for r in ranks)
            for k in range(min(len(r["step_high_water_mib"]) for r in ranks))]
    return {
        "config": config,
        "model": model,
        "workers": n,
        "per_replica_batch": per_replica_batch,
        "peak_mib": worst,
        "peak_mib_per_rank": peaks,
        "ideal_mib": want["total"] / MIB,
        "ideal": {part: {k: v / MIB for k, v in want[part].items()}
                  for part in ("state", "transient")},
        "ratio": worst / (want["total"] / MIB),
        # (largest - smallest) / largest over the ranks' peaks.
        "rank_spread": (worst - min(peaks)) / worst if worst > 0 else 0.0,
        "step_peak_mib": steps,
        "step_high_water_mib": high,
        # The high-water mark's rise from the end of step 1 to the last step
        # (step 0 traces and builds the optimizer's state).
        "growth_after_first_mib": (high[-1] - high[1]) if len(high) > 2 else 0.0,
        "baseline_mib": max(r["baseline_mib"] for r in ranks),
        "allocator_peak_mib": max(
            (r["allocator_peak_mib"] for r in ranks if r.get("allocator_peak_mib") is not None),
            default=None,
        ),
    }


def markdown(rows):
    """The ledger as a Markdown table (a list of lines)."""
    out = ["| mode | peak above baseline MiB (per rank) | ideal MiB (state + transient) "
           "| ratio | rank spread | step peaks MiB | growth after step 1 MiB |",
           "|---|---|---|---|---|---|---|"]
    for r in rows:
        state = sum(r["ideal"]["state"].values())
        transient = sum(r["ideal"]["transient"].values())
        out.append("| " + " | ".join([
            memory.LABELS.get(r["config"], r["config"]),
            f"{r['peak_mib']:.0f} ({' / '.join(f'{p:.0f}' for p in r['peak_mib_per_rank'])})",
            f"{r['ideal_mib']:.0f} ({state:.0f} + {transient:.0f})",
            f"{r['ratio']:.2f}",
            f"{100 * r['rank_spread']:.0f} %",
            " / ".join(f"{p:.0f}" for p in r["step_peak_mib"]),
            f"{r['growth_after_first_mib']:+.0f}",
        ]) + " |")
    return out


def _barrier(strategy):
    import tensorflow as tf

    strategy.reduce(tf.distribute.ReduceOp.SUM,
                    strategy.run(lambda: tf.constant(1.0)), axis=None)


def worker(args):
    """One configuration in this worker process (started by the launcher)."""
    import tensorflow as tf

    import keras_comm  # noqa: F401  (model.fit under MWMS)

    strategy = tf.distribute.MultiWorkerMirroredStrategy()
    result = memory.measure(args.config, args.model, args.steps, args.per_replica_batch,
                            strategy=strategy)
    figures = rank_figures(result)
    n = result["workers"]
    prefix = Path(args.out).with_suffix("")
    path = Path(f"{prefix}.{args.config}.n{n}.rank{figures['rank']}.json")
    path.write_text(json.dumps({"result": result, "figures": figures}))
    _barrier(strategy)  # every rank's file is written before rank 0 reads them
    if figures["rank"] != 0:
        return 0
    ranks = [json.loads(Path(f"{prefix}.{args.config}.n{n}.rank{k}.json").read_text())["figures"]
             for k in range(n)]
    line = row(args.config, args.model, n, args.per_replica_batch, ranks)
    with open(args.out, "a") as f:
        f.write(json.dumps(line) + "\n")
    print("\n".join(markdown([line])), flush=True)
    return 0


def driver(args):
    """Launches each configuration in fresh workers, one at a time; prints the table."""
    rows = []
    out = Path(args.out)
    for config in args.configs:
        before = out.read_text().splitlines() if out.exists() else []
        cmd = [sys.executable, "-m", "keras_comm_run", "-n", str(args.workers), "-m",
               "benchmarks.memory_ledger", "--config", config, "--model", args.model,
               "--steps", str(args.steps), "--per-replica-batch", str(args.per_replica_batch),
               "--out", str(out)]
        started = time.perf_counter()
        with open(f"{out.with_suffix('')}.{config}.n{args.workers}.log", "w") as log:
            code = subprocess.run(cmd, timeout=args.timeout, stdout=log,
                                  stderr=subprocess.STDOUT).returncode
        after = out.read_text().splitlines() if out.exists() else []
        if code != 0 or len(after) == len(before):
            print(f"{config}: the launch exited {code} without a row (see {log.name})",
                  flush=True)
            continue
        rows.append(json.loads(after[-1]))
        print(f"{config}: {rows[-1]['peak_mib']:.0f} MiB above baseline, ideal "
              f"{rows[-1]['ideal_mib']:.0f}, {time.perf_counter() - started:.0f} s", flush=True)
    print("\n".join(markdown(rows)), flush=True)
    return 0 if len(rows) == len(args.configs) else 1


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--config", choices=sorted(memory.CONFIGS),
                        help="worker: the one configuration to measure")
    parser.add_argument("--configs", nargs="+", default=list(CONFIGS),
                        choices=sorted(memory.CONFIGS), help="driver: the configurations")
    parser.add_argument("--workers", type=int, default=2, help="driver: workers per launch")
    parser.add_argument("--model", default="mlp42m", choices=sorted(memory.MODELS))
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--per-replica-batch", type=int, default=32)
    parser.add_argument("--timeout", type=float, default=600, help="driver: seconds per launch")
    parser.add_argument("--out", default="memory_ledger.jsonl",
                        help="JSON lines, one row per configuration (and per-rank files beside)")
    args = parser.parse_args(argv)
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    if "TF_CONFIG" in os.environ:
        if args.config is None:
            parser.error("a worker needs --config")
        return worker(args)
    return driver(args)


if __name__ == "__main__":
    sys.exit(main())
