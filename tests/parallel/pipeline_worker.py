"""Worker: `keras_comm.parallel.Pipeline` across real worker processes.

Usage: pipeline_worker.py STATE_DIR, on 4 workers: the suite's one launch
of 4 workers (`_cluster.shared_cluster`), which also runs the 4-worker group
of tests/parallel/parallel_worker.py (tests/parallel/test_parallel_multiprocess.py)
and the KerasHub group of tests/parallel/distribution_worker.py
(tests/parallel/test_distribution_multiprocess.py).
Every check runs with one replica per worker:

- exact: each configuration (CONFIGS: stages, micro-batches, schedule,
  mesh) trains with `model.fit`; every worker reports its full weights
  (gathered) and loss, and `evaluate` and `predict` for OUTPUT_CONFIGS
  (every configuration under KERAS_COMM_FULL_GRID=1); the chief alone also
  trains the unsplit model without a strategy on the same global batches
  and reports it as the reference (the test compares every worker with it);
- bn: stages holding BatchNormalization, 1F1B on a 2 x 2 data x pipeline
  mesh; the chief's reference is the unsplit model trained micro-batch by
  micro-batch (the moving statistics, averaged over each stage's data
  group, included, and predict, which normalizes with them);
- bytes: this worker's trainable parameters (the buffer component) and its
  own stage's size;
- save: `save_weights` and `.keras` (the chief to STATE_DIR, others to a path
  of their own), reloaded by the test in one process;
- resume: fit interrupted at global step 3 with BackupAndRestore, then a
  fresh model fits from the backup; its weights equal an uninterrupted run's.
- zero: 2 data x 2 stages under ParallelOptimizer(zero_stage=1,
  accumulation_steps=2), Adam: the stage buffer's moments sharded over the
  stage's data group; exact against the unsplit model, the optimizer state
  a worker holds, peak RSS, and a resume with BackupAndRestore.

The references are computed once, on the chief: they are the same on every
worker, and each costs a trace of its own.

KERAS_COMM_FULL_GRID=1 adds FULL_CONFIGS.
"""

import os
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import tensorflow as tf

from _cluster import finish, run_groups, write_result
from _strategy import strategy

import keras  # noqa: E402

import keras_comm  # noqa: E402  (after the strategy: TF_CONFIG is read once)
from _pipeline_cases import bn_stages  # noqa: E402
from _pipeline_cases import bn_unsplit  # noqa: E402
from _pipeline_cases import data_group_steps  # noqa: E402
from _shared import rel  # noqa: E402
from keras_comm import parallel as P  # noqa: E402

N = strategy.num_replicas_in_sync
RANK = int(strategy.cluster_resolver.task_id)
CHIEF = RANK == 0
WIDTHS = (5, 6, 4, 7)
STEPS = 2

# name: (stages, micro-batches, schedule, mesh shape (data, pipeline) or None).
# One launch of 4 workers (the suite's cost: a second launch of 2 workers
# cost more than its cases): the 2-stage cases on a 2 x 2 data x pipeline
# mesh, each stage's replicas on two processes.
CONFIGS = {
    "p4_m8_1f1b": (4, 8, "1f1b", None),  # first: saved and resumed (save_and_resume)
    "p4_m2_gpipe": (4, 2, "gpipe", None),
    "p2x2_m1_gpipe": (2, 1, "gpipe", (2, 2)),
    "p2x2_m4_1f1b": (2, 4, "1f1b", (2, 2)),
    "p2x2_m2_1f1b_post": (2, 2, "1f1b", (2, 2)),
    # Stage 0 tensor-parallel over a "model" axis (mesh pipeline x model).
    "p2xtp2_m2_gpipe": (2, 2, "gpipe", "tp"),
}
FULL = os.environ.get("KERAS_COMM_FULL_GRID") == "1"
# The layer's path (GPipe) on the 2 x 2 mesh with 8 micro-batches: the same
# code as p2x2_m1_gpipe's with more micro-batches (8 run in p4_m8_1f1b).
FULL_CONFIGS = {"p2x2_m8_gpipe": (2, 8, "gpipe", (2, 2))}
if FULL:
    CONFIGS.update(FULL_CONFIGS)
