"""Makes Keras 3 `fit`, `evaluate` and `predict` exact under MultiWorkerMirroredStrategy.

Stock Keras 3 (TensorFlow backend) cannot train under
`tf.distribute.MultiWorkerMirroredStrategy` (keras-team/keras#20585, #20329,
tensorflow/tensorflow#72388), and where it runs it is not exact:

1. `TensorFlowTrainer._maybe_symbolic_build` builds the model from a batch it
   pulls out of the distributed iterator and passes the nest of `PerReplica`
   values to `strategy.reduce`, which fails ("Attempt to convert a value
   (PerReplica...)"). Pulling a batch also consumes a step's worth of input
   when the iterator is kept across epochs.
   Replacement: build from the distributed dataset's `element_spec` (shapes and
   dtypes only: no data consumed, nothing communicated).
2. `TensorFlowTrainer._make_function` reduces step outputs with
   `reduce_per_replica`, which under MWMS uses `axis=0` and fails on scalar
   metrics ("Invalid reduction dimension 0"); a mean of per-replica metric
   results would anyway be wrong when replicas hold different numbers of
   samples (the final partial batch) or sample weights. Its
   `steps_per_execution > 1` loop fails under any multi-replica strategy.
   Replacement under MWMS: the step's metric logs are each metric's result
   over its state summed across all replicas (one packed all-reduce per step),
   exact and identical on every worker; `steps_per_execution` runs as a host
   loop of single steps. Other strategies get upstream's function.
3. `TensorFlowTrainer.train_step` averages the loss per replica and sums the
   replicas' gradients scaled by 1/num_replicas: a mean of per-replica means,
   which is the mean over the global batch only when every replica holds as
   many samples as the others. Replacement: the same step, with the loss
   scaled by `num_replicas * local_batch / global_batch` (one scalar
   all-reduce), which is exactly 1 for equal shards and makes the final
   partial batch exact too.

4. `TFOptimizer._all_reduce_sum_gradients` is wrapped so that a variable may
   carry its own gradient reduction (sharded weights of `keras_comm.parallel`
   reduce over their data-parallel group, not the world); other variables are
   reduced exactly as upstream. `mark_gradient_reduced(v)` gives `v` the
   identity reduction: for a weight whose gradient a comm layer (e.g.
   `MirrorOperator`) already summed, so that no gradient is reduced twice.
   A sparse (`tf.IndexedSlices`) gradient then has its duplicate rows summed
   before the update: upstream applies them one by one, which makes Adam's
   second moment of a token seen twice in a batch ``g1**2 + g2**2`` instead
   of ``(g1 + g2)**2`` (`training.reduction.sum_duplicate_rows`).

5. `keras.callbacks.CallbackList.__init__` is wrapped so that, under
   MultiWorkerMirroredStrategy with more than one worker, Keras's
   `ModelCheckpoint`, `CSVLogger` and `TensorBoard` write their paths from
   the chief only (the other workers into temporary directories they drop)
   and Keras's `BackupAndRestore` runs as `keras_comm.callbacks.BackupAndRestore`
   (`keras_comm.callbacks._keras_callbacks`). Stock Keras lets every worker
   write the same files (`BlockingIOError: unable to lock file` for HDF5).

6. `TFEpochIterator._enumerate_iterator` is replaced so that, under
   MultiWorkerMirroredStrategy, an epoch creates only the tf.data iterator it
   uses: upstream also creates one as each epoch ends that the next epoch
   discards (`training.step.one_iterator_per_epoch`).

This module only installs the fix: the step itself is owned by
`keras_comm.training` (1 and 2: `training.step`; 3: `training.replicated`;
4: `training.reduction`), whose docstrings describe each replacement.
`train_step_gradients(model, data)` is the default step's per-replica
gradients and logs without the update.

`predict` keeps Keras's semantics: under MultiWorkerMirroredStrategy every
worker passes the same (global) input, the input is sharded across workers,
and `predict` all-gathers the outputs in input order, so each worker returns
the full predictions for the whole input, identical on all workers. Its step
is made by `training.step.make_predict_function` (replacing
`TensorFlowTrainer.make_predict_function`), so it runs under the watchdog and
translates collective errors like `fit`'s and `evaluate`'s.

Scope and limits:

- Applied on `import keras_comm`; `apply()` is idempotent and `revert()` restores
  stock Keras. Only Keras `>=3.10,<3.17` with the TensorFlow backend is patched:
  elsewhere `apply()` changes nothing and returns False, because the replaced
  code is private Keras code that may differ. Every private Keras name is
  reached through `keras_comm._private.keras_api`, and
  `tests/compat/test_private_api.py` records a hash of each replaced or relied-on
  function per Keras version and fails when it changes.
- The exact-loss scaling lives in the default `train_step`; a model that
  overrides `train_step` keeps its own loss scaling. The loss normalisation
  made exact is Keras's default `"sum_over_batch_size"` (mean over samples);
  `"mean_with_sample_weight"` losses are combined by sample counts.
- Only `MultiWorkerMirroredStrategy` (also its in-process form with several
  local devices) is changed; other strategies run stock Keras code paths.
- Per-output loss metrics of multi-output models ("<output>_loss") are
  averaged by Keras per step, not per sample (their update uses the static
  batch size, unknown when traced), single-process too; under MWMS they are
  averaged per replica-step, so they can differ on a partial final batch.
- `run_eagerly=True` is not covered: an empty shard keeps its static size 0
  there.
- NumPy inputs are shuffled by Keras on each worker; unless every worker sets
  the same seed (`keras.utils.set_random_seed`) or passes `shuffle=False`, the
  workers' permutations differ and a global batch is not a slice of one
  permutation.
"""

