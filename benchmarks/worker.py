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
from pathlib import Path


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

    import tensorflow as tf

    import keras_comm  # noqa: F401  (Keras 3 x MWMS fixes for model.fit)

    strategy = tf.distribute.MultiWorkerMirroredStrategy()
    rank = strategy.cluster_resolver.task_id or 0
    result = {"rank": rank, "workers": strategy.num_replicas_in_sync, "pid": os.getpid()}
    started = time.perf_counter()

    if "collectives" in spec:
        from benchmarks import collectives

        c = spec["collectives"]
        result["collectives"] = collectives.measure(
            strategy, c["ops"], c["sizes_mb"], c["iters"], c["warmup"], log=log
        )
    if "scaling" in spec:
        from benchmarks import training

        result["scaling"] = training.measure_scaling(strategy, **spec["scaling"], log=log)
    if "parallel_optimizer" in spec:
        from benchmarks import training

        result["parallel_optimizer"] = training.measure_parallel_optimizer(
            strategy, **spec["parallel_optimizer"], log=log
        )
    result["seconds"] = time.perf_counter() - started
    path = Path(args.out_dir) / f"{args.tag}.rank{rank}.json"
    tmp = path.with_suffix(f".tmp{os.getpid()}")
    tmp.write_text(json.dumps(result))
    os.replace(tmp, path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
