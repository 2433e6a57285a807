"""Worker: Keras's own file-writing callbacks under MultiWorkerMirroredStrategy.

Usage: keras_callbacks_worker.py SHARED_DIR [CASE ...] (default: every case).
SHARED_DIR is one directory all workers see, as a real job's would be. Each
case runs `fit` with stock Keras callbacks (after `import keras_comm`) and
records, per worker, where every file was written and what it holds:

- ``files``: one fit with `ModelCheckpoint(".../w-{epoch}.weights.h5",
  save_weights_only=True)`, `ModelCheckpoint(".../best.keras", save_best_only=True)`,
  `ModelCheckpoint(".../m-{epoch}.keras", save_freq=4)`, `CSVLogger` and (with
  the tensorboard package installed) `TensorBoard`: which process wrote each file.
- ``sharded``: `ModelCheckpoint(".weights.h5")` of a tensor-parallel model
  (saving gathers the shards: every worker must call save), with
  `EarlyStopping` and `ReduceLROnPlateau` (each worker reads its own logs:
  they must agree).
- ``backup``: `keras.callbacks.BackupAndRestore(save_freq=4)` interrupted before
  global step 9, then resumed by a fresh model; compared with an
  uninterrupted fit.
- ``backup_subclass``: a user subclass of Keras's `BackupAndRestore`.

Every case catches its error, so one launch reports all; run a single case
to see its own failure (a failed save on one worker leaves the other in a
collective).
"""

import csv
import importlib.util
import os
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import tensorflow as tf

from _cluster import write_result
from _shared import without_tf_data_autotune

without_tf_data_autotune()  # as tests/_strategy.py does, and why
strategy = tf.distribute.MultiWorkerMirroredStrategy()

import keras  # noqa: E402

import keras_comm  # noqa: E402  (after the strategy: TF_CONFIG is read once)
from _shared import InterruptAt  # noqa: E402
from keras_comm import parallel as P  # noqa: E402

N = strategy.num_replicas_in_sync
RANK = int(strategy.cluster_resolver.task_id)
CHIEF = RANK == 0
STEPS, EPOCHS, INTERRUPT_STEP = 6, 2, 9

# --- where the workers save: every call of save / save_weights is recorded ---

SAVED = []
_save, _save_weights = keras.Model.save, keras.Model.save_weights


def _record_save(self, filepath, *args, **kwargs):
    SAVED.append(str(filepath))
    return _save(self, filepath, *args, **kwargs)


def _record_save_weights(self, filepath, *args, **kwargs):
    SAVED.append(str(filepath))
    return _save_weights(self, filepath, *args, **kwargs)


keras.Model.save = _record_save
keras.Model.save_weights = _record_save_weights


def build(sharded=False, lr=0.05):
    keras.utils.set_random_seed(1)
    with strategy.scope():
        if sharded:
            layers = [P.ColumnParallelDense(8, activation="tanh", seed=2), P.RowParallelDense(3, seed=3)]
        else:
            layers = [keras.layers.Dense(4, activation="tanh"), keras.layers.Dense(3)]
        model = keras.Sequential([keras.Input((5,)), *layers])
        model.compile(optimizer=keras.optimizers.Adam(lr), loss="mse")
    return model


def dataset():
    rng = np.random.default_rng(0)
    n = 2 * N * STEPS
    x = rng.normal(size=(n, 5)).astype("float32")
    y = rng.normal(size=(n, 3)).astype("float32")
    ds = tf.data.Dataset.from_tensor_slices((x, y)).batch(2 * N)
    options = tf.data.Options()
    options.experimental_distribute.auto_shard_policy = tf.data.experimental.AutoShardPolicy.DATA
    return ds.with_options(options)


def fit(model, callbacks, epochs=EPOCHS):
    return model.fit(dataset(), epochs=epochs, verbose=0, callbacks=callbacks)


def max_abs(a, b):
    return max(float(np.max(np.abs(np.asarray(x, np.float64) - np.asarray(y, np.float64))))
               for x, y in zip(a, b, strict=True))


def inside(path, directory):
    """Whether `path` is `directory` or under it."""
    path, directory = os.path.realpath(path), os.path.realpath(directory)
    return path == directory or path.startswith(directory + os.sep)