# evaluate and predict run the forward half of the schedule's table, the
# same for GPipe and 1F1B (tests/parallel/test_schedules.py): compared for each stage
# count, mesh, layer after the pipeline, and tensor-parallel stage once.
OUTPUT_CONFIGS = set(CONFIGS) if FULL else {"p4_m8_1f1b", "p2x2_m1_gpipe", "p2x2_m2_1f1b_post", "p2xtp2_m2_gpipe"}
assert N == 4, N


TP_MESH = P.Mesh((2, 2), ("pipeline", "model"))


def stages(p, mesh=None):
    if mesh == "tp":  # stage 0: Megatron's MLP split over "model"; the unsplit: Dense(8, relu), Dense(WIDTHS[0])
        return [
            keras.Sequential([
                P.ColumnParallelDense(8, activation="relu", mesh=TP_MESH, axis="model"),
                P.RowParallelDense(WIDTHS[0], mesh=TP_MESH, axis="model"),
            ]),
            keras.layers.Dense(WIDTHS[1], activation="tanh"),
        ]
    return [keras.layers.Dense(WIDTHS[s], activation="tanh") for s in range(p)]


def unsplit_stages(p, mesh=None):
    if mesh == "tp":
        return [keras.layers.Dense(8, activation="relu"), keras.layers.Dense(WIDTHS[0]),
                keras.layers.Dense(WIDTHS[1], activation="tanh")]
    return stages(p)


def build(p, m, schedule, mesh, post=False, optimizer=None):
    kind = mesh
    mesh = {None: None, "tp": TP_MESH}.get(mesh) if not isinstance(mesh, tuple) else P.Mesh(mesh, ("data", "pipeline"))
    optimizer = optimizer or (lambda: keras.optimizers.SGD(0.1))
    with strategy.scope():
        model = keras.Sequential(
            [keras.Input((3,)), keras.layers.Dense(4), P.Pipeline(stages(p, kind), m, schedule, mesh=mesh)]
            + ([keras.layers.Dense(2)] if post else [])
        )
        model.compile(optimizer=optimizer(), loss="mse", metrics=["mae"])
    return model


def reference(p, post, weights, mesh=None):
    ref = keras.Sequential(
        [keras.Input((3,)), keras.layers.Dense(4)] + unsplit_stages(p, mesh) + ([keras.layers.Dense(2)] if post else [])
    )
    ref.compile(optimizer=keras.optimizers.SGD(0.1), loss="mse", metrics=["mae"])
    ref.set_weights(weights)
    return ref


def data(batch, out):
    rng = np.random.default_rng(0)
    x = rng.normal(size=(STEPS * batch, 3)).astype("float32")
    y = rng.normal(size=(STEPS * batch, out)).astype("float32")
    return x, y


def dataset(x, y, batch):
    ds = tf.data.Dataset.from_tensor_slices((x, y)).batch(batch)
    options = tf.data.Options()
    options.experimental_distribute.auto_shard_policy = tf.data.experimental.AutoShardPolicy.DATA
    return ds.with_options(options)


class Interrupt(keras.callbacks.Callback):
    def on_train_batch_begin(self, batch, logs=None):
        if batch == 3:
            raise RuntimeError("interrupted")


