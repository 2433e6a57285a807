"""Checkpoints of sharded optimizer state, BackupAndRestore resume, and the
"each gradient reduced once" rule for comm layers, in one process (2
replicas on logical CPUs). The kill-and-relaunch check across real processes
is tests/callbacks/test_checkpoint_multiprocess.py.
"""

import shutil

import keras
import numpy as np
import pytest
import tensorflow as tf
from _shared import InterruptAt
from conftest import make_strategy

from keras_comm import compat
from keras_comm import parallel as P
from keras_comm.callbacks import BackupAndRestore
from keras_comm.callbacks import ParallelOptimizer
from keras_comm.layers import MirrorOperator

MICRO = 8
RTOL = 1e-4


def _data(n=48):
    rng = np.random.default_rng(0)
    return (
        rng.normal(size=(n, 5)).astype("float32"),
        rng.normal(size=(n, 3)).astype("float32"),
    )


def _ds(x, y, batch=MICRO):
    return tf.data.Dataset.from_tensor_slices((x, y)).batch(batch)


def _model(strategy=None):
    keras.utils.set_random_seed(1)
    scope = strategy.scope() if strategy is not None else _null()
    with scope:
        model = keras.Sequential(
            [keras.Input((5,)), keras.layers.Dense(4, activation="tanh"), keras.layers.Dense(3)]
        )
        model.compile(optimizer=keras.optimizers.Adam(0.05), loss="mse")
    return model


class _null:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


def _max_rel(a, b):
    return max(
        float(np.abs(np.asarray(u) - np.asarray(v)).max() / max(np.abs(np.asarray(v)).max(), 1e-12))
        for u, v in zip(a, b)
    )


def test_sharded_slots_saved_and_resharded_for_another_world(tmp_path):
    x, y = _data()
    reference = _model()
    reference.fit(_ds(x, y, 2 * MICRO), epochs=2, verbose=0)
    first = _model()
    first.fit(_ds(x, y, 2 * MICRO), epochs=1, verbose=0)

    # Epoch 1 on 2 replicas with sharded Adam state: the save gathers it
    # into a standard Keras checkpoint (the optimizer's own slots hold no
    # memory under ParallelOptimizer), which a plain model loads.
    model = _model(make_strategy(2))
    model.fit(_ds(x, y), epochs=1, verbose=0,
              callbacks=[ParallelOptimizer(accumulation_steps=2, zero_stage=1)])
    path = str(tmp_path / "state.weights.h5")
    model.save_weights(path)
    plain = _model()
    plain.optimizer.build(plain.trainable_variables)
    plain.load_weights(path)
    assert _max_rel(plain.optimizer.variables, first.optimizer.variables) <= RTOL

    # Epoch 2 in a world of one, from the file: the 2-way shards are whole
    # again. (Another in-process world size would clash with the 2-replica
    # strategy's collective group; the real-cluster test covers 2 workers.)
    resumed = _model()
    resumed.optimizer.build(resumed.trainable_variables)
    resumed.load_weights(path)
    resumed.fit(_ds(x, y), epochs=1, verbose=0,
                callbacks=[ParallelOptimizer(accumulation_steps=2, zero_stage=2)])
    assert _max_rel(resumed.get_weights(), reference.get_weights()) <= RTOL
    resumed.save_weights(str(tmp_path / "resumed.weights.h5"))
    plain = _model()
    plain.optimizer.build(plain.trainable_variables)
    plain.load_weights(str(tmp_path / "resumed.weights.h5"))
    assert _max_rel(plain.optimizer.variables, reference.optimizer.variables) <= RTOL