def saves(directory):
    """Where this worker saved during the case: in `directory`, elsewhere, left behind."""
    paths = list(SAVED)
    SAVED.clear()
    outside = [p for p in paths if not inside(p, directory)]
    return {
        "in_dir": sum(inside(p, directory) for p in paths),
        "outside": len(outside),
        "left_behind": [p for p in outside if os.path.exists(p)],
    }


class Spy(keras.callbacks.Callback):
    """Reads another callback's output path while `fit` runs (after its on_train_begin)."""

    def __init__(self, target, attribute):
        super().__init__()
        self.target, self.attribute, self.seen = target, attribute, None

    def on_epoch_end(self, epoch, logs=None):
        self.seen = str(getattr(self.target, self.attribute))


# --- the cases ---------------------------------------------------------------


def case_files(d):
    """ModelCheckpoint (weights; .keras best and every 4 steps), CSVLogger and
    TensorBoard in one fit, each writing into its own directory of `d`."""
    for sub in ("weights", "keras", "csv", "tb"):
        (d / sub).mkdir(exist_ok=True)
    weights = keras.callbacks.ModelCheckpoint(str(d / "weights" / "w-{epoch}.weights.h5"),
                                              save_weights_only=True)
    # (Keras's save_best_only fails with an integer save_freq, one process too.)
    best = keras.callbacks.ModelCheckpoint(str(d / "keras" / "best.keras"), monitor="loss",
                                           save_best_only=True)
    every = keras.callbacks.ModelCheckpoint(str(d / "keras" / "m-{epoch}.keras"), save_freq=4)
    logger = keras.callbacks.CSVLogger(str(d / "csv" / "log.csv"))
    callbacks = [weights, best, every, logger]
    board = None
    if importlib.util.find_spec("tensorboard") is not None:
        # (tf.summary.scalar is TensorBoard's: without it the callback fails anywhere.)
        board = keras.callbacks.TensorBoard(str(d / "tb"))
        callbacks.append(board)
    spies = [Spy(logger, "filename")] + ([Spy(board, "_log_write_dir")] if board else [])
    model = build()
    history = fit(model, callbacks + spies)
    paths = list(SAVED)
    SAVED.clear()
    out = {}
    for name, directory, suffix in (("weights_ckpt", d / "weights", ".weights.h5"),
                                    ("keras_ckpt", d / "keras", ".keras")):
        mine = [p for p in paths if p.endswith(suffix)]
        elsewhere = [p for p in mine if not inside(p, directory)]
        out[name] = {
            "in_dir": sum(inside(p, directory) for p in mine),
            "outside": len(elsewhere),
            "left_behind": [p for p in elsewhere if os.path.exists(p)],
            "files": sorted(p.name for p in directory.iterdir()),
        }
    out["weights_ckpt"]["filepath_after"] = weights.filepath
    fresh = build()
    fresh.load_weights(d / "weights" / f"w-{EPOCHS}.weights.h5")  # the chief's, on every worker
    out["weights_ckpt"]["reload_diff"] = max_abs(model.get_weights(), fresh.get_weights())
    out["keras_ckpt"]["filepath_after"] = every.filepath
    out["keras_ckpt"]["best"] = float(best.best)
    loaded = keras.models.load_model(d / "keras" / "m-2.keras")
    out["keras_ckpt"]["reload_diff"] = max_abs(model.get_weights(), loaded.get_weights())

    seen = spies[0].seen
    with open(d / "csv" / "log.csv", newline="") as f:
        rows = list(csv.DictReader(f))
    out["csv"] = {
        "written_in_dir": inside(seen, d / "csv"),
        "left_behind": [] if inside(seen, d) or not os.path.exists(seen) else [seen],
        "filename_after": logger.filename,
        "files": sorted(p.name for p in (d / "csv").iterdir()),
        "rows": [[int(r["epoch"]), float(r["loss"])] for r in rows],
        "history_loss": [float(x) for x in history.history["loss"]],
    }
    if board is None:
        out["tensorboard"] = {"skipped": "the tensorboard package is not installed"}
    else:
        seen = spies[1].seen
        out["tensorboard"] = {
            "pid": os.getpid(),
            "events": sorted(str(p.relative_to(d)) for p in (d / "tb").rglob("events.out.tfevents.*")),
            "written_in_dir": inside(seen, d / "tb"),
            "left_behind": [] if inside(seen, d) or not os.path.exists(seen) else [seen],
            "log_dir_after": board.log_dir,
        }
    return out


