"""Keras's own file-writing callbacks under several workers.

In process: `keras_comm.callbacks._keras_callbacks.adapt` with the worker's
role forced (chief or not) on a one-process fit, so what each role writes,
where, and what is left afterwards is checked without a cluster. Across two
real workers: every case of tests/callbacks/keras_callbacks_worker.py in one
launch (ModelCheckpoint weights / .keras / sharded, CSVLogger, TensorBoard,
Keras's BackupAndRestore resumed vs uninterrupted, a subclass of it, and the
log-reading EarlyStopping / ReduceLROnPlateau). TensorBoard is checked only
where the tensorboard package is installed (Keras's callback needs it).
"""

import os
import re

import keras
import numpy as np
import pytest

import keras_comm
from keras_comm import topology
from keras_comm.callbacks import _keras_callbacks

from _cluster import run_cluster


def _model():
    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(2)])
    model.compile(optimizer=keras.optimizers.SGD(0.1), loss="mse")
    return model


def _data():
    rng = np.random.default_rng(0)
    return rng.normal(size=(8, 3)).astype("float32"), rng.normal(size=(8, 2)).astype("float32")


@pytest.fixture
def role(monkeypatch):
    """Makes this process one worker of a two-worker job: ``role(chief=...)``."""

    def set_role(chief):
        monkeypatch.setattr(topology, "is_multi_worker", lambda strategy=None: True)
        monkeypatch.setattr(topology, "is_chief", lambda strategy=None: chief)
        monkeypatch.setattr(topology, "task_id", lambda strategy=None: 0 if chief else 1)

    return set_role


def _live_temp_dirs():
    return set(_keras_callbacks._LIVE_DIRS)


def test_installed_by_compat():
    from keras_comm._private import keras_api

    assert keras_api.callback_list_init_installed()
    keras_comm.compat.revert()
    try:
        assert not keras_api.callback_list_init_installed()
        assert keras.callbacks.CallbackList.__init__ is keras_api.upstream_callback_list_init()
    finally:
        keras_comm.compat.apply()
    assert keras_api.callback_list_init_installed()


def test_one_worker_is_left_alone(tmp_path):
    callbacks = [keras.callbacks.CSVLogger(str(tmp_path / "log.csv")),
                 keras.callbacks.BackupAndRestore(str(tmp_path / "b"))]
    assert _keras_callbacks.adapt(callbacks, _model()) is callbacks


def test_chief_writes_its_paths(tmp_path, role):
    role(chief=True)
    x, y = _data()
    checkpoint = keras.callbacks.ModelCheckpoint(str(tmp_path / "w-{epoch}.weights.h5"), save_weights_only=True)
    logger = keras.callbacks.CSVLogger(str(tmp_path / "log.csv"))
    _model().fit(x, y, epochs=2, batch_size=4, verbose=0, callbacks=[checkpoint, logger])
    assert sorted(os.listdir(tmp_path)) == ["log.csv", "w-1.weights.h5", "w-2.weights.h5"]
    assert len((tmp_path / "log.csv").read_text().splitlines()) == 3


def test_other_workers_write_to_temp_and_drop_it(tmp_path, role):
    role(chief=False)
    x, y = _data()
    checkpoint = keras.callbacks.ModelCheckpoint(str(tmp_path / "w-{epoch}-{batch}.weights.h5"),
                                                 save_weights_only=True, save_freq=1)
    keras_file = keras.callbacks.ModelCheckpoint(str(tmp_path / "m.keras"))
    logger = keras.callbacks.CSVLogger(str(tmp_path / "log.csv"))
    paths = {checkpoint: checkpoint.filepath, keras_file: keras_file.filepath, logger: logger.filename}
    checkpoint_dirs, csv_files = [], []

    class Watch(keras.callbacks.Callback):
        # Before each batch: the previous batch's checkpoint is already dropped.
        def on_train_batch_begin(self, batch, logs=None):
            directory = os.path.dirname(checkpoint.filepath)
            checkpoint_dirs.append((directory, sorted(os.listdir(directory))))

        def on_epoch_end(self, epoch, logs=None):
            csv_files.append((logger.filename, os.path.exists(logger.filename)))

    before = _live_temp_dirs()
    _model().fit(x, y, epochs=2, batch_size=4, verbose=0,
                 callbacks=[checkpoint, keras_file, logger, Watch()])
    assert os.listdir(tmp_path) == []  # nothing in the real paths
    directories = {d for d, _ in checkpoint_dirs}
    assert len(directories) == 1 and not next(iter(directories)).startswith(str(tmp_path))
    assert all(files == [] for _, files in checkpoint_dirs), checkpoint_dirs
    assert len(csv_files) == 2 and all(e and not n.startswith(str(tmp_path)) for n, e in csv_files)
    assert not os.path.exists(csv_files[0][0])
    for callback, path in paths.items():  # the user's paths back
        assert getattr(callback, "filepath", getattr(callback, "filename", None)) == path
    assert not any(os.path.exists(d) for d in directories)
    assert _live_temp_dirs() == before