@pytest.mark.parametrize("parallel", [False, True], ids=["plain", "zero1"])
def test_backup_resumes_at_the_step(tmp_path, parallel):
    # 6 steps per epoch, 2 epochs, a backup every 4 steps (with accumulation
    # windows of 2 a backup only ever lands on a window's end), interrupted
    # before global step 9: resumes from step 8 = epoch 1, step 2.
    x, y = _data()
    strategy = make_strategy(2)
    extra = lambda: [ParallelOptimizer(accumulation_steps=2, zero_stage=1)] if parallel else []
    reference = _model(strategy)
    reference.fit(_ds(x, y), epochs=2, verbose=0, callbacks=extra())

    backup_dir = str(tmp_path / "backup")
    model = _model(strategy)
    with pytest.raises(RuntimeError, match="interrupted"):
        model.fit(_ds(x, y), epochs=2, verbose=0,
                  callbacks=[InterruptAt(9, 6), *extra(), BackupAndRestore(backup_dir, save_freq=4)])
    model = _model(strategy)
    backup = BackupAndRestore(backup_dir, save_freq=4)
    trained = []
    count = keras.callbacks.LambdaCallback(
        on_train_batch_end=lambda batch, logs: trained.append(batch) if logs else None
    )
    model.fit(_ds(x, y), epochs=2, verbose=0, callbacks=[count, *extra(), backup])
    assert backup.restored == {"epoch": 1, "step": 2}
    assert trained == [2, 3, 4, 5]
    assert _max_rel(model.get_weights(), reference.get_weights()) <= 1e-6
    assert int(model.optimizer.iterations.numpy()) == int(reference.optimizer.iterations.numpy())
    assert not tf.io.gfile.exists(backup_dir)  # removed once fit completed


def _interrupted_backup(backup_dir, double_checkpoint=True):
    x, y = _data()
    with pytest.raises(RuntimeError):
        _model(make_strategy(2)).fit(
            _ds(x, y), epochs=2, verbose=0,
            callbacks=[InterruptAt(9, 6), BackupAndRestore(str(backup_dir), save_freq=4,
                                                       double_checkpoint=double_checkpoint)])


# Session, not module: the suite runs the longest tests first, interleaving
# modules, and pytest tears a module fixture down at every change of module.
@pytest.fixture(scope="session")
def interrupted_backup(tmp_path_factory):
    """The directory an interrupted fit left (double_checkpoint=True), written
    once per pytest process for the tests that damage a copy of it (`copy_of`)."""
    backup_dir = tmp_path_factory.mktemp("interrupted") / "backup"
    _interrupted_backup(backup_dir)
    return backup_dir


def copy_of(backup_dir, tmp_path):
    copy = tmp_path / "backup"
    shutil.copytree(backup_dir, copy)
    return copy


def _resume(backup_dir):
    x, y = _data()
    backup = BackupAndRestore(str(backup_dir), save_freq=4, double_checkpoint=True)
    _model(make_strategy(2)).fit(_ds(x, y), epochs=2, verbose=0, callbacks=[backup])
    return backup.restored


def test_backup_keeps_the_previous_file_on_double_checkpoint(tmp_path):
    # Glob characters in the path: stale backups were found with a glob, so
    # such a directory kept every backup (fails before listing the directory).
    backup_dir = tmp_path / "backup[1]*?"
    _interrupted_backup(backup_dir)
    assert sorted(p.name for p in backup_dir.iterdir()) == [
        "ckpt-0-4.json", "ckpt-0-4.weights.h5", "ckpt-1-2.json", "ckpt-1-2.weights.h5",
        "training_metadata.json",
    ]
    (backup_dir / "ckpt-1-2.weights.h5").write_bytes(b"torn")
    with pytest.warns(UserWarning, match="falling back to the backup of epoch 0, step 4"):
        assert _resume(backup_dir) == {"epoch": 0, "step": 4}


def test_backup_without_double_checkpoint_keeps_one(tmp_path):
    backup_dir = tmp_path / "b[a]ck?up*"
    _interrupted_backup(backup_dir, double_checkpoint=False)
    assert sorted(p.name for p in backup_dir.iterdir()) == [
        "ckpt-1-2.json", "ckpt-1-2.weights.h5", "training_metadata.json",
    ]


@pytest.mark.parametrize(
    "damaged,expected,warning",
    [
        # Before: JSONDecodeError at fit start; the previous backup was named
        # only inside training_metadata.json.
        ("training_metadata.json", {"epoch": 1, "step": 2}, None),
        ("ckpt-1-2.json", {"epoch": 0, "step": 4}, "cannot be read"),
        ("ckpt-1-2.weights.h5", {"epoch": 0, "step": 4}, "falling back"),
        ("ckpt-0-4.json", {"epoch": 1, "step": 2}, "cannot be read"),
        ("ckpt-0-4.weights.h5", {"epoch": 1, "step": 2}, None),
    ],
)
def test_backup_survives_each_truncated_file(tmp_path, interrupted_backup, damaged, expected, warning):
    backup_dir = copy_of(interrupted_backup, tmp_path)
    path = backup_dir / damaged
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])
    if warning is None:
        assert _resume(backup_dir) == expected
    else:
        with pytest.warns(UserWarning, match=warning):
            assert _resume(backup_dir) == expected