def exact(name):
    p, m, schedule, mesh = CONFIGS[name]
    post = name.endswith("_post")
    batch = 2 * N * m  # global batch
    if CHIEF:
        # The chief alone makes layers first (as a script whose chief builds an
        # evaluation model does): its layer names are numbered further on than
        # the other workers', which must not change the stages' initial values
        # (on the data x pipeline mesh replicas of a stage would disagree).
        keras.layers.Dense(1), keras.layers.Dense(1)
    model = build(p, m, schedule, mesh, post)
    start = P.full_weights(model)
    x, y = data(batch, 2 if post else WIDTHS[p - 1])
    h = model.fit(dataset(x, y, batch), epochs=1, verbose=0).history
    layer = [lay for lay in model.layers if isinstance(lay, P.Pipeline)][0]
    (buffer,) = [v for v in model.trainable_variables if "stage_weights" in v.path]
    stage = layer._held_stages(RANK)[0]
    out = {
        "weights": P.full_weights(model),
        "loss": h["loss"][0],
        "buffer_bytes": int(np.prod(buffer.shape)) * 4,
        "own_stage_bytes": layer.stage_nbytes(stage),
        "all_stage_bytes": sum(layer.stage_nbytes(s) for s in range(p)),
        "trainable_bytes": sum(int(np.prod(v.shape)) * 4 for v in model.trainable_variables),
        "stage": stage,
    }
    if name in OUTPUT_CONFIGS:
        ev = model.evaluate(dataset(x, y, batch), verbose=0, return_dict=True)
        out["evaluate"] = {k: ev[k] for k in ("loss", "mae")}
        out["predict"] = model.predict(dataset(x, y, batch), verbose=0)
    if CHIEF:
        ref = reference(p, post, start, mesh)
        h_ref = ref.fit(x, y, batch_size=batch, epochs=1, shuffle=False, verbose=0).history
        out["reference"] = {"weights": ref.get_weights(), "loss": h_ref["loss"][0]}
        if name in OUTPUT_CONFIGS:
            ev_ref = ref.evaluate(x, y, batch_size=batch, verbose=0, return_dict=True)
            out["reference"]["evaluate"] = {k: ev_ref[k] for k in ("loss", "mae")}
            out["reference"]["predict"] = ref.predict(x, verbose=0)
    return out


def bn_exact():
    """BatchNormalization in both stages, 2 data x 2 stages, 2 micro-batches, 1F1B's step."""
    m, batch = 2, 16  # global batch 16: per pipeline group 8, micro-batches of 4
    with strategy.scope():
        model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(4),
                                  P.Pipeline(bn_stages(), m, "1f1b", mesh=P.Mesh((2, 2), ("data", "pipeline")))])
        model.compile(optimizer=keras.optimizers.SGD(0.1), loss="mse")
    start = P.full_weights(model)  # kernel, bias, gamma, beta, moving mean, variance, ...
    x, y = data(batch, 6)
    model.fit(dataset(x, y, batch), epochs=1, verbose=0)
    out = {"weights": P.full_weights(model), "predict": model.predict(dataset(x, y, batch), verbose=0)}
    if CHIEF:
        ref = bn_unsplit()
        ref.set_weights(start)
        data_group_steps(ref, keras.optimizers.SGD(0.1), x, y, batch, m, 2)
        out["reference"] = {
            "weights": ref.get_weights(),
            "moving": ["moving" in w.path for w in ref.weights],
            "predict": ref.predict(x, verbose=0),
        }
    return out


def own_path(state_dir, name):
    return str(Path(state_dir) / name) if CHIEF else str(Path(tempfile.mkdtemp()) / name)


def save_and_resume(state_dir):
    name = next(iter(CONFIGS))
    p, m, schedule, mesh = CONFIGS[name]
    batch = 2 * N * m
    x, y = data(batch, WIDTHS[p - 1])
    x, y = np.concatenate([x] * 3), np.concatenate([y] * 3)  # 6 steps
    # Adam: the stage buffer's moments differ by stage and must come back
    # per stage too (with SGD a resume that dropped them would still pass).
    adam = lambda: keras.optimizers.Adam(0.01)  # noqa: E731
    straight = build(p, m, schedule, mesh, optimizer=adam)
    start = P.full_weights(straight)
    straight.fit(dataset(x, y, batch), epochs=1, verbose=0)
    want = P.full_weights(straight)
    straight.save_weights(own_path(state_dir, "pipe.weights.h5"))
    straight.save(own_path(state_dir, "pipe.keras"))
    np.save(own_path(state_dir, "pipe_weights.npy"), np.array(want, dtype=object), allow_pickle=True)

    backup = Path(state_dir) / "backup"
    first = build(p, m, schedule, mesh, optimizer=adam)
    P.set_full_weights(first, start)
    try:
        first.fit(dataset(x, y, batch), epochs=1, verbose=0,
                  callbacks=[Interrupt(), keras_comm.callbacks.BackupAndRestore(str(backup), save_freq=2)])
    except RuntimeError as e:
        if "interrupted" not in str(e):
            raise
    again = build(p, m, schedule, mesh, optimizer=adam)  # fresh weights: the backup must restore them
    again.fit(dataset(x, y, batch), epochs=1, verbose=0,
              callbacks=[keras_comm.callbacks.BackupAndRestore(str(backup), save_freq=2)])
    return {
        "resume_rel": rel(want, P.full_weights(again)),
        "resume_optimizer_rel": rel(
            [np.asarray(v) for v in straight.optimizer.variables],
            [np.asarray(v) for v in again.optimizer.variables],
        ),
    }