def case_sharded(d):
    """ModelCheckpoint of a tensor-parallel model, with EarlyStopping and
    ReduceLROnPlateau in the same fit (each worker reads its own logs)."""
    callback = keras.callbacks.ModelCheckpoint(str(d / "tp.weights.h5"), save_weights_only=True)
    # min_delta larger than any improvement: EarlyStopping stops after its
    # patience (after epoch 2 of 6), ReduceLROnPlateau halves the learning
    # rate from the second epoch on.
    stop = keras.callbacks.EarlyStopping(monitor="loss", patience=1, min_delta=10.0)
    plateau = keras.callbacks.ReduceLROnPlateau(monitor="loss", patience=0, min_delta=10.0, factor=0.5)
    lrs = []
    model = build(sharded=True)
    record = keras.callbacks.LambdaCallback(
        on_epoch_end=lambda e, logs: lrs.append(
            float(keras.ops.convert_to_numpy(model.optimizer.learning_rate))
        )
    )
    history = fit(model, [callback, plateau, stop, record], epochs=6)
    out = saves(d)
    out["files"] = sorted(p.name for p in d.iterdir())
    fresh = build(sharded=True)
    fresh.load_weights(d / "tp.weights.h5")  # the chief's full-size file, on every worker
    out["reload_diff"] = max_abs(P.full_weights(model), P.full_weights(fresh))
    logs = {
        "stopped_epoch": stop.stopped_epoch,
        "epochs_run": len(history.history["loss"]),
        "loss": [float(x) for x in history.history["loss"]],
        "lrs": lrs,
    }
    return {"sharded_ckpt": out, "logs": logs}


def case_backup(d):
    backup_dir = str(d / "backup")
    try:
        fit(build(), [InterruptAt(INTERRUPT_STEP, STEPS), keras.callbacks.BackupAndRestore(backup_dir, save_freq=4)])
    except RuntimeError as e:
        if "interrupted" not in str(e):
            raise
    after_interrupt = sorted(os.listdir(backup_dir)) if os.path.isdir(backup_dir) else None
    resumed = build()
    steps = []  # batches trained (a batch skipped after the restore logs nothing)
    counter = keras.callbacks.LambdaCallback(
        on_train_batch_end=lambda b, logs: steps.append(b) if logs else None
    )
    fit(resumed, [keras.callbacks.BackupAndRestore(backup_dir, save_freq=4), counter])
    SAVED.clear()
    reference = build()
    fit(reference, [])
    weights = [np.asarray(w, np.float64) for w in reference.get_weights()]
    diff = max_abs(weights, resumed.get_weights())
    scale = max(float(np.max(np.abs(w))) for w in weights)
    return {
        "after_interrupt": after_interrupt,
        "trained_after_restore": len(steps),
        "max_rel": diff / scale,
        "optimizer_diff": max_abs(reference.optimizer.variables, resumed.optimizer.variables),
        "backup_dir_removed": not os.path.exists(backup_dir),
    }


def case_backup_subclass(d):
    class MyBackup(keras.callbacks.BackupAndRestore):
        pass

    try:
        fit(build(), [MyBackup(str(d / "mine"))], epochs=1)
    except ValueError as e:
        return {"error": str(e)}
    return {"error": None}


CASES = {
    "files": case_files,
    "sharded": case_sharded,
    "backup": case_backup,
    "backup_subclass": case_backup_subclass,
}


def temp_dirs():
    return {p.name for p in Path(tempfile.gettempdir()).glob(f"keras_comm_worker{RANK}_*")}


def main(shared, names):
    results = {}
    before = temp_dirs()
    for name in names or CASES:
        d = Path(shared) / name
        d.mkdir(parents=True, exist_ok=True)
        SAVED.clear()
        started = time.time()
        try:
            outcome = CASES[name](d)
            results.update(outcome if name in ("files", "sharded") else {name: outcome})
        except Exception as e:  # noqa: BLE001  (the case's outcome, reported)
            results[name] = {"exception": f"{type(e).__name__}: {e}"[:600]}
        print(f"case {name}: {time.time() - started:.1f} s", flush=True)
    results["temp_dirs_left"] = sorted(temp_dirs() - before)
    write_result({"rank": RANK, "world": N, "results": results})


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2:])