def test_backup_with_no_intact_file_fails_naming_them(tmp_path, interrupted_backup):
    backup_dir = copy_of(interrupted_backup, tmp_path)
    for name in ("ckpt-1-2.weights.h5", "ckpt-0-4.weights.h5"):
        (backup_dir / name).write_bytes(b"")
    with pytest.raises(ValueError, match=r"no usable backup.*ckpt-1-2.*ckpt-0-4"):
        _resume(backup_dir)


@pytest.mark.parametrize("kwargs", [dict(save_freq=0), dict(save_freq=True)])
def test_backup_invalid_save_freq(tmp_path, kwargs):
    with pytest.raises(ValueError, match="Received: save_freq="):
        BackupAndRestore(str(tmp_path), **kwargs)


# --- sharded weights in files: full-size on disk -----------------------------


def _sharded_model(kind, strategy=None):
    keras.utils.set_random_seed(1)
    with strategy.scope() if strategy is not None else _null():
        if kind == "tp":
            layers = [keras.Input((5,)), P.ColumnParallelDense(8, activation="tanh", seed=2),
                      P.RowParallelDense(3, seed=3)]
        else:
            layers = [keras.Input((3,), dtype="int32"), P.ParallelEmbedding(8, 4, seed=1),
                      P.MixtureOfExperts(4, 4, top_k=2, capacity_factor=2.0, seed=5),
                      keras.layers.Flatten(), keras.layers.Dense(3)]
        model = keras.Sequential(layers)
        model.compile(optimizer=keras.optimizers.Adam(0.05), loss="mse")
        model.optimizer.build(model.trainable_variables)
    return model


def _sharded_data(kind):
    rng = np.random.default_rng(0)
    x = rng.normal(size=(32, 5)) if kind == "tp" else rng.integers(0, 8, size=(32, 3))
    y = rng.normal(size=(32, 3)).astype("float32")
    return x.astype("float32" if kind == "tp" else "int32"), y


def _components(variables):
    return [c.numpy() for v in variables for c in getattr(v.value, "values", [v.value])]


def _full_optimizer_state(model):
    # The unsplit optimizer's slots from the split one's: every slot of a
    # sharded weight concatenated along that weight's shard axis.
    from keras_comm.parallel import _checkpoint

    specs = _checkpoint.optimizer_slot_specs(model.optimizer)
    return [
        np.asarray(v) if spec is None
        else np.concatenate([c.numpy() for c in v.value.values], spec.shard_axis)
        for v, spec in zip(model.optimizer.variables, specs)
    ]


@pytest.mark.parametrize("kind", ["tp", "emb_moe"])
def test_sharded_state_files_are_full_size(tmp_path, kind):
    # Fails before full-size files: each file held the first replica's
    # shard, so a reload gave every replica shard 0 and the unsplit model
    # could not load it.
    strategy = make_strategy(2)
    x, y = _sharded_data(kind)
    model = _sharded_model(kind, strategy)
    model.fit(x, y, batch_size=8, epochs=1, verbose=0)
    full = P.full_weights(model)
    full_optimizer = _full_optimizer_state(model)
    weights_path, keras_path = str(tmp_path / "m.weights.h5"), str(tmp_path / "m.keras")
    model.save_weights(weights_path)
    model.save(keras_path)

    # The same cluster size: every replica gets its own shard back.
    for load in ("weights", "keras"):
        if load == "weights":
            loaded = _sharded_model(kind, strategy)
            loaded.load_weights(weights_path)
        else:
            with strategy.scope():
                loaded = keras.models.load_model(keras_path)
        assert _max_rel(_components(loaded.weights), _components(model.weights)) == 0.0
        assert _max_rel(_components(loaded.optimizer.variables),
                        _components(model.optimizer.variables)) == 0.0

    # Another size (one replica, no strategy): the standard full weights.
    for load in ("weights", "keras"):
        if load == "weights":
            single = _sharded_model(kind)
            single.load_weights(weights_path)
        else:
            single = keras.models.load_model(keras_path)
        assert _max_rel(single.get_weights(), full) == 0.0
        assert _max_rel(single.optimizer.variables, full_optimizer) == 0.0

    # And back: a file written by the single replica, loaded by two.
    single_path = str(tmp_path / "single.weights.h5")
    single.save_weights(single_path)
    again = _sharded_model(kind, strategy)
    again.load_weights(single_path)
    assert _max_rel(_components(again.weights), _components(model.weights)) == 0.0
    assert _max_rel(_components(again.optimizer.variables),
                    _components(model.optimizer.variables)) == 0.0


