"""Bucketed gradient all-reduce (overlapping backward) next to one pack, interleaved.

Issue 18: with `keras_comm.set_gradient_bucket_bytes(n)` `fit`'s optimizer
sums the gradients in buckets, last layer first, each of which may start
while the backward of earlier layers still runs (on by default at 8 MiB;
`set_gradient_bucket_bytes(0)` is one packed all-reduce after the whole
backward, upstream's way). This measures both on a model sized so that the
gradient all-reduce and the backward take similar time.

Worker side (run under `keras_comm_run`), per configuration (bucket bytes,
0 = one pack) one copy of the same MLP, traced with its setting:

1. *Calibration* (not `fit`): the median time of a compiled forward+backward
   alone (no communication) and of one all-reduce of all the gradients'
   bytes (the strategy's own, one pack): how similar the two are.
2. *Step time*: round after round every configuration runs one `fit` of
   `steps` steps, the order reversed every other round; a round's time is
   the median interval between batch ends after the first, the slower
   rank's. Summary: median of the per-round ratios to one pack, and range.
3. *Timeline*: one `fit` of a few steps per configuration under
   `tf.profiler`; from the trace (rank 0), per step: when the backward's
   ops ran and when each gradient all-reduce (CollectiveReduceV2) was
   issued and finished, to show whether they overlapped at all.

Run (2 workers):

    python -m keras_comm_run -n 2 -m benchmarks.overlap --out /tmp/overlap
    python -m benchmarks.overlap --summarize /tmp/overlap
"""

import argparse
import glob
import json
import os
import statistics
import sys
import time

MIB = 1 << 20


