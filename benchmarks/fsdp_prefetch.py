"""Step time of FullyShard with and without gather prefetch, side by side.

Worker (through the launcher, which sets TF_CONFIG):
``python -m keras_comm_run -n N -m benchmarks.fsdp_prefetch --model mlp42m``.
Every worker builds the same `benchmarks.memory` model twice, fully sharded
(`FullyShard(prefetch=True)` and `prefetch=False`), compiles both with Adam,
warms each up (tracing), then runs `--rounds` rounds, each a timed `fit` of
`--steps` steps of one model and then of the other (the order alternating
per round), so both see the same machine load. Rank 0 prints one JSON line:
each variant's per-step seconds per round, their medians and the ratio of
medians (prefetch / no prefetch; < 1 is faster with prefetch).
"""

import argparse
import json
import statistics
import time


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="mlp42m")
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--per-replica-batch", type=int, default=32)
    args = parser.parse_args(argv)

    import tensorflow as tf

    import keras_comm  # noqa: F401  (model.fit under MWMS)
    from benchmarks import memory

    strategy = tf.distribute.MultiWorkerMirroredStrategy()
    rank = strategy.cluster_resolver.task_id or 0
    n = strategy.num_replicas_in_sync
    global_batch = args.per_replica_batch * n
    ds = memory.dataset(args.model, args.per_replica_batch, n)

    models = {
        "prefetch": memory._zero3(strategy, args.model, prefetch=True)[0],
        "no_prefetch": memory._zero3(strategy, args.model, prefetch=False)[0],
    }
    for m in models.values():  # tracing, the first steps
        m.fit(ds, epochs=1, steps_per_epoch=2, verbose=0)
    times = {name: [] for name in models}
    names = list(models)
    for r in range(args.rounds):
        for name in names if r % 2 == 0 else names[::-1]:
            started = time.perf_counter()
            models[name].fit(ds, epochs=1, steps_per_epoch=args.steps, verbose=0)
            times[name].append((time.perf_counter() - started) / args.steps)
    medians = {name: statistics.median(t) for name, t in times.items()}
    if rank == 0:
        print(json.dumps({
            "model": args.model, "workers": n, "steps": args.steps, "rounds": args.rounds,
            "global_batch": global_batch, "seconds_per_step": times, "median": medians,
            "ratio_prefetch_over_none": medians["prefetch"] / medians["no_prefetch"],
        }), flush=True)


if __name__ == "__main__":
    main()