def zero_case(state_dir):
    """ZeRO-1 of the stage buffer over its data group, 1F1B on a (2, 2) mesh."""
    import resource

    adam = lambda: keras.optimizers.Adam(0.01)  # noqa: E731
    k, batch = 2, 8  # 2 micro-batches of 8 accumulated per update
    x, y = data(batch * k, WIDTHS[1])
    x, y = np.concatenate([x] * 2), np.concatenate([y] * 2)  # 8 micro-steps: 4 updates

    def po():
        return keras_comm.callbacks.ParallelOptimizer(accumulation_steps=k, zero_stage=1)

    straight = build(2, 2, "1f1b", (2, 2), optimizer=adam)
    start = P.full_weights(straight)
    cb = po()
    straight.fit(dataset(x, y, batch), epochs=1, verbose=0, callbacks=[cb])
    want = P.full_weights(straight)
    state = cb._engine.state
    layer = straight.layers[1]
    length = int(layer._buffer.shape[0])
    grouped = [int(np.prod(slot.value.shape)) for slot, _, _ in state.slot_pairs[0][2]]
    held_user = [int(tf.size(c.read_value())) for u in state.grouped_user_slots()
                 for c in keras_comm.training.sharded_state.local_components(u)]
    straight.save_weights(own_path(state_dir, "zero.weights.h5"))

    backup = Path(state_dir) / "zero_backup"
    first = build(2, 2, "1f1b", (2, 2), optimizer=adam)
    P.set_full_weights(first, start)
    try:
        first.fit(dataset(x, y, batch), epochs=1, verbose=0,
                  callbacks=[po(), Interrupt(), keras_comm.callbacks.BackupAndRestore(str(backup), save_freq=2)])
    except RuntimeError as e:
        if "interrupted" not in str(e):
            raise
    again = build(2, 2, "1f1b", (2, 2), optimizer=adam)
    again.fit(dataset(x, y, batch), epochs=1, verbose=0,
              callbacks=[po(), keras_comm.callbacks.BackupAndRestore(str(backup), save_freq=2)])
    out = {
        "weights": want,
        "resume_rel": rel(want, P.full_weights(again)),
        "buffer_length": length,
        "grouped_slot_sizes": grouped,
        "held_user_slot_elements": held_user,
        "optimizer_bytes": cb.state_bytes(breakdown=True)["optimizer"],
        "peak_rss_kib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss,
    }
    if CHIEF:
        ref = keras.Sequential([keras.Input((3,)), keras.layers.Dense(4)] + unsplit_stages(2))
        ref.compile(optimizer=adam(), loss="mse")
        ref.set_weights(start)
        ref.fit(x, y, batch_size=batch * k, epochs=1, shuffle=False, verbose=0)
        out["reference_weights"] = ref.get_weights()
    return out


def pipeline(state_dir):
    cpu = {"import": time.process_time()}  # the suite's cost, per phase

    def lap(key):
        cpu[key] = round(time.process_time() - sum(cpu.values()), 2)

    out = {"rank": RANK, "exact": {}}
    for name in CONFIGS:
        out["exact"][name] = exact(name)
        lap(name)
    out["bn"] = bn_exact()
    lap("bn")
    out.update(save_and_resume(state_dir))
    lap("resume")
    out["zero"] = zero_case(state_dir)
    lap("zero")
    out["cpu_seconds"] = cpu
    return out


def main(state_dir):
    import distribution_worker
    import parallel_worker

    write_result(run_groups([
        ("pipeline", lambda: pipeline(state_dir)),
        ("parallel", lambda: parallel_worker.results(strategy)),
        ("kerashub", lambda: distribution_worker.four_workers(strategy, state_dir)),
    ]))


if __name__ == "__main__":
    main(sys.argv[1])
    finish()  # _cluster.finish: skip the slow teardown