def build_model(width, depth, seed=0):
    import keras

    inputs = keras.Input((width,))
    x = inputs
    for i in range(depth):
        x = keras.layers.Dense(width, activation="relu",
                               kernel_initializer=keras.initializers.GlorotUniform(seed + i),
                               name=f"dense_{i}")(x)
    outputs = keras.layers.Dense(10, name="head")(x)
    model = keras.Model(inputs, outputs)
    model.compile(optimizer=keras.optimizers.SGD(1e-4),
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    return model


def dataset(width, global_batch, steps):
    import numpy as np
    import tensorflow as tf

    rng = np.random.default_rng(0)
    x = rng.normal(size=(global_batch * steps, width)).astype("float32")
    y = rng.integers(0, 10, size=(global_batch * steps,)).astype("int32")
    return tf.data.Dataset.from_tensor_slices((x, y)).batch(global_batch).cache().repeat()


def _calibrate(strategy, model, x, y, iters):
    """(forward+backward alone, one all-reduce of every gradient) medians, s."""
    import tensorflow as tf

    def fwd_bwd(x, y):
        with tf.GradientTape() as tape:
            loss = tf.reduce_mean(model.loss(y, model(x, training=True)))
        return tape.gradient(loss, model.trainable_variables)

    def all_reduce(x, y):
        grads = [tf.ones_like(v) for v in model.trainable_variables]
        return tf.distribute.get_replica_context().all_reduce("sum", grads)

    out = {}
    for name, fn in (("fwd_bwd_s", fwd_bwd), ("all_reduce_s", all_reduce)):
        step = tf.function(lambda x, y, fn=fn: strategy.run(fn, args=(x, y)))
        for _ in range(2):
            step(x, y)
        times = []
        for _ in range(iters):
            start = time.perf_counter()
            result = step(x, y)
            tf.nest.map_structure(lambda t: t.values[0].numpy() if hasattr(t, "values")
                                  else t.numpy(), result[:1])
            times.append(time.perf_counter() - start)
        out[name] = statistics.median(times)
    return out


def _timeline(trace_dir):
    """Per step, from the host plane of one profile: backward ops, collectives.

    Returns [{"backward": [start, end], "collectives": [[start, end], ...],
    "first_reduce_before_backward_end": bool}] in ms from each step's start.
    """
    from tensorflow.tsl.profiler.protobuf import xplane_pb2

    path = sorted(glob.glob(os.path.join(trace_dir, "**", "*.xplane.pb"), recursive=True))[-1]
    space = xplane_pb2.XSpace()
    with open(path, "rb") as f:
        space.ParseFromString(f.read())
    events = []  # (start_ns, end_ns, name)
    for plane in space.planes:
        if plane.name != "/host:CPU":
            continue
        for line in plane.lines:
            for e in line.events:
                name = plane.event_metadata[e.metadata_id].name
                start = line.timestamp_ns + e.offset_ps / 1000
                events.append((start, start + e.duration_ps / 1000, name, line.name))
    return events


def _summarize_timeline(events):
    """Per compiled step: its backward ops, gradient all-reduces and update.

    A step is an outermost ``EagerLocalExecute: __inference_*`` call on the
    python thread that ran backward ops (``gradient_tape/`` in their name)
    and a CollectiveReduceV2. Times in ms from the step's start: backward
    ops [first start, last end]; each CollectiveReduceV2 event (an async
    kernel: the event is its launch; the ring then runs on other threads);
    the first and last optimizer update op (``AssignSubVariableOp``), which
    wait for every reduced gradient.
    """
    calls = sorted((s, e) for s, e, n, line in events
                   if line == "python" and n.startswith("EagerLocalExecute: __inference_"))
    outer = []
    for s, e in calls:
        if outer and s <= outer[-1][1]:
            continue
        outer.append((s, e))
    out = []
    for s0, e0 in outer:
        inside = [(s, e, n) for s, e, n, line in events if s0 <= s <= e0 and line != "python"]
        bwd = [(s, e) for s, e, n in inside if "gradient_tape/" in n and ":" in n]
        coll = sorted((s, e, n) for s, e, n in inside if n.endswith(":CollectiveReduceV2"))
        upd = sorted(s for s, e, n in inside if n.endswith(":AssignSubVariableOp"))
        if not bwd or not coll:
            continue
        ms = lambda t: (t - s0) / 1e6  # noqa: E731
        out.append({
            "step_ms": ms(e0),
            "backward_ms": [ms(min(s for s, _ in bwd)), ms(max(e for _, e in bwd))],
            "collectives_ms": [[ms(s), ms(e), n.split(":")[0]] for s, e, n in coll],
            "update_ms": [ms(upd[0]), ms(upd[-1])] if upd else None,
        })
    return out


def measure(configs, rounds, steps, width, depth, per_replica_batch, out, profile_steps):
    import keras
    import tensorflow as tf

    import keras_comm
    from keras_comm import watchdog  # noqa: F401

    strategy = tf.distribute.MultiWorkerMirroredStrategy()
    n = strategy.num_replicas_in_sync
    rank = strategy.cluster_resolver.task_id or 0
    global_batch = per_replica_batch * n
    ds = dataset(width, global_batch, steps)

    class Timer(keras.callbacks.Callback):
        def on_train_begin(self, logs=None):
            self.ends = []

        def on_train_batch_end(self, batch, logs=None):
            self.ends.append(time.perf_counter())

    models = {}
    grad_bytes = None
    for c in configs:
        with strategy.scope():
            models[c] = build_model(width, depth)
        grad_bytes = sum(int(v.numpy().nbytes) for v in models[c].trainable_variables)
        keras_comm.set_gradient_bucket_bytes(c)  # read when fit traces the step
        models[c].fit(ds, epochs=1, steps_per_epoch=3, verbose=0)
    keras_comm.set_gradient_bucket_bytes(0)

    x = tf.random.normal([per_replica_batch, width], seed=1)
    y = tf.zeros([per_replica_batch], tf.int32)
    with strategy.scope():
        calibration = _calibrate(strategy, models[configs[0]], x, y, iters=10)

    times = {str(c): [] for c in configs}
    cpu = {str(c): [] for c in configs}  # this process's CPU seconds per step
    for r in range(rounds):
        order = configs if r % 2 == 0 else configs[::-1]
        for c in order:
            timer = Timer()
            cpu0 = time.process_time()
            models[c].fit(ds, epochs=1, steps_per_epoch=steps, verbose=0, callbacks=[timer])
            cpu[str(c)].append((time.process_time() - cpu0) / steps)
            gaps = [b - a for a, b in zip(timer.ends, timer.ends[1:])]
            times[str(c)].append(statistics.median(gaps))

    timelines = {}
    if profile_steps:
        for c in configs:
            trace_dir = f"{out}.trace.rank{rank}.{c}"
            tf.profiler.experimental.start(trace_dir)
            models[c].fit(ds, epochs=1, steps_per_epoch=profile_steps, verbose=0)
            tf.profiler.experimental.stop()
            timelines[str(c)] = _summarize_timeline(_timeline(trace_dir))

    with open(f"{out}.rank{rank}.json", "w") as f:
        json.dump({"rank": rank, "workers": n, "global_batch": global_batch, "width": width,
                   "depth": depth, "gradient_bytes": grad_bytes, "calibration": calibration,
                   "times": times, "cpu_per_step": cpu, "timelines": timelines, "load_after": os.getloadavg()}, f)


def summarize(out, workers=2):
    ranks = [json.load(open(f"{out}.rank{k}.json")) for k in range(workers)]
    first = ranks[0]
    keys = list(first["times"])
    print(f"model: {first['depth']} x Dense({first['width']}) + head, gradients "
          f"{first['gradient_bytes'] / MIB:.1f} MiB, global batch {first['global_batch']}, "
          f"{workers} workers")
    for r in ranks:
        c = r["calibration"]
        print(f"rank {r['rank']}: forward+backward alone {c['fwd_bwd_s'] * 1e3:.1f} ms, "
              f"one all-reduce of the gradients {c['all_reduce_s'] * 1e3:.1f} ms")
    slow = {k: [max(v) for v in zip(*(r["times"][k] for r in ranks))] for k in keys}
    base = slow[keys[0]]
    for k in keys:
        ratios = [t / b for t, b in zip(slow[k], base)]
        label = "one pack" if k == "0" else f"{int(k) / MIB:g} MiB buckets"
        cpu = statistics.median(sum(r["cpu_per_step"][k][i] for r in ranks)
                                for i in range(len(ratios)))
        print(f"{label:16s} step {statistics.median(slow[k]) * 1e3:7.1f} ms (median of rounds)  "
              f"median of per-round ratios {statistics.median(ratios):.3f} "
              f"[{min(ratios):.3f}, {max(ratios):.3f}]  rounds {len(ratios)}  "
              f"CPU {cpu * 1e3:.0f} ms/step (all ranks, incl. fit's per-call overhead)")
    for k, steps in first["timelines"].items():
        label = "one pack" if k == "0" else f"{int(k) / MIB:g} MiB buckets"
        for s in steps[-2:]:
            b0, b1 = s["backward_ms"]
            colls = ", ".join(f"{a:.1f}-{b:.1f}" for a, b, _ in s["collectives_ms"])
            upd = s["update_ms"]
            upd = f"{upd[0]:.1f}-{upd[1]:.1f}" if upd else "?"
            print(f"timeline rank 0, {label}: step {s['step_ms']:.1f} ms, backward ops "
                  f"{b0:.1f}-{b1:.1f} ms, all-reduce launches {colls}, updates {upd} ms")


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--configs", default=f"0 {4 * MIB}",
                        help="bucket bytes per configuration, 0 = one pack (the baseline, first)")
    parser.add_argument("--rounds", type=int, default=8)
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--width", type=int, default=1024)
    parser.add_argument("--depth", type=int, default=6)
    parser.add_argument("--per-replica-batch", type=int, default=256)
    parser.add_argument("--profile-steps", type=int, default=4)
    parser.add_argument("--out", help="prefix of the per-rank JSON files")
    parser.add_argument("--summarize", metavar="OUT", help="print the summary of a run")
    parser.add_argument("--workers", type=int, default=2)
    args = parser.parse_args(argv)
    if args.summarize:
        summarize(args.summarize, args.workers)
        return 0
    configs = [int(c) for c in args.configs.split()]
    measure(configs, args.rounds, args.steps, args.width, args.depth, args.per_replica_batch,
            args.out, args.profile_steps)
    return 0


if __name__ == "__main__":
    sys.exit(main())
