"""A model larger than one worker: trains fully sharded under a per-process
memory cap that the unsharded model cannot fit in.

Worker (through the launcher):
``python -m keras_comm_run -n 4 -m benchmarks.fsdp_capped --cap-mib 2400
--config zero3 --model mlp210m --out PREFIX``.
Each worker runs `benchmarks.memory.measure` (build, compile with Adam,
`fit` a few steps) under a cap on its resident memory: a watchdog thread
reads /proc/self/statm every 5 ms and ends the process (exit code 137, as
the kernel's OOM killer would) once the resident set exceeds `--cap-mib`.
No cgroup is needed. RLIMIT_AS does not serve: it caps virtual address
space, which TensorFlow reserves far beyond what it touches (thread
stacks, allocator arenas), so the process would fail at start-up, not at
the cap. Each worker writes ``PREFIX.rankR.json`` with its peak RSS when it
finishes, or ``PREFIX.rankR.capped.json`` with the RSS it was stopped at.
"""

import argparse
import json
import os
import sys
import threading
import time
from pathlib import Path


def _rss_bytes():
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def install_cap(cap_bytes, on_exceeded, period=0.005):
    """Starts a daemon thread that calls ``on_exceeded(rss)`` once the
    process's resident memory exceeds `cap_bytes`."""

    def watch():
        while True:
            rss = _rss_bytes()
            if rss > cap_bytes:
                on_exceeded(rss)
                return
            time.sleep(period)

    thread = threading.Thread(target=watch, name="rss-cap", daemon=True)
    thread.start()
    return thread


def install_exit_cap(cap_mib, record_path, record):
    """Caps this process's resident memory at `cap_mib`: once exceeded, writes
    ``record`` (plus the cap and the RSS reached) to `record_path` as JSON,
    says so on stdout and ends the process with exit code 137."""

    def stop(rss):
        Path(record_path).write_text(json.dumps(
            {**record, "cap_mib": cap_mib, "stopped_at_rss_mib": rss / 2**20}))
        what = " ".join(str(v) for k, v in record.items() if k != "rank")
        print(f"[capped] rank {record.get('rank')}: {what} exceeded the cap "
              f"({rss / 2**20:.0f} MiB > {cap_mib:.0f} MiB): stopped", flush=True)
        os._exit(137)

    return install_cap(int(cap_mib * 2**20), stop)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cap-mib", type=float, required=True)
    parser.add_argument("--config", required=True)
    parser.add_argument("--model", required=True)
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--per-replica-batch", type=int, default=32)
    parser.add_argument("--out", required=True)
    args = parser.parse_args(argv)
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    rank = json.loads(os.environ.get("TF_CONFIG", "{}")).get("task", {}).get("index", 0)
    install_exit_cap(args.cap_mib, f"{args.out}.rank{rank}.capped.json",
                     {"rank": rank, "config": args.config, "model": args.model})
    from benchmarks import memory

    result = memory.measure(args.config, args.model, args.steps, args.per_replica_batch)
    result["cap_mib"] = args.cap_mib
    Path(f"{args.out}.rank{rank}.json").write_text(json.dumps(result))
    print(f"[capped] rank {rank}: {args.config} {args.model} trained under the cap, peak RSS "
          f"{result['peak_rss'] / 2**20:.0f} MiB", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
