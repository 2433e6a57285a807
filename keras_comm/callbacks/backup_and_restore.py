"""`BackupAndRestore` that is correct under MultiWorkerMirroredStrategy."""

import json
import os
import shutil
import tempfile

import keras
import tensorflow as tf

from keras_comm._private import keras_api
from keras_comm.callbacks import parallel_optimizer

_METADATA = "training_metadata.json"


class BackupAndRestore(keras.callbacks.BackupAndRestore):
    """`keras.callbacks.BackupAndRestore` for several workers, resuming at the step.

    Keras 3's callback has no multi-worker handling: every worker writes the
    same files (a race that can leave a torn checkpoint), and a backup made
    with an integer `save_freq` records the batch but a restore starts the
    epoch over, so the epoch's first batches are trained twice. This
    subclass (a callback, not a patch in `keras_comm.compat`: it changes what
    the callback does, not a Keras bug under a strategy) differs in that:

    - Only the chief (`strategy.extended.should_checkpoint`) writes; every
      worker restores from the chief's files, so `backup_dir` must be on a
      filesystem all workers see (on one machine, any local directory).
    - A backup is committed atomically: the weights go to a new file
      ``ckpt-<epoch>-<step>.weights.h5`` and then `training_metadata.json`,
      which names that file, is replaced in one rename. A worker killed at
      any point leaves the previous backup usable.
    - With an integer `save_freq`, a restore resumes at the step: `fit`
      starts at the saved epoch and the first steps of that epoch are
      skipped (their batches are read and dropped, so the data order
      matches an uninterrupted run; no training, no callbacks' train
      function). The resumed epoch's logged metrics cover only the steps
      run after the restore.
    - With `keras_comm.callbacks.ParallelOptimizer`, the sharded optimizer
      state is gathered into the optimizer's own slots before each save
      (every worker takes part), and a save that falls inside a gradient
      accumulation window waits for the window's update.

    The saved state is what `model.save_weights` holds: weights and the
    optimizer's variables (iterations, slots, loss scale). Random state (e.g.
    dropout seeds) and a shuffling dataset's position are not saved: resume
    is exact for deterministic data and layers.

    Args:
        backup_dir: directory for the backup, used by nothing else.
        save_freq: `"epoch"` or an int (save every `save_freq` steps).
        double_checkpoint: keep the previous backup too, and fall back to it
            if the latest cannot be read.
        delete_checkpoint: remove `backup_dir` when `fit` completes.

    Example:

    ```python
    strategy = tf.distribute.MultiWorkerMirroredStrategy()
    with strategy.scope():
        model = build_and_compile()
    model.fit(ds, epochs=3, callbacks=[
        keras_comm.callbacks.ParallelOptimizer(zero_stage=1),
        keras_comm.callbacks.BackupAndRestore("/shared/backup", save_freq=50),
    ])
    # Killed and relaunched: fit resumes after the last multiple of 50 steps.
    ```
    """

    def __init__(
        self,
        backup_dir,
        save_freq="epoch",
        double_checkpoint=False,
        delete_checkpoint=True,
    ):
        if isinstance(save_freq, bool) or (
            isinstance(save_freq, int) and save_freq < 1
        ):
            raise ValueError(
                "`save_freq` must be 'epoch' or an int >= 1. "
                f"Received: save_freq={save_freq!r}"
            )
        super().__init__(
            backup_dir,
            save_freq=save_freq,
            double_checkpoint=double_checkpoint,
            delete_checkpoint=delete_checkpoint,
        )
        self._metadata_path = os.path.join(backup_dir, _METADATA)
        self._epoch = 0
        self._steps_done = 0  # steps of `self._epoch` completed
        self._since_save = 0
        self._skip_epoch = None
        self._skip_steps = 0
        self._model_train_function = None
        #: What the last restore found: ``{"epoch", "step"}`` or None.
        self.restored = None

    # --- restore ----------------------------------------------------------

    def _is_chief(self):
        strategy = self.model.distribute_strategy
        return bool(getattr(strategy.extended, "should_checkpoint", True))

    def _read_metadata(self):
        if not tf.io.gfile.exists(self._metadata_path):
            return None
        with tf.io.gfile.GFile(self._metadata_path, "r") as f:
            return json.loads(f.read())

    def on_train_begin(self, logs=None):
        if not self.model.built:
            raise ValueError(
                "To use the BackupAndRestore callback, the model must be built "
                f"before `fit()`. Received: model {self.model.name} unbuilt"
            )
        self.restored = None
        self._skip_epoch, self._skip_steps = None, 0
        self._since_save = 0
        metadata = self._read_metadata()
        if metadata is None:
            return
        candidates = [metadata] + ([metadata["previous"]] if metadata.get("previous") else [])
        optimizer = self.model.optimizer
        if optimizer is not None and not optimizer.built:
            with self.model.distribute_strategy.scope():
                optimizer.build(self.model.trainable_variables)
        error = None
        for entry in candidates:
            try:
                self.model.load_weights(os.path.join(self.backup_dir, entry["weights"]))
            except OSError as e:  # missing or unreadable file: try the previous one
                error = e
                continue
            keras_api.set_initial_epoch(self.model, entry["epoch"])
            if entry["step"]:
                self._skip_epoch, self._skip_steps = entry["epoch"], entry["step"]
            self.restored = {"epoch": entry["epoch"], "step": entry["step"]}
            return
        raise error

    # --- skipping the steps done before the backup ------------------------

    def on_epoch_begin(self, epoch, logs=None):
        self._epoch = epoch
        self._steps_done = 0

    def on_train_batch_begin(self, batch, logs=None):
        if self._epoch == self._skip_epoch and batch < self._skip_steps:
            self._model_train_function = self.model.train_function
            self.model.train_function = self._skip_step

    def _skip_step(self, iterator):
        # Reads (and drops) the step's batches, as the train function would.
        for _ in range(self.model.steps_per_execution):
            next(iterator)
        return {}

    def on_train_batch_end(self, batch, logs=None):
        skipped = self._model_train_function is not None
        if skipped:
            self.model.train_function = self._model_train_function
            self._model_train_function = None
        self._steps_done = batch + 1
        if skipped:
            return
        if self.save_freq == "epoch":
            return
        self._since_save += 1 if self.model.steps_per_execution == 1 else (
            self.model.steps_per_execution
        )
        if self._since_save >= self.save_freq:
            # Every worker asks (it may all-gather optimizer shards); a save
            # inside an accumulation window waits for its update.
            if parallel_optimizer.prepare_checkpoint(self.model):
                self._save(self._epoch, self._steps_done)
                self._since_save = 0

    def on_epoch_end(self, epoch, logs=None):
        self._skip_epoch = None
        if self.save_freq == "epoch":
            if parallel_optimizer.prepare_checkpoint(self.model):
                self._save(epoch + 1, 0)

    # --- save -------------------------------------------------------------

    def _save(self, epoch, step):
        steps = (self.params or {}).get("steps")
        if step and steps and step >= steps:
            epoch, step = epoch + 1, 0
        if not self._is_chief():
            # Sharded weights are gathered while saving (a collective), so
            # every worker saves; the others' files are dropped.
            tmp = tempfile.mkdtemp(prefix="keras_comm_backup_")
            try:
                self.model.save_weights(os.path.join(tmp, "ckpt.weights.h5"))
            finally:
                shutil.rmtree(tmp, ignore_errors=True)
            return
        tf.io.gfile.makedirs(self.backup_dir)
        old = self._read_metadata()
        name = f"ckpt-{epoch}-{step}.weights.h5"
        self.model.save_weights(os.path.join(self.backup_dir, name), overwrite=True)
        entry = {"epoch": epoch, "step": step, "weights": name}
        metadata = dict(entry)
        if self.double_checkpoint and old is not None:
            metadata["previous"] = {k: old[k] for k in ("epoch", "step", "weights")}
        tmp = self._metadata_path + ".tmp"
        with tf.io.gfile.GFile(tmp, "w") as f:
            f.write(json.dumps(metadata))
        tf.io.gfile.rename(tmp, self._metadata_path, overwrite=True)
        keep = {name} | ({metadata["previous"]["weights"]} if "previous" in metadata else set())
        for stale in tf.io.gfile.glob(os.path.join(self.backup_dir, "ckpt-*.weights.h5")):
            if os.path.basename(stale) not in keep:
                tf.io.gfile.remove(stale)

    def on_train_end(self, logs=None):
        if self._model_train_function is not None:
            self.model.train_function = self._model_train_function
            self._model_train_function = None
        if (
            self.delete_checkpoint
            and self._is_chief()
            and tf.io.gfile.exists(self.backup_dir)
        ):
            tf.io.gfile.rmtree(self.backup_dir)
