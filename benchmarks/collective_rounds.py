"""keras_comm layer / raw TF ratios over repeated collective jobs (medians of rounds).

One `benchmarks.run` job gives one median per (op, size) and its p10-p90;
on a shared machine two jobs can disagree by more than that spread (issue
18: Broadcast fwd+bwd at 16/64 MB read 1.09/1.19x raw TF in two runs). This
driver launches the collectives family `--rounds` times in fresh worker
processes and reports, per (op, size), every round's median-of-paired
ratios (benchmarks/collectives.py's `ratio_fwd`, `ratio_fwd_bwd`), their
median and range, and the median step times.

Run (2 workers):

    python -m benchmarks.collective_rounds --ops broadcast --sizes 16 64 \\
        --rounds 5 --iters 15 --out /tmp/bcast
"""

import argparse
import importlib
import json
import os
import statistics
import sys
import time
from pathlib import Path

REPO_DIR = Path(__file__).resolve().parent.parent


def run_rounds(ops, sizes_mb, rounds, iters, warmup, workers, out, timeout=1200):
    launch = importlib.import_module("keras_comm_run")
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    spec = {"collectives": {"ops": ops, "sizes_mb": sizes_mb, "iters": iters, "warmup": warmup}}
    spec_path = out / "spec.json"
    spec_path.write_text(json.dumps(spec))
    env = {
        "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO_DIR), os.environ.get("PYTHONPATH")])),
        "TF_CPP_MIN_LOG_LEVEL": "2",
        "PYTHONWARNINGS": "ignore",
    }
    with open(out / "run.log", "a") as log:
        for r in range(rounds):
            load = os.getloadavg()
            started = time.perf_counter()
            code = launch.run(
                ["-m", "benchmarks.worker", "--spec", str(spec_path), "--out-dir", str(out),
                 "--tag", f"round{r}"],
                workers, timeout=timeout, env=env, stdout=log, stderr=log,
            )
            meta = {"code": code, "load_before": load, "load_after": os.getloadavg(),
                    "seconds": time.perf_counter() - started}
            (out / f"round{r}.meta.json").write_text(json.dumps(meta))
            print(f"round {r}: exit {code}, {meta['seconds']:.0f} s, load {load[0]:.1f}", flush=True)


def summarize(out, workers):
    from benchmarks import collectives

    out = Path(out)
    per_round = []
    for meta_path in sorted(out.glob("round*.meta.json")):
        tag = meta_path.name.split(".")[0]
        ranks = [out / f"{tag}.rank{k}.json" for k in range(workers)]
        if not all(p.exists() for p in ranks):
            continue
        per_rank = [json.loads(p.read_text())["collectives"] for p in ranks]
        per_round.append(collectives.summarize(per_rank, workers))
    if not per_round:
        print("no complete round")
        return {}
    table = {}
    for op, by_size in per_round[0].items():
        for size in by_size:
            rows = [r[op][size] for r in per_round]
            entry = {}
            for kind in ("fwd", "fwd_bwd"):
                ratios = [row[f"ratio_{kind}"] for row in rows]
                entry[kind] = {
                    "ratios": ratios,
                    "median": statistics.median(ratios),
                    "layer_ms": statistics.median(row["variants"][f"layer_{kind}"]["median_s"] * 1e3 for row in rows),
                    "raw_ms": statistics.median(row["variants"][f"raw_{kind}"]["median_s"] * 1e3 for row in rows),
                }
            table[f"{op} {size} MB"] = entry
            for kind, e in entry.items():
                rs = " ".join(f"{x:.3f}" for x in e["ratios"])
                print(f"{op:14s} {size:>4s} MB {kind:7s} ratio per round {rs}  median {e['median']:.3f} "
                      f"[{min(e['ratios']):.3f}, {max(e['ratios']):.3f}]  "
                      f"layer {e['layer_ms']:.1f} ms, raw {e['raw_ms']:.1f} ms (medians of rounds)")
    return table


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--ops", nargs="+", default=["broadcast"])
    parser.add_argument("--sizes", type=float, nargs="+", default=[16, 64])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--iters", type=int, default=15)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--out", required=True)
    parser.add_argument("--summarize", action="store_true", help="only summarize --out")
    args = parser.parse_args(argv)
    if not args.summarize:
        run_rounds(args.ops, args.sizes, args.rounds, args.iters, args.warmup, args.workers, args.out)
    summarize(args.out, args.workers)
    return 0


if __name__ == "__main__":
    sys.exit(main())
