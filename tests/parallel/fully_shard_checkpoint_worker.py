"""FullyShard (ZeRO-3) state through `keras_comm.callbacks.BackupAndRestore`,
`save_weights` and `.keras` on real workers; imported by
tests/parallel/fully_shard_worker.py, whose launches run these phases.

- `backup_phase(strategy, state_dir)` (2 workers): the fully sharded MLP with
  Adam trains EPOCHS epochs with `BackupAndRestore(save_freq=SAVE_FREQ)` and
  is interrupted (an exception on every worker) before global step
  INTERRUPT_STEP: the backup in ``state_dir/same`` is restored by a freshly
  built model (new variables, new functions, same processes) that finishes
  the run and is compared with an uninterrupted run of the same worker count
  -- full weights and every worker's Adam shards, exactly. The
  resumed model is then saved with `save_weights` and `.keras` (the chief
  into ``state_dir``) for the test's one-process checks.
- `cross_backup(strategy, state_dir)`: the same interruption on another
  replica count (the test: 3 in-process replicas), leaving
  ``state_dir/cross``.
- `resume_phase(strategy, state_dir)` (a different worker count, fresh
  processes: the restart): restores ``state_dir/cross``, finishes, and
  compares weights and Adam moments (gathered full-size through
  `save_weights`) with the unwrapped model trained uninterrupted in this
  process alone on the same global batches.

The global batch (GLOBAL_BATCH = 6) divides over 2 and 3 workers; every
shard size changes between the two (ceil(size / 2) vs ceil(size / 3)).
"""

import tempfile
from pathlib import Path

import keras
import numpy as np

import keras_comm
from _shared import InterruptAt, rel  # noqa: E402
from keras_comm import parallel as P

GLOBAL_BATCH, STEPS, EPOCHS = 6, 6, 2
SAVE_FREQ, INTERRUPT_STEP = 4, 9  # the backup holds global step 8: epoch 1, batch 2


def mlp():
    return keras.Sequential(
        [
            keras.Input((5,)),
            keras.layers.Dense(7, activation="tanh", name="d1"),
            keras.layers.LayerNormalization(name="ln"),
            keras.layers.Dense(3, name="d2"),
        ],
        name="mlp",
    )


def data():
    rs = np.random.RandomState(3)
    n = GLOBAL_BATCH * STEPS
    return rs.randn(n, 5).astype("float32"), rs.randn(n, 3).astype("float32")


def initial_weights():
    keras.utils.set_random_seed(1)
    return mlp().get_weights()


def build(strategy):
    unwrapped = mlp()
    unwrapped.set_weights(initial_weights())
    with strategy.scope():
        model = P.fully_shard(unwrapped)
        model.compile(keras.optimizers.Adam(0.02), "mse")
    return model


def _fit(model, callbacks):
    x, y = data()
    model.fit(x, y, batch_size=GLOBAL_BATCH, epochs=EPOCHS, shuffle=False, verbose=0,
              callbacks=callbacks)


def _interrupted(strategy, backup_dir):
    model = build(strategy)
    try:
        _fit(model, [InterruptAt(INTERRUPT_STEP, STEPS), keras_comm.callbacks.BackupAndRestore(str(backup_dir), save_freq=SAVE_FREQ)])
    except RuntimeError as e:
        if "interrupted" not in str(e):
            raise
    else:
        raise AssertionError("the interruption did not happen")


def _resumed(strategy, backup_dir):
    model = build(strategy)
    backup = keras_comm.callbacks.BackupAndRestore(str(backup_dir), save_freq=SAVE_FREQ)
    _fit(model, [backup])
    return model, backup.restored


def _chief(strategy):
    return int(strategy.cluster_resolver.task_id) == 0


def _own_path(strategy, state_dir, name):
    # Every worker saves (the shards are gathered); the chief's file is kept.
    if _chief(strategy):
        return str(Path(state_dir) / name)
    return str(Path(tempfile.mkdtemp()) / name)


def _file_state(path):
    """(weights, optimizer variables) of a .weights.h5 file, in file order."""
    import h5py

    with h5py.File(path, "r") as f:
        layers = f["layers"]
        weights = [np.asarray(layers[name]["vars"][k]) for name in layers
                   for k in sorted(layers[name]["vars"], key=int)]
        opt = f["optimizer"]["vars"]
        slots = [np.asarray(opt[k]) for k in sorted(opt, key=int)]
    return weights, slots


def backup_phase(strategy, state_dir):
    state_dir = Path(state_dir)
    _interrupted(strategy, state_dir / "same")
    model, restored = _resumed(strategy, state_dir / "same")
    reference = build(strategy)
    _fit(reference, [])
    out = {
        "restored": restored,
        "resume_weights_rel": rel(P.full_weights(reference), P.full_weights(model)),
        # This worker's Adam shards (iterations, moments), compared as held.
        "resume_optimizer_rel": rel([np.asarray(v) for v in reference.optimizer.variables],
                                    [np.asarray(v) for v in model.optimizer.variables]),
        "optimizer_shapes": [list(v.shape) for v in model.optimizer.variables],
    }
    model.save_weights(_own_path(strategy, state_dir, "fs.weights.h5"))
    model.save(_own_path(strategy, state_dir, "fs.keras"))
    full = P.full_weights(model)  # a collective: every worker gathers
    if _chief(strategy):
        np.savez(state_dir / "fs.full.npz", *full)
    return out


def cross_backup(strategy, state_dir):
    """The interrupted run whose backup (``state_dir/cross``) `resume_phase`
    restores on another worker count; tests/parallel/test_fully_shard_multiprocess.py
    runs it on 3 in-process replicas (one launch fewer than 3 workers)."""
    _interrupted(strategy, Path(state_dir) / "cross")


def resume_phase(strategy, state_dir):
    state_dir = Path(state_dir)
    model, restored = _resumed(strategy, state_dir / "cross")
    path = _own_path(strategy, state_dir, f"cross{strategy.num_replicas_in_sync}.weights.h5")
    model.save_weights(path)
    _, slots = _file_state(path)
    x, y = data()
    ref = mlp()
    ref.set_weights(initial_weights())
    ref.compile(keras.optimizers.Adam(0.02), "mse")
    ref.fit(x, y, batch_size=GLOBAL_BATCH, epochs=EPOCHS, shuffle=False, verbose=0)
    ref_slots = [np.asarray(v) for v in ref.optimizer.variables]
    return {
        "restored": restored,
        "shard_sizes": [int(np.prod(w.shape)) for w in model.trainable_weights],
        "weights_rel": rel(ref.get_weights(), P.full_weights(model)),
        # Full-size Adam moments (gathered into the file) vs the reference's.
        "optimizer_rel": rel(ref_slots, slots),
    }
