"""`BackupAndRestore` that is correct under MultiWorkerMirroredStrategy."""

import json
import os
import re
import shutil
import tempfile
import warnings

import keras
import tensorflow as tf

from keras_comm import topology
from keras_comm._private import keras_api
from keras_comm.callbacks import _agreement
from keras_comm.callbacks import _durable
from keras_comm.callbacks import _preemption
from keras_comm.callbacks import parallel_optimizer

_METADATA = "training_metadata.json"
_RECORD = re.compile(r"^ckpt-(\d+)-(\d+)\.json$")
_WEIGHTS = re.compile(r"^(?:tmp-)?ckpt-(\d+)-(\d+)\.weights\.h5$")


def _weights_name(epoch, step):
    return f"ckpt-{epoch}-{step}.weights.h5"


def _record_name(epoch, step):
    return f"ckpt-{epoch}-{step}.json"


class BackupAndRestore(keras.callbacks.BackupAndRestore):
    """`keras.callbacks.BackupAndRestore` for several workers, resuming at the step.

    Keras 3's callback has no multi-worker handling: every worker writes the
    same files (a race that can leave a torn checkpoint), and a backup made
    with an integer `save_freq` records the batch but a restore starts the
    epoch over, so the epoch's first batches are trained twice. This
    subclass (a callback, not a patch in `keras_comm.compat`: it changes what
    the callback does, not a Keras bug under a strategy) differs in that:

    - Only the chief (`strategy.extended.should_checkpoint`) writes to
      `backup_dir` (every worker saves, since sharded weights are gathered
      while saving; the others write to a temporary file and drop it).
      Files hold full-size weights (`keras_comm.parallel` layers' shards and
      their optimizer slots gathered), so a backup also resumes on another
      number of workers whose group sizes divide the split dimensions.
    - The chief decides what to restore and broadcasts it; every worker
      loads that backup from its own view of `backup_dir`, and if any
      cannot (a directory that is not really shared, a differing copy) all
      raise together, naming the workers and why. `backup_dir` must be on a
      filesystem all workers see (on one machine, any local directory).
    - A backup survives a crash: the weights go to a new file
      ``ckpt-<epoch>-<step>.weights.h5`` (written under a temporary name,
      fsynced, renamed, directory fsynced), then its own record
      ``ckpt-<epoch>-<step>.json`` with the file's size and checksum
      commits it. A restore takes the newest backup whose weights match
      their record; a torn or missing latest backup falls back to the
      previous one (kept with `double_checkpoint`) with a warning, and an
      unreadable `training_metadata.json` (a pointer to the latest backup,
      for people and older readers) is ignored.
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

    - With `save_before_preemption=True` (tf-keras's argument, there built
      on TensorFlow's `PreemptionCheckpointHandler`), a SIGTERM to any
      worker during `fit` (a scheduler's preemption notice, `keras-comm-run`
      stopping the job) makes every worker save a backup at one agreed step
      and then stop with exit status 143; a restart resumes at that step.
      The step is agreed through TensorFlow's coordination service only
      once a notice arrives (`keras_comm.callbacks._preemption`): no
      per-step collective or host sync. The backup is at most two steps
      after the signal (one when it arrives between steps); a second
      SIGTERM stops the worker at once, without a backup, as without the
      option. `fit` must run in the main thread.

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
        save_before_preemption: on SIGTERM, every worker saves a backup at
            one agreed step and stops (exit status 143).
        save_freq may be False with `save_before_preemption=True`: backups
            only before a preemption.

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
        save_before_preemption=False,
    ):
        if not isinstance(save_before_preemption, bool):
            raise TypeError(
                "`save_before_preemption` must be True or False. "
                f"Received: save_before_preemption={save_before_preemption!r}"
            )
        if save_freq is False and not save_before_preemption:
            raise ValueError(
                "`save_freq=False` (no periodic backups) needs "
                "`save_before_preemption=True`, or nothing would ever be saved. "
                f"Received: save_freq={save_freq!r}"
            )
        if save_freq is not False and (isinstance(save_freq, bool) or (
            isinstance(save_freq, int) and save_freq < 1
        )):
            raise ValueError(
                "`save_freq` must be 'epoch', an int >= 1, or False (with "
                f"`save_before_preemption=True`). Received: save_freq={save_freq!r}"
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
        self.save_before_preemption = save_before_preemption
        self._preemption = None
        self._steps_run = 0  # train-function calls of this fit, skipped ones too
        #: What the last restore found: ``{"epoch", "step"}`` or None.
        self.restored = None

    # --- restore ----------------------------------------------------------

    def _is_chief(self):
        return topology.is_chief(self.model.distribute_strategy)

    def _path(self, name):
        return os.path.join(self.backup_dir, name)

    def _candidates(self):
        """This worker's committed backups, newest first (see `_commit`).

        A record that cannot be parsed is skipped with a warning; a backup
        directory written before records existed is read from its metadata
        file (no checksum then).
        """
        names = _durable.listdir(self.backup_dir)
        found = []
        for name in names:
            match = _RECORD.match(name)
            if match is None:
                continue
            try:
                with tf.io.gfile.GFile(self._path(name), "r") as f:
                    entry = json.loads(f.read())
                entry = {k: entry[k] for k in ("epoch", "step", "weights", "size", "crc32")}
            except (ValueError, KeyError, TypeError, OSError, tf.errors.OpError) as e:
                warnings.warn(
                    f"BackupAndRestore: skipping the backup record {self._path(name)!r}, "
                    f"which cannot be read ({type(e).__name__}: {e}); falling back to "
                    "an earlier backup.",
                    stacklevel=3,
                )
                continue
            found.append(entry)
        if not found and _METADATA in names:
            found = self._legacy_candidates()
        return sorted(found, key=lambda e: (e["epoch"], e["step"]), reverse=True)

    def _legacy_candidates(self):
        try:
            with tf.io.gfile.GFile(self._metadata_path, "r") as f:
                metadata = json.loads(f.read())
            entries = [metadata] + ([metadata["previous"]] if metadata.get("previous") else [])
            return [
                {"epoch": e["epoch"], "step": e["step"], "weights": e["weights"],
                 "size": None, "crc32": None}
                for e in entries
            ]
        except (ValueError, KeyError, TypeError, OSError, tf.errors.OpError) as e:
            warnings.warn(
                f"BackupAndRestore: ignoring {self._metadata_path!r}, which cannot "
                f"be read ({type(e).__name__}: {e}).",
                stacklevel=3,
            )
            return []

    def _check(self, entry):
        """None if `entry`'s weights file is intact, else ``(reason, why)``."""
        path = self._path(entry["weights"])
        if not tf.io.gfile.exists(path):
            return _agreement.MISSING, f"{path!r} is missing"
        if entry["size"] is None:
            return None
        try:
            size, crc = _durable.checksum(path)
        except (OSError, tf.errors.OpError) as e:
            return _agreement.MISSING, f"{path!r} cannot be read ({type(e).__name__}: {e})"
        if (size, crc) != (entry["size"], entry["crc32"]):
            return _agreement.MISMATCH, (
                f"{path!r} is not the file that was saved ({size} bytes, crc32 "
                f"{crc}; saved: {entry['size']} bytes, crc32 {entry['crc32']})"
            )
        return None

    def _choose(self):
        """The chief's choice: the newest intact backup, or why none."""
        candidates = self._candidates()
        problems = []
        for entry in candidates:
            problem = self._check(entry)
            if problem is None:
                if problems:
                    warnings.warn(
                        "BackupAndRestore: the latest backup cannot be used ("
                        + "; ".join(problems)
                        + f"); falling back to the backup of epoch {entry['epoch']}, "
                        f"step {entry['step']}.",
                        stacklevel=3,
                    )
                return entry, None
            problems.append(problem[1])
        if problems:
            return None, (
                f"BackupAndRestore: no usable backup in {self.backup_dir!r}: "
                + "; ".join(problems)
                + ". Remove the directory to start over, or restore its files."
            )
        return None, None

    def _load(self, entry):
        """Loads `entry` (chosen by the chief) here; None or why it failed."""
        if entry["size"] is not None:
            problem = self._check(entry)
            if problem is not None:
                return problem
        try:
            self.model.load_weights(self._path(entry["weights"]))
        except (OSError, ValueError) as e:
            return _agreement.LOAD_FAILED, (
                f"loading {self._path(entry['weights'])!r} failed: {type(e).__name__}: {e}"
            )
        return None

    def on_train_begin(self, logs=None):
        self._restore()
        self._steps_run = 0
        if self.save_before_preemption:
            self._preemption = _preemption.Watch(
                self.model.distribute_strategy,
                fit_code=getattr(type(self.model).fit, "__code__", None),
            )
            self._preemption.start()

    def _restore(self):
        if not self.model.built:
            raise ValueError(
                "To use the BackupAndRestore callback, the model must be built "
                f"before `fit()`. Received: model {self.model.name} unbuilt"
            )
        self.restored = None
        self._skip_epoch, self._skip_steps = None, 0
        self._since_save = 0
        strategy = self.model.distribute_strategy
        optimizer = self.model.optimizer
        if optimizer is not None and not optimizer.built:
            with strategy.scope():
                optimizer.build(self.model.trainable_variables)
        # The chief decides; every worker loads that backup or all fail
        # together (each worker may see its own `backup_dir`).
        entry, problem = self._choose() if self._is_chief() else (None, None)
        chosen = _agreement.broadcast_choice(strategy, entry, problem is not None)
        if chosen == _agreement.UNUSABLE:
            raise ValueError(
                problem or "BackupAndRestore: the chief found no usable backup in "
                f"{self.backup_dir!r} (see its error); no worker restored."
            )
        if chosen is None:
            return
        entry = self._resolve(chosen, entry)
        failure = self._load(entry)
        failures = _agreement.gather_failures(strategy, failure)
        if failures:
            raise ValueError(
                "BackupAndRestore: the workers cannot all restore the backup the "
                f"chief chose (epoch {entry['epoch']}, step {entry['step']}, "
                f"{entry['weights']!r}): "
                + "; ".join(f"replica {r}: {why}" for r, why in failures)
                + ". `backup_dir` must be one directory that every worker sees "
                "(a shared filesystem)."
            )
        keras_api.set_initial_epoch(self.model, entry["epoch"])
        if entry["step"]:
            self._skip_epoch, self._skip_steps = entry["epoch"], entry["step"]
        self.restored = {"epoch": entry["epoch"], "step": entry["step"]}

    def _resolve(self, chosen, entry):
        if entry is not None:
            return entry
        epoch, step, size, crc = chosen
        return {
            "epoch": epoch,
            "step": step,
            "weights": _weights_name(epoch, step),
            "size": None if size < 0 else size,
            "crc32": None if size < 0 else crc,
        }

    # --- skipping the steps done before the backup ------------------------

    def on_epoch_begin(self, epoch, logs=None):
        self._epoch = epoch
        self._steps_done = 0

    def on_train_batch_begin(self, batch, logs=None):
        if self._preemption is not None:
            # A boundary: `_steps_run` steps done, the next not begun.
            self._preemption.before_step(self._steps_run)
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
        self._steps_run += 1
        if (
            self._preemption is not None
            and self._preemption.due(self._steps_run)
            # A skipped step's state is the restored one, and a save inside
            # an accumulation window waits for the update: the save moves to
            # a later step, the same on every worker.
            and not skipped
            and parallel_optimizer.prepare_checkpoint(self.model)
        ):
            self._save_before_preemption()
        if skipped:
            return
        if self.save_freq == "epoch" or self.save_freq is False:
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

    def _save_before_preemption(self):
        """Every worker saves at the agreed step, checks with the others, and stops."""
        epoch, step = self._resume_point(self._epoch, self._steps_done)
        watch = self._preemption
        failure = None
        try:
            self._save(epoch, step)
        except Exception as e:  # pylint: disable=broad-except
            failure = (_agreement.SAVE_FAILED, f"saving failed: {type(e).__name__}: {e}")
        try:
            # Also a barrier: no worker stops before the chief's file is
            # committed (a stop reaching the chief mid-write would tear it).
            failures = _agreement.gather_failures(self.model.distribute_strategy, failure)
        except tf.errors.OpError as e:
            watch.fail(
                "the preemption backup could not be confirmed by every worker "
                f"({type(e).__name__}: {e.message.splitlines()[0] if e.message else e})"
            )
        if failures:
            watch.fail(
                f"the preemption backup of epoch {epoch}, step {step} failed: "
                + "; ".join(f"replica {r}: {why}" for r, why in failures)
            )
        watch.stop(
            f"preemption notice (SIGTERM to worker {watch.leader}): every worker saved the backup of "
            f"epoch {epoch}, step {step} in {self.backup_dir!r} (agreed at step "
            f"{watch.target} of this fit); stopping with exit status "
            f"{_preemption.EXIT_STATUS}. Run the job again to resume there."
        )

    def _resume_point(self, epoch, step):
        """(epoch, step) where a resume starts after `step` steps of `epoch`:
        the next epoch's start once the epoch is complete."""
        steps = (self.params or {}).get("steps")
        if step and steps and step >= steps:
            return epoch + 1, 0
        return epoch, step

    def _save(self, epoch, step):
        epoch, step = self._resume_point(epoch, step)
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
        self._commit(epoch, step)

    def _commit(self, epoch, step):
        """Writes a backup; a crash at any point leaves the earlier ones usable.

        Order: the weights (to a temporary name, synced, renamed), then the
        backup's own record ``ckpt-<epoch>-<step>.json`` (size and checksum of
        the weights; written atomically: its presence commits the backup),
        then `training_metadata.json` (the latest backup, for people and
        older readers), then the stale backups are removed. Each backup has
        its own record, so a lost or torn file costs one backup, not the
        history.
        """
        name = _weights_name(epoch, step)
        record = self._path(_record_name(epoch, step))
        _durable.remove(record)  # an older backup of the same step, if any
        tmp = self._path(f"tmp-{name}")
        self.model.save_weights(tmp, overwrite=True)
        _durable.replace(tmp, self._path(name))
        size, crc = _durable.checksum(self._path(name))
        entry = {"epoch": epoch, "step": step, "weights": name, "size": size, "crc32": crc}
        _durable.write_atomic(record, json.dumps(entry))
        _durable.write_atomic(self._metadata_path, json.dumps(entry))
        keep = {(epoch, step)}
        if self.double_checkpoint:
            older = [
                (e["epoch"], e["step"]) for e in self._candidates()
                if (e["epoch"], e["step"]) < (epoch, step)
            ]
            keep |= set(older[:1])
        for other in _durable.listdir(self.backup_dir):
            match = _RECORD.match(other)
            if match is not None and (int(match[1]), int(match[2])) not in keep:
                # The record first: a backup is never listed without its weights.
                _durable.remove(self._path(other))
        for other in _durable.listdir(self.backup_dir):
            match = _WEIGHTS.match(other)
            if match is not None and (int(match[1]), int(match[2])) not in keep:
                _durable.remove(self._path(other))

    def on_train_end(self, logs=None):
        if self._model_train_function is not None:
            self.model.train_function = self._model_train_function
            self._model_train_function = None
        watch, self._preemption = self._preemption, None
        if watch is not None:
            watch.close()
        if (
            self.delete_checkpoint
            and self._is_chief()
            and tf.io.gfile.exists(self.backup_dir)
        ):
            tf.io.gfile.rmtree(self.backup_dir)
        if watch is not None and watch.noticed.is_set():
            # The SIGTERM came too late for a backup: training is complete.
            watch.stop(
                "SIGTERM arrived as `fit` was ending: training completed, no "
                "preemption backup needed; stopping with exit status "
                f"{_preemption.EXIT_STATUS}."
            )