import keras

from keras_comm._private import keras_api
from keras_comm.training import reduction
from keras_comm.training import replicated
from keras_comm.training import step

__all__ = [
    "apply",
    "gradient_hook",
    "is_applied",
    "mark_gradient_reduced",
    "revert",
    "train_step_gradients",
    "SUPPORTED_KERAS",
]

#: Keras versions whose trainer code this module was written against
#: (lower bound inclusive, upper bound exclusive), as (major, minor).
SUPPORTED_KERAS = ((3, 10), (3, 17))

# Kept importable under their old names.
mark_gradient_reduced = reduction.mark_gradient_reduced
gradient_hook = reduction.gradient_hook
train_step_gradients = replicated.train_step_gradients
_maybe_symbolic_build = step.symbolic_build
_make_function = step.make_function
_train_step = replicated.train_step
_all_reduce_sum_gradients = reduction.all_reduce_sum_gradients
_METHODS = keras_api.TRAINER_METHODS
_ORIGINALS_ATTR = keras_api._ORIGINALS_ATTR
_OPTIMIZER_ORIGINAL_ATTR = keras_api._OPTIMIZER_ORIGINAL_ATTR


def _keras_version():
    parts = keras.version().split(".")
    return int(parts[0]), int("".join(c for c in parts[1] if c.isdigit()) or 0)


def _supported():
    low, high = SUPPORTED_KERAS
    return (
        keras.backend.backend() == "tensorflow"
        and low <= _keras_version() < high
    )


def unsupported_message():
    """Why `apply()` changes nothing here: the installed Keras and backend."""
    (lo_major, lo_minor), (hi_major, hi_minor) = SUPPORTED_KERAS
    return (
        "keras_comm: the Keras x MultiWorkerMirroredStrategy fix (keras_comm.compat) "
        f"supports Keras >={lo_major}.{lo_minor},<{hi_major}.{hi_minor} with the "
        f"TensorFlow backend; found Keras {keras.version()} with the "
        f"{keras.backend.backend()!r} backend, so it is NOT applied. keras_comm "
        "layers still work, but `model.fit`/`evaluate` under "
        "MultiWorkerMirroredStrategy run stock Keras, which fails or is not exact "
        "there. Install a supported Keras (and KERAS_BACKEND=tensorflow)."
    )


def is_applied():
    """Returns whether the Keras trainer currently carries this module's fix."""
    return _supported() and keras_api.trainer_patched()


def apply():
    """Installs keras_comm's step owner into the Keras TensorFlow trainer.

    Safe to call any number of times: a second call finds the patch in place
    and does nothing.

    Returns:
        True if the fix is in place after the call; False if the installed
        Keras version or backend is outside `SUPPORTED_KERAS` / TensorFlow,
        in which case nothing was changed.
    """
    if not _supported():
        return False
    if keras_api.trainer_patched():
        return True
    keras_api.install_trainer_methods({
        "_maybe_symbolic_build": step.symbolic_build,
        "_make_function": step.make_function,
        "train_step": replicated.train_step,
        "make_predict_function": step.make_predict_function,
    })
    keras_api.install_gradient_reduction(reduction.all_reduce_sum_gradients)
    # fit/evaluate: finished epochs' iterators released off the host, joined
    # before the call returns (training.step.releasing_iterators).
    keras_api.install_trainer_wrappers(step.releasing_iterators)
    # Under MWMS one tf.data iterator per epoch, not two.
    keras_api.install_epoch_iterator(step.one_iterator_per_epoch)
    # Sharded optimizer slots saved full-size: keras_comm.parallel._checkpoint.
    from keras_comm.parallel import _checkpoint

    _checkpoint.apply()
    # Keras's file-writing callbacks: chief writes, the others to temp.
    from keras_comm.callbacks import _keras_callbacks

    _keras_callbacks.install()
    # keras.distribution layouts honoured at variable creation.
    from keras_comm import distribution

    distribution.install()
    return True


def revert():
    """Restores stock Keras; a no-op when the fix is not applied.

    Functions already traced by a model keep the code they were traced with:
    revert before building step functions (e.g. before the first `fit`).
    """
    if not _supported() or not keras_api.trainer_patched():
        return
    keras_api.restore_trainer_methods()
    keras_api.restore_gradient_reduction()
    keras_api.restore_trainer_wrappers()
    keras_api.restore_epoch_iterator()
    from keras_comm.parallel import _checkpoint

    _checkpoint.revert()
    from keras_comm.callbacks import _keras_callbacks

    _keras_callbacks.uninstall()
    from keras_comm import distribution

    distribution.uninstall()
