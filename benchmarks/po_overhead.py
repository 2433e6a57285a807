"""ParallelOptimizer's time per micro-batch next to plain `fit`, interleaved.

Each configuration trains its own copy of `benchmarks.training`'s MLP; round
after round, every configuration runs one `fit` of `steps` steps, back to
back, so slow and fast periods of a shared machine hit all of them alike.
Time per micro-batch: the interval between batch ends after the first
accumulation window (the timer of `measure_parallel_optimizer`), the slower
rank's. The summary gives the ratio of medians, the median of per-round
ratios to the same round's plain `fit`, and their range (the noise).

Beside wall time, each rank records its process's CPU seconds (user + sys,
all threads: `time.process_time`) over the same interval. On a shared
machine wall time per round swings by 2-4x with the neighbours' load; the
CPU a configuration spends per micro-batch swings far less, so the CPU ratio
is the steadier measure of what the callback adds (the sum over ranks is
reported: every rank does the same work).

Run (2 workers):

    python -m keras_comm_run -n 2 -m benchmarks.po_overhead --rounds 10 --steps 20 \\
        --configs '[null, [1, 0], [1, 1], [1, 2], [4, 0]]' --out /tmp/po
    python -m benchmarks.po_overhead --summarize /tmp/po
"""

import argparse
import json
import statistics
import sys
import time


def measure(rounds, steps, configs, per_replica_batch, out):
    import tensorflow as tf
    import keras

    import keras_comm  # noqa: F401  (model.fit under MWMS)
    from keras_comm.callbacks import ParallelOptimizer
    from benchmarks import training

    strategy = tf.distribute.MultiWorkerMirroredStrategy()
    n = strategy.num_replicas_in_sync
    rank = strategy.cluster_resolver.task_id or 0
    ds = training.dataset("mlp", per_replica_batch * n)

    class Timer(keras.callbacks.Callback):
        def on_train_begin(self, logs=None):
            self.ends = []
            self.cpu = []

        def on_train_batch_end(self, batch, logs=None):
            self.ends.append(time.perf_counter())
            self.cpu.append(time.process_time())

    models = {}
    for c in configs:
        with strategy.scope():
            models[json.dumps(c)] = training.build_model("mlp")
    times = {json.dumps(c): [] for c in configs}
    cpu = {json.dumps(c): [] for c in configs}
    for _ in range(rounds):
        for c in configs:
            timer = Timer()
            callbacks = [timer]
            if c:
                callbacks.insert(0, ParallelOptimizer(accumulation_steps=c[0], zero_stage=c[1]))
            models[json.dumps(c)].fit(ds, epochs=1, steps_per_epoch=steps, verbose=0,
                                      callbacks=callbacks)
            start = c[0] - 1 if c else 0
            times[json.dumps(c)].append(
                (timer.ends[-1] - timer.ends[start]) / (steps - 1 - start)
            )
            cpu[json.dumps(c)].append(
                (timer.cpu[-1] - timer.cpu[start]) / (steps - 1 - start)
            )
    with open(f"{out}.rank{rank}.json", "w") as f:
        json.dump({"rank": rank, "workers": n, "global_micro_batch": per_replica_batch * n,
                   "times": times, "cpu": cpu}, f)


def summarize(out, workers=2):
    ranks = [json.load(open(f"{out}.rank{k}.json")) for k in range(workers)]
    keys = list(ranks[0]["times"])
    slow = {k: [max(v) for v in zip(*(r["times"][k] for r in ranks))] for k in keys}
    plain = slow["null"]
    print("wall time per micro-batch (slower rank):")
    _print_ratios(keys, slow, plain, "ms")
    if all("cpu" in r for r in ranks):
        cpu = {k: [sum(v) for v in zip(*(r["cpu"][k] for r in ranks))] for k in keys}
        print("process CPU per micro-batch (user + sys, summed over ranks):")
        _print_ratios(keys, cpu, cpu["null"], "CPU-ms")


def _print_ratios(keys, seconds, plain, unit):
    for k in keys:
        ratios = [t / p for t, p in zip(seconds[k], plain)]
        print(f"{k:8s} {statistics.median(seconds[k]) * 1e3:7.1f} {unit}/micro-batch  "
              f"ratio of medians {statistics.median(seconds[k]) / statistics.median(plain):.2f}  "
              f"median of per-round ratios {statistics.median(ratios):.2f} "
              f"[{min(ratios):.2f}, {max(ratios):.2f}]  rounds {len(ratios)}")


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=10)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--configs", default="[null, [1, 0], [1, 1], [1, 2], [4, 0]]",
                        help="JSON list: null (plain fit) or [accumulation_steps, zero_stage]")
    parser.add_argument("--per-replica-batch", type=int, default=64)
    parser.add_argument("--out", help="prefix of the per-rank JSON files")
    parser.add_argument("--summarize", metavar="OUT", help="print the summary of a run")
    args = parser.parse_args(argv)
    if args.summarize:
        summarize(args.summarize)
        return 0
    measure(args.rounds, args.steps, json.loads(args.configs), args.per_replica_batch, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