def test_tensorboard_of_other_workers_writes_to_temp(tmp_path, role):
    role(chief=False)
    board = keras.callbacks.TensorBoard(str(tmp_path / "tb"))
    model = _model()
    callbacks = keras.callbacks.CallbackList([board], model=model)
    assert board.log_dir != str(tmp_path / "tb")
    assert os.path.isdir(board.log_dir)
    assert os.path.basename(board.log_dir).startswith("keras_comm_worker1_")
    temp = board.log_dir
    callbacks.callbacks[-1].on_train_end()  # the list's last: drops the directory
    assert not os.path.exists(temp) and board.log_dir == str(tmp_path / "tb")


def test_a_fit_that_raises_still_restores_paths_next_time(tmp_path, role):
    role(chief=False)
    x, y = _data()
    logger = keras.callbacks.CSVLogger(str(tmp_path / "log.csv"))

    class Fail(keras.callbacks.Callback):
        def on_epoch_end(self, epoch, logs=None):
            raise RuntimeError("boom")

    with pytest.raises(RuntimeError, match="boom"):
        _model().fit(x, y, epochs=1, verbose=0, callbacks=[logger, Fail()])
    stale = logger.filename
    assert stale != str(tmp_path / "log.csv") and os.path.dirname(stale) in _live_temp_dirs()
    _model().fit(x, y, epochs=1, verbose=0, callbacks=[logger])
    assert logger.filename == str(tmp_path / "log.csv")
    _keras_callbacks._remove_live_dirs()  # what exit does
    assert not os.path.exists(os.path.dirname(stale))


def test_a_callback_list_reused_by_two_fits_is_redirected_each_time(tmp_path, role):
    role(chief=False)
    x, y = _data()
    model = _model()
    logger = keras.callbacks.CSVLogger(str(tmp_path / "log.csv"))
    seen = []
    watch = keras.callbacks.LambdaCallback(on_epoch_end=lambda e, logs: seen.append(logger.filename))
    callbacks = keras.callbacks.CallbackList([logger, watch], add_history=True, model=model)
    for _ in range(2):
        model.fit(x, y, epochs=1, verbose=0, callbacks=callbacks)
        assert logger.filename == str(tmp_path / "log.csv")
    assert len(seen) == 2 and seen[0] != seen[1]
    assert not any(p.startswith(str(tmp_path)) or os.path.exists(p) for p in seen), seen
    assert os.listdir(tmp_path) == []


def test_evaluate_alone_drops_its_files(tmp_path, role):
    role(chief=False)
    x, y = _data()
    model = _model()
    before = _live_temp_dirs()
    callbacks = keras.callbacks.CallbackList([keras.callbacks.CSVLogger(str(tmp_path / "e.csv"))],
                                             model=model)
    assert len(_live_temp_dirs() - before) == 1
    model.evaluate(x, y, verbose=0, callbacks=callbacks)
    assert _live_temp_dirs() == before


@pytest.mark.parametrize("chief", [True, False])
def test_keras_backup_and_restore_becomes_keras_comms(tmp_path, role, chief):
    role(chief=chief)
    original = keras.callbacks.BackupAndRestore(str(tmp_path / "b"), save_freq=3,
                                                double_checkpoint=True, delete_checkpoint=False)
    other = keras.callbacks.EarlyStopping()
    out = _keras_callbacks.adapt([other, original], _model())
    assert out[0] is other
    replaced = out[1]
    assert type(replaced) is keras_comm.callbacks.BackupAndRestore
    assert (replaced.backup_dir, replaced.save_freq, replaced.double_checkpoint,
            replaced.delete_checkpoint) == (str(tmp_path / "b"), 3, True, False)
    mine = keras_comm.callbacks.BackupAndRestore(str(tmp_path / "c"))
    assert _keras_callbacks.adapt([mine], _model())[0] is mine


