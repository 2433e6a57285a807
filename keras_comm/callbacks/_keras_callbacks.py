"""Keras's own file-writing callbacks, made safe under several workers.

Keras 3 dropped tf-keras's multi-worker handling: under
MultiWorkerMirroredStrategy with more than one worker, every worker's
`ModelCheckpoint`, `CSVLogger`, `TensorBoard` and `BackupAndRestore` writes
the same paths (HDF5 files fail with ``BlockingIOError: unable to lock
file``; the others race and can leave torn files). `keras_comm.compat`
installs `adapt` where `fit`, `evaluate` and `predict` build their
`keras.callbacks.CallbackList` (its constructor, through
`keras_comm._private.keras_api`), so the user's callbacks are adapted before
any of them sees the model:

- `ModelCheckpoint`, `CSVLogger`, `TensorBoard`: the chief
  (``strategy.extended.should_checkpoint``) writes the real path. Every
  other worker still runs the callback (saving a model with sharded
  `keras_comm.parallel` weights gathers them: a collective every worker must
  join) but writes into a temporary directory of its own, emptied after each
  `ModelCheckpoint` save and removed, with the callback's path restored, at
  the end of `fit` (of `evaluate` / `predict` when used there; at process
  exit if `fit` raised).
- `keras.callbacks.BackupAndRestore` (exactly that class) is replaced for
  the run by `keras_comm.callbacks.BackupAndRestore` with the same
  arguments: the chief writes, the chief chooses what to restore and every
  worker loads that backup or all raise, and an integer `save_freq` resumes
  at the step (Keras's restarts the epoch, training its first batches
  twice). Its files in `backup_dir` are keras_comm's, not Keras's
  ``latest.weights.h5``.
- A subclass of Keras's `BackupAndRestore` (other than keras_comm's) cannot
  be replaced without losing what it overrides: `fit` raises at its start,
  on every worker, naming `keras_comm.callbacks.BackupAndRestore`.

Callbacks that only read the logs (`EarlyStopping`, `ReduceLROnPlateau`,
`TerminateOnNaN`, ...) need nothing: keras_comm's step reduces the logs
exactly, so every worker sees the same values and decides the same.
One worker, or one process with several replicas, is left untouched.
"""

import atexit
import os
import shutil
import tempfile
import threading
import weakref

import keras

from keras_comm import topology
from keras_comm._private import keras_api

# Callback class -> the attribute holding the path it writes.
_PATH_ATTRIBUTES = (
    (keras.callbacks.ModelCheckpoint, "filepath"),
    (keras.callbacks.CSVLogger, "filename"),
    (keras.callbacks.TensorBoard, "log_dir"),
)

# The user's path of each callback redirected now (a `fit` that raised never
# restores it; the next adaptation must start from the user's path again).
_ORIGINAL_PATHS = weakref.WeakKeyDictionary()
# Temporary directories not removed yet: removed at exit if `fit` raised.
_LIVE_DIRS = set()
_lock = threading.Lock()


def _replacement_backup(callback):
    from keras_comm.callbacks import backup_and_restore

    if isinstance(callback, backup_and_restore.BackupAndRestore):
        return callback
    if type(callback) is not keras.callbacks.BackupAndRestore:
        raise ValueError(
            f"{type(callback).__name__} subclasses keras.callbacks.BackupAndRestore, "
            "which is not safe with several workers (every worker writes the same "
            "files, and each restores its own view of them): use "
            "keras_comm.callbacks.BackupAndRestore (same arguments; the chief writes "
            "and every worker restores the backup it chose), or subclass it instead. "
            f"Received: callbacks=[..., {callback!r}, ...] under "
            "MultiWorkerMirroredStrategy with more than one worker"
        )
    return backup_and_restore.BackupAndRestore(
        callback.backup_dir,
        save_freq=callback.save_freq,
        double_checkpoint=callback.double_checkpoint,
        delete_checkpoint=callback.delete_checkpoint,
    )


def _path_attribute(callback):
    for cls, attribute in _PATH_ATTRIBUTES:
        if isinstance(callback, cls):
            return attribute
    return None


def adapt(callbacks, model):
    """`callbacks` made safe for `model`'s strategy (see the module docstring).

    Args:
        callbacks: what `CallbackList` received (a callback, a list, a nest,
            or None).
        model: the model the list is for, or None.

    Returns:
        `callbacks` unchanged for one worker; else a new list in which
        Keras's `BackupAndRestore` is keras_comm's and, on workers other than
        the chief, every file-writing callback writes to a temporary
        directory (a callback added first and one added last redirect it
        at each start and remove it at the end).

    Raises:
        ValueError: for a subclass of Keras's `BackupAndRestore` that is not
            keras_comm's.
    """
    if model is None or not callbacks:
        return callbacks
    strategy = model.distribute_strategy
    if not topology.is_multi_worker(strategy):
        return callbacks
    # Every replacement (or refusal) before any redirect: a refusal leaves
    # no temporary directory behind.
    out = [
        _replacement_backup(c) if isinstance(c, keras.callbacks.BackupAndRestore) else c
        for c in keras.tree.flatten(callbacks)
    ]
    redirected = []
    if not topology.is_chief(strategy):
        for callback in out:
            attribute = _path_attribute(callback)
            if attribute is not None:
                redirected.append(_redirect(callback, attribute, topology.task_id(strategy)))
    if redirected:
        per_batch = any(
            r.emptied_after_save and r.callback.save_freq != "epoch" for r in redirected
        )
        files = _WorkerFiles(redirected)
        out = [_Begin(files), *out, (_EndPerBatch if per_batch else _End)(files)]
    return out


