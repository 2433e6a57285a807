"""Worker: sharded state (tensor-parallel, embedding, MoE, ZeRO) through
`keras_comm.callbacks.BackupAndRestore`, `save_weights` and `.keras`.

Usage: sharded_checkpoint_worker.py STATE_DIR PHASE, PHASE in

- ``interrupt``: every configuration (CONFIGS) trains for EPOCHS epochs with
  `BackupAndRestore(save_freq=...)` and is interrupted (an exception on every
  worker) before global step INTERRUPT_STEP; the backup stays in STATE_DIR.
- ``resume``: a fresh process (the restart) fits every configuration again
  from its backup, then trains the same model uninterrupted, and compares
  the full (gathered) weights and each worker's optimizer state; then saves
  the resumed model with `save_weights` and `.keras` (every worker; the
  chief to STATE_DIR, the others to a path of their own), loads each into a
  fresh model and compares again. STATE_DIR keeps the chief's files for the
  single-process check of the test.

Run by tests/callbacks/test_checkpoint_multiprocess.py through
checkpoint_launch_worker.py: ``interrupt`` in the first launch, ``resume``
in the last.
"""

import json
import sys
import tempfile
from pathlib import Path

import numpy as np
import tensorflow as tf

from _cluster import finish, write_result
from _strategy import strategy

import keras  # noqa: E402

import keras_comm  # noqa: E402  (after the strategy: TF_CONFIG is read once)
from _shared import InterruptAt, rel, resume_dataset  # noqa: E402
from keras_comm import parallel as P  # noqa: E402

N = strategy.num_replicas_in_sync
RANK = int(strategy.cluster_resolver.task_id)
CHIEF = RANK == 0
STEPS, EPOCHS, INTERRUPT_STEP = 6, 2, 9
VOCAB, SEQ = 8, 3
CONFIGS = {
    # name: (save_freq, ParallelOptimizer kwargs or None)
    "tp": ("epoch", None),
    "emb_moe": ("epoch", None),
    "tp_po1": (4, dict(accumulation_steps=2, zero_stage=1)),
}


def optimizer_values(model):
    """The optimizer's variables as numpy; under ParallelOptimizer its slots
    hold no memory and their (full) values come from the callback's shards
    (a collective: every worker calls)."""
    from keras_comm.variables import annotations

    store = annotations.external_slots(model.optimizer)
    return [
        store.value(v) if store is not None and store.owns(v) else np.asarray(v)
        for v in model.optimizer.variables
    ]

def build(config):
    keras.utils.set_random_seed(1)
    with strategy.scope():
        if config.startswith("tp"):
            model = keras.Sequential([
                keras.Input((5,)),
                P.ColumnParallelDense(8, activation="tanh", seed=2),
                P.RowParallelDense(3, seed=3),
            ])
        else:
            model = keras.Sequential([
                keras.Input((SEQ,), dtype="int32"),
                P.ParallelEmbedding(VOCAB, 4, seed=1),
                P.MixtureOfExperts(4, 4, top_k=2, capacity_factor=2.0, activation="tanh", seed=5),
                keras.layers.Flatten(),
                keras.layers.Dense(3),
            ])
        model.compile(optimizer=keras.optimizers.Adam(0.05), loss="mse")
    return model


def dataset(config):
    if config.startswith("tp"):
        return resume_dataset(2 * N, STEPS)
    tokens = lambda rng, n: rng.integers(0, VOCAB, size=(n, SEQ)).astype("int32")  # noqa: E731
    return resume_dataset(2 * N, STEPS, tokens)


def callbacks(config, backup_dir=None):
    save_freq, po = CONFIGS[config]
    out = [keras_comm.callbacks.ParallelOptimizer(**po)] if po else []
    if backup_dir is not None:
        out.append(keras_comm.callbacks.BackupAndRestore(str(backup_dir), save_freq=save_freq))
    return out


def state(model):
    """Full weights (gathered: every worker calls) and this worker's optimizer variables."""
    return P.full_weights(model), optimizer_values(model)


def own_path(state_dir, name):
    # The chief writes the real file; every other worker takes part (the
    # shards are gathered) and writes a file of its own.
    return str(Path(state_dir) / name) if CHIEF else str(Path(tempfile.mkdtemp()) / name)


def interrupt(state_dir):
    Path(state_dir).mkdir(parents=True, exist_ok=True)
    for config in CONFIGS:
        model = build(config)
        try:
            model.fit(dataset(config), epochs=EPOCHS, verbose=0,
                      callbacks=[InterruptAt(INTERRUPT_STEP, STEPS), *callbacks(config, Path(state_dir) / config)])
        except RuntimeError as e:
            if "interrupted" not in str(e):
                raise
    return {"rank": RANK, "interrupted": list(CONFIGS)}


def resume(state_dir):
    results = {}
    for config in CONFIGS:
        backup_dir = Path(state_dir) / config
        model = build(config)
        cbs = callbacks(config, backup_dir)
        model.fit(dataset(config), epochs=EPOCHS, verbose=0, callbacks=cbs)
        weights, opt = state(model)
        reference = build(config)
        reference.fit(dataset(config), epochs=EPOCHS, verbose=0, callbacks=callbacks(config))
        ref_weights, ref_opt = state(reference)
        r = {
            "restored": cbs[-1].restored,
            "resume_max_rel": rel(ref_weights, weights),
            "resume_optimizer_max_rel": rel(ref_opt, opt),
        }
        # save_weights / load_weights and .keras, on every worker.
        path = own_path(state_dir, f"{config}.weights.h5")
        model.save_weights(path)
        loaded = build(config)
        with strategy.scope():
            loaded.optimizer.build(loaded.trainable_variables)
        loaded.load_weights(path)
        w, o = state(loaded)
        r["save_weights_max_rel"] = rel(weights, w)
        r["save_weights_optimizer_max_rel"] = rel(opt, o)
        path = own_path(state_dir, f"{config}.keras")
        model.save(path)
        with strategy.scope():
            loaded = keras.models.load_model(path)
        w, o = state(loaded)
        r["keras_max_rel"] = rel(weights, w)
        r["keras_optimizer_max_rel"] = rel(opt, o)
        if CHIEF:
            np.savez(Path(state_dir) / f"{config}.full.npz", *weights)
        results[config] = r
    return {"rank": RANK, "world": N, "results": results}


if __name__ == "__main__":
    write_result({"interrupt": interrupt, "resume": resume}[sys.argv[2]](sys.argv[1]))
    finish()  # _cluster.finish: skip the slow teardown