def test_subclass_of_keras_backup_and_restore_is_refused(tmp_path, role):
    role(chief=True)

    class MyBackup(keras.callbacks.BackupAndRestore):
        pass

    x, y = _data()
    with pytest.raises(ValueError, match=re.escape("use keras_comm.callbacks.BackupAndRestore")) as e:
        _model().fit(x, y, verbose=0, callbacks=[MyBackup(str(tmp_path / "b"))])
    assert "Received: callbacks=" in str(e.value)
    assert not (tmp_path / "b").exists()


# --- two real workers ---------------------------------------------------------


@pytest.mark.multiprocess
def test_keras_callbacks_on_two_workers(tmp_path):
    result = run_cluster("callbacks/keras_callbacks_worker.py", 2, tmp_path, timeout=400).check()
    print("\n".join(line for line in result.output.splitlines() if "] case " in line))
    chief, other = (r["results"] for r in result.results)
    for r in (chief, other):
        problems = {k: v for k, v in r.items() if isinstance(v, dict) and "exception" in v}
        assert not problems, problems
        assert r["temp_dirs_left"] == []

    # ModelCheckpoint: the chief saves into the directory, the other worker
    # saves as often (a sharded model needs it) elsewhere, and drops it.
    for case, saves in (("weights_ckpt", 2), ("keras_ckpt", None), ("sharded_ckpt", 2)):
        c, o = chief[case], other[case]
        assert c["outside"] == 0 and c["in_dir"] >= 1, (case, c)
        assert o["in_dir"] == 0 and o["outside"] == c["in_dir"], (case, o)
        assert saves is None or c["in_dir"] == saves, (case, c)
        assert o["left_behind"] == [], (case, o)
    assert chief["weights_ckpt"]["files"] == ["w-1.weights.h5", "w-2.weights.h5"]
    assert chief["weights_ckpt"]["reload_diff"] == 0.0
    assert other["weights_ckpt"]["reload_diff"] == 0.0
    assert other["weights_ckpt"]["filepath_after"] == chief["weights_ckpt"]["filepath_after"]
    assert other["keras_ckpt"]["filepath_after"] == chief["keras_ckpt"]["filepath_after"]
    assert chief["keras_ckpt"]["files"] == ["best.keras", "m-1.keras", "m-2.keras"]
    assert chief["keras_ckpt"]["best"] == other["keras_ckpt"]["best"]
    assert chief["keras_ckpt"]["reload_diff"] == other["keras_ckpt"]["reload_diff"] == 0.0
    # Every worker loads the chief's full-size file of a tensor-parallel model exactly.
    assert chief["sharded_ckpt"]["files"] == ["tp.weights.h5"]
    assert chief["sharded_ckpt"]["reload_diff"] == other["sharded_ckpt"]["reload_diff"] == 0.0

    # CSVLogger: the chief's file alone, one row per epoch, the logged values.
    assert chief["csv"]["written_in_dir"] and not other["csv"]["written_in_dir"]
    assert other["csv"]["left_behind"] == []
    assert chief["csv"]["files"] == ["log.csv"]
    assert [row[1] for row in chief["csv"]["rows"]] == chief["csv"]["history_loss"]
    assert [row[0] for row in chief["csv"]["rows"]] == [0, 1]
    assert other["csv"]["filename_after"] == chief["csv"]["filename_after"]

    # TensorBoard (when the tensorboard package is installed): only the
    # chief's process wrote event files into log_dir.
    if "skipped" not in chief["tensorboard"]:
        assert chief["tensorboard"]["written_in_dir"] and not other["tensorboard"]["written_in_dir"]
        assert other["tensorboard"]["left_behind"] == []
        events = chief["tensorboard"]["events"]
        assert events and all(f".{chief['tensorboard']['pid']}." in e for e in events), events
        assert other["tensorboard"]["log_dir_after"] == chief["tensorboard"]["log_dir_after"]

    # Keras's BackupAndRestore: exact resume at the step, every worker.
    for r in (chief, other):
        b = r["backup"]
        assert b["max_rel"] == 0.0 and b["optimizer_diff"] == 0.0, b
        assert b["trained_after_restore"] == 2 * 6 - 8, b  # backup after global step 8
        assert b["backup_dir_removed"], b
    assert chief["backup"]["after_interrupt"] == other["backup"]["after_interrupt"]

    for r in (chief, other):
        assert "keras_comm.callbacks.BackupAndRestore" in r["backup_subclass"]["error"]

    # EarlyStopping / ReduceLROnPlateau read identical (exactly reduced) logs.
    assert chief["logs"] == other["logs"]
    assert chief["logs"]["stopped_epoch"] > 0 and chief["logs"]["epochs_run"] < 6
    assert chief["logs"]["lrs"] == pytest.approx([0.05, 0.025]), chief["logs"]