class _Redirect:
    """One callback writing into a temporary directory instead of its path."""

    def __init__(self, callback, attribute, task, original, directory):
        self.callback = callback
        self.attribute = attribute
        self.task = task
        self.original = original
        self.directory = directory
        # A checkpoint file is whole after each save and never read back:
        # drop it at once, so the directory holds at most one.
        self.emptied_after_save = isinstance(callback, keras.callbacks.ModelCheckpoint)


def _redirect(callback, attribute, task):
    original = _ORIGINAL_PATHS.get(callback, getattr(callback, attribute))
    directory = tempfile.mkdtemp(prefix=f"keras_comm_worker{task}_")
    with _lock:
        _LIVE_DIRS.add(directory)
        _ORIGINAL_PATHS[callback] = original
    if attribute == "log_dir":
        path = directory
    else:
        # The file name keeps its formatting fields ({epoch}, {loss}, ...).
        path = os.path.join(directory, os.path.basename(str(original)) or "file")
    setattr(callback, attribute, path)
    return _Redirect(callback, attribute, task, original, directory)


def _empty(directory):
    for name in os.listdir(directory) if os.path.isdir(directory) else ():
        path = os.path.join(directory, name)
        if os.path.isdir(path) and not os.path.islink(path):
            shutil.rmtree(path, ignore_errors=True)
        else:
            try:
                os.remove(path)
            except FileNotFoundError:
                pass


def _remove(redirect):
    with _lock:
        if _ORIGINAL_PATHS.get(redirect.callback) == redirect.original:
            setattr(redirect.callback, redirect.attribute, redirect.original)
            del _ORIGINAL_PATHS[redirect.callback]
        _LIVE_DIRS.discard(redirect.directory)
    shutil.rmtree(redirect.directory, ignore_errors=True)


@atexit.register
def _remove_live_dirs():
    with _lock:
        directories = list(_LIVE_DIRS)
        _LIVE_DIRS.clear()
    for directory in directories:
        shutil.rmtree(directory, ignore_errors=True)


class _WorkerFiles:
    """A non-chief worker's redirected callbacks, from `fit`'s start to its end.

    Two callbacks of the list drive it: `_Begin` first (a list you built and
    pass to several `fit` calls is redirected again before its callbacks
    open files) and `_End` last (a checkpoint is whole after its callback's
    hook, files are closed after train end).
    """

    def __init__(self, redirects):
        self.redirects = redirects
        self._specs = [(r.callback, r.attribute, r.task) for r in redirects]
        self.training = False

    def begin(self, model):
        if self.redirects:
            return
        self.redirects = [_redirect(c, a, t) for c, a, t in self._specs]
        for redirect in self.redirects:
            if isinstance(redirect.callback, keras.callbacks.TensorBoard):
                redirect.callback.set_model(model)  # it reads log_dir there

    def after_saves(self):
        for redirect in self.redirects:
            if redirect.emptied_after_save:
                _empty(redirect.directory)

    def finish(self):
        for redirect in self.redirects:
            _remove(redirect)
        self.redirects = []
        self.training = False


class _Begin(keras.callbacks.Callback):
    def __init__(self, files):
        super().__init__()
        self._files = files

    def on_train_begin(self, logs=None):
        self._files.begin(self.model)
        self._files.training = True

    def on_test_begin(self, logs=None):
        if not self._files.training:
            self._files.begin(self.model)

    def on_predict_begin(self, logs=None):
        if not self._files.training:
            self._files.begin(self.model)


class _End(keras.callbacks.Callback):
    def __init__(self, files):
        super().__init__()
        self._files = files

    def on_epoch_end(self, epoch, logs=None):
        self._files.after_saves()

    def on_train_end(self, logs=None):
        self._files.finish()

    def on_test_end(self, logs=None):
        if not self._files.training:  # `evaluate` on its own
            self._files.finish()

    def on_predict_end(self, logs=None):
        if not self._files.training:
            self._files.finish()


class _EndPerBatch(_End):
    """`_End` for a `ModelCheckpoint` that saves every N batches."""

    def on_train_batch_end(self, batch, logs=None):
        self._files.after_saves()


def _callback_list_init(original):
    def __init__(self, callbacks=None, *args, model=None, **kwargs):
        try:
            adapted = adapt(callbacks, model)
        except ValueError:
            original(self)  # an empty but whole list: Keras 3.10's __del__ reads it
            raise
        original(self, adapted, *args, model=model, **kwargs)

    __init__.__doc__ = original.__doc__
    __init__.__wrapped__ = original
    return __init__


def install():
    """Adapts every `CallbackList` built with a model from now on; idempotent."""
    keras_api.install_callback_list_init(_callback_list_init(keras_api.upstream_callback_list_init()))


def uninstall():
    """Undoes `install`; a no-op when not installed."""
    keras_api.restore_callback_list_init()