def test_shard_sized_file_is_refused(tmp_path):
    # A file holding one shard (as each worker wrote before) must not be
    # loaded into every replica.
    keras.utils.set_random_seed(1)
    shard = keras.Sequential([keras.Input((5,)), P.ColumnParallelDense(4, seed=2)])
    path = str(tmp_path / "shard.weights.h5")
    shard.save_weights(path)
    with make_strategy(2).scope():
        model = keras.Sequential([keras.Input((5,)), P.ColumnParallelDense(8, seed=2)])
    with pytest.raises(ValueError, match=r"holds one shard.*Received: value of shape \(5, 4\)"):
        model.load_weights(path)


# --- each gradient reduced exactly once ------------------------------------


class _MirroredDense(keras.layers.Layer):
    """A dense layer whose kernel goes through MirrorOperator (its gradient is
    all-reduced by the layer's backward)."""

    def __init__(self, units, mark, **kwargs):
        super().__init__(**kwargs)
        self.units, self.mark = units, mark
        self.mirror = MirrorOperator(mean=False)

    def build(self, input_shape):
        self.kernel = self.add_weight(shape=(input_shape[-1], self.units), name="kernel")
        self.bias = self.add_weight(shape=(self.units,), initializer="zeros", name="bias")
        if self.mark:
            compat.mark_gradient_reduced(self.kernel)

    def call(self, x):
        return x @ self.mirror(self.kernel) + self.bias


def _mirrored_model(strategy, mark):
    keras.utils.set_random_seed(2)
    with strategy.scope() if strategy is not None else _null():
        model = keras.Sequential([keras.Input((5,)), _MirroredDense(3, mark)])
        model.compile(optimizer=keras.optimizers.SGD(0.1), loss="mse")
    return model


@pytest.mark.parametrize("mark,callback", [(True, None), (True, 0), (True, 1), (False, None)],
                         ids=["marked-fit", "marked-zero0", "marked-zero1", "unmarked-fit"])
def test_mirror_operator_gradient_reduced_once(mark, callback):
    x, y = _data(32)
    reference = _mirrored_model(None, mark)  # one replica: MirrorOperator is the identity
    reference.fit(_ds(x, y), epochs=1, verbose=0)
    model = _mirrored_model(make_strategy(2), mark)
    callbacks = [] if callback is None else [ParallelOptimizer(zero_stage=callback)]
    model.fit(_ds(x, y), epochs=1, verbose=0, callbacks=callbacks)
    rel = _max_rel(model.get_weights(), reference.get_weights())
    if mark:
        assert rel <= RTOL
    else:
        # Reduced by the layer and again by the optimizer: twice the step.
        assert rel > 1e-2


def test_upstream_fit_loop_still_what_backup_relies_on():
    # keras_comm's BackupAndRestore resumes through `model._initial_epoch` and
    # skips steps by swapping `model.train_function` between the batch-begin
    # and batch-end callbacks; both rely on this shape of the fit loop.
    import inspect

    from keras_comm._private import keras_api

    source = inspect.getsource(keras_api.trainer_class().fit)
    for line in (
        "initial_epoch = self._initial_epoch or initial_epoch",
        "callbacks.on_train_batch_begin(begin_step)",
        "logs = self.train_function(iterator)",
        "callbacks.on_train_batch_end(end_step, logs)",
    ):
        assert line in source, line
