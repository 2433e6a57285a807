"""Backups reach the disk before they are named: fsync of the file, then of its directory.

Issue 15, item 4: BackupAndRestore wrote and renamed its files without
fsync, so after a crash (power loss, a killed VM) a backup's name could point
at an empty or partial file. A crash cannot be staged in a test; what can be
checked is the order of the system calls every backup file goes through:
written under a temporary name, that file fsynced, renamed onto its final
name, and the directory fsynced after the rename (which makes the new name
itself durable). tests/callbacks/test_checkpoint.py and
tests/callbacks/test_checkpoint_multiprocess.py check what a torn file does on restore.
"""

import os

import keras
import numpy as np
import tensorflow as tf

import keras_comm


def _fit_with_a_backup(backup_dir, epochs):
    keras.utils.set_random_seed(1)
    model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(2)])
    model.compile(optimizer=keras.optimizers.Adam(0.01), loss="mse")
    x = np.linspace(0.0, 1.0, 24, dtype="float32").reshape(8, 3)
    model.fit(
        x, x[:, :2], batch_size=4, epochs=epochs, verbose=0, shuffle=False,
        callbacks=[keras_comm.callbacks.BackupAndRestore(
            str(backup_dir), save_freq="epoch", delete_checkpoint=False)],
    )


def _trace(monkeypatch):
    """Records ("fsync", path) and ("rename", src, dst), in order."""
    events = []
    fsync, rename = os.fsync, tf.io.gfile.rename

    def traced_fsync(fd):
        events.append(("fsync", os.path.realpath(os.readlink(f"/proc/self/fd/{fd}"))))
        return fsync(fd)

    def traced_rename(src, dst, overwrite=False):
        events.append(("rename", os.path.realpath(src), os.path.realpath(dst)))
        return rename(src, dst, overwrite=overwrite)

    monkeypatch.setattr(os, "fsync", traced_fsync)
    monkeypatch.setattr(tf.io.gfile, "rename", traced_rename)
    return events


def test_every_backup_file_is_synced_renamed_and_its_directory_synced(tmp_path, monkeypatch):
    backup_dir = tmp_path / "backup"
    events = _trace(monkeypatch)
    _fit_with_a_backup(backup_dir, epochs=2)
    directory = os.path.realpath(backup_dir)
    final = sorted(os.listdir(backup_dir))
    assert final == ["ckpt-2-0.json", "ckpt-2-0.weights.h5", "training_metadata.json"]

    renames = [i for i, e in enumerate(events) if e[0] == "rename"]
    # Two epoch backups, three files each (weights, record, metadata).
    assert len(renames) == 6, events
    for n, i in enumerate(renames):
        _, src, dst = events[i]
        assert os.path.dirname(dst) == directory and src != dst, events[i]
        previous = renames[n - 1] if n else -1
        # The file's data is on disk before its new name exists ...
        assert ("fsync", src) in events[previous + 1:i], (events[i], events)
        # ... and the new name is on disk before anything else is renamed.
        following = renames[n + 1] if n + 1 < len(renames) else len(events)
        assert ("fsync", directory) in events[i + 1:following], (events[i], events)
    assert {os.path.basename(events[i][2]) for i in renames[-3:]} == set(final)
