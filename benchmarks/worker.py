"""The script every TensorFlow worker process runs (started by `benchmarks.run`).

Usage (through the launcher, which sets TF_CONFIG):

    python -m benchmarks.worker --spec spec.json --out-dir DIR

`spec.json` says which families to run and with which sizes and iteration
counts. Each rank writes ``DIR/<tag>.rank<i>.json``.
"""

import argparse
import json
import os
import sys
import time
import traceback
from pathlib import Path


SOURCE_VAR = "KERAS_COMM_BENCH_SOURCE"


def log(message):
    print(message, flush=True)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--spec", required=True, help="JSON file: families and parameters")
    parser.add_argument("--out-dir", required=True, help="directory for the per-rank JSON")
    parser.add_argument("--tag", required=True, help="file name prefix of the results")
    args = parser.parse_args(argv)
    spec = json.loads(Path(args.spec).read_text())
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    source = os.environ.get(SOURCE_VAR)
    if source:
        # A `git archive` snapshot of keras_comm (run.py --ref): ahead of the
        # current directory, which `python -m` puts first on sys.path.
        sys.path.insert(0, source)

    import tensorflow as tf

    import keras_comm  # Keras 3 x MWMS fixes for model.fit

    strategy = tf.distribute.MultiWorkerMirroredStrategy()
    rank = strategy.cluster_resolver.task_id or 0
    result = {
        "rank": rank,
        "workers": strategy.num_replicas_in_sync,
        "pid": os.getpid(),
        "keras_comm_file": keras_comm.__file__,
    }
    path = Path(args.out_dir) / f"{args.tag}.rank{rank}.json"
    started = time.perf_counter()

    def families():
        if "collectives" in spec:
            from benchmarks import collectives

            c = spec["collectives"]
            yield "collectives", lambda: collectives.measure(
                strategy, c["ops"], c["sizes_mb"], c["iters"], c["warmup"], log=log
            )
        if "fusion" in spec:
            from benchmarks import fusion

            f = spec["fusion"]
            yield "fusion", lambda: fusion.measure(
                strategy, f["counts"], f["sizes_mb"], f["iters"], f["warmup"], log=log
            )
        if "scaling" in spec:
            from benchmarks import training

            yield "scaling", lambda: training.measure_scaling(strategy, **spec["scaling"], log=log)
        if "parallel_optimizer" in spec:
            from benchmarks import training

            yield "parallel_optimizer", lambda: training.measure_parallel_optimizer(
                strategy, **spec["parallel_optimizer"], log=log
            )
        if "nontrainable" in spec:
            from benchmarks import nontrainable

            yield "nontrainable", lambda: nontrainable.measure(strategy, **spec["nontrainable"], log=log)
        if "fsdp" in spec:
            from benchmarks import fsdp_speed

            yield "fsdp", lambda: fsdp_speed.measure(strategy, **spec["fsdp"], log=log)

    failed = False
    for name, measure in families():
        try:
            result[name] = measure()
        except Exception as e:  # noqa: BLE001  (one family's failure must not lose the others)
            traceback.print_exc()
            result[name] = {"error": f"{type(e).__name__}: {e}"[:2000]}
            failed = True
        result["seconds"] = time.perf_counter() - started
        # Written after every family, so a later crash keeps what was measured.
        _write(path, result)
    return 1 if failed else 0


def _write(path, result):
    tmp = path.with_suffix(f".tmp{os.getpid()}")
    tmp.write_text(json.dumps(result))
    os.replace(tmp, path)


if __name__ == "__main__":
    sys.exit(main())
