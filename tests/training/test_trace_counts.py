"""No function is traced again after `fit`'s first epoch (issue 18).

Under MultiWorkerMirroredStrategy the same `fit` also checks the data path
of issue 18's stalls, by counting: no step pulls its batch eagerly (an eager
`next` on a distributed iterator runs its end-of-data all-reduce through a
`multiprocessing.pool.ThreadPool` TensorFlow creates per call). (Where the
previous epoch's iterator is destroyed -- off the host, on release threads
`fit` does not wait for -- is
tests/training/test_iterator_release.py's.)

Also, under MultiWorkerMirroredStrategy: the call that finds the end of data
runs nothing of the step (a guard for moving `next()` into the compiled step).

Every graph TensorFlow builds goes through `func_graph_from_py_func`; these
tests record each call with the epoch it happened in. In the first epoch the
train and test steps are traced (twice each at most: the full batch, then the
partial last batch with an unknown batch size). After it, the only graphs
built are the functions of the input iterator Keras creates for each epoch
(`tf.data`'s multi-device iterator traces its per-device generator functions
on creation) -- never a step, a metric reduction or a keras_comm function.
"""

import collections

import keras
import numpy as np
import pytest
import tensorflow as tf
from tensorflow.python.distribute import input_lib
from tensorflow.python.eager.polymorphic_function import polymorphic_function
from tensorflow.python.framework import func_graph

import keras_comm  # noqa: F401  (applies compat)
from conftest import make_strategy

EPOCHS = 4
# What `tf.data`'s MultiDeviceIterator (multi_device_iterator_ops.py) traces
# each time Keras creates an iterator over a distributed dataset.
_PER_ITERATOR = {
    f"{prefix}{part}_func"
    for prefix in ("_", "_remote_")
    for part in ("init", "next", "finalize")
}


class _TraceLog(keras.callbacks.Callback):
    def __init__(self):
        super().__init__()
        self.epoch = "before fit"
        self.traces = collections.defaultdict(list)
        # Per epoch: batches pulled eagerly from a distributed iterator.
        self.eager_nexts = collections.Counter()

    def on_epoch_begin(self, epoch, logs=None):
        self.epoch = epoch

    def record(self, name):
        self.traces[self.epoch].append(name)


class _TracesEveryEpoch(keras.callbacks.Callback):
    # A function built anew each epoch: what the check must catch.
    def on_epoch_end(self, epoch, logs=None):
        tf.function(lambda: tf.constant(epoch))()


def _classifier(strategy, samples):
    """`samples` rows in batches of 16 (cached) and a small compiled classifier."""
    rng = np.random.default_rng(0)
    x = rng.normal(size=(samples, 8)).astype("float32")
    y = rng.integers(0, 3, size=(samples,))
    data = tf.data.Dataset.from_tensor_slices((x, y)).batch(16).cache()
    with strategy.scope():
        model = keras.Sequential(
            [keras.Input((8,)), keras.layers.Dense(16, "relu"), keras.layers.Dense(3)]
        )
        model.compile(
            "adam",
            keras.losses.SparseCategoricalCrossentropy(from_logits=True),
            metrics=["accuracy"],
        )
    return data, model


def _fit_logging_traces(monkeypatch, strategy, extra_callbacks=()):
    log = _TraceLog()
    original = func_graph.func_graph_from_py_func

    def recording(name, python_func, *args, **kwargs):
        log.record(name)
        return original(name, python_func, *args, **kwargs)

    monkeypatch.setattr(func_graph, "func_graph_from_py_func", recording)
    for method in ("get_next", "get_next_as_optional"):
        original_method = getattr(input_lib.DistributedIterator, method)

        def counted(self, *args, _original=original_method, **kwargs):
            if tf.executing_eagerly():
                log.eager_nexts[log.epoch] += 1
            return _original(self, *args, **kwargs)

        monkeypatch.setattr(input_lib.DistributedIterator, method, counted)
    # 100 samples in batches of 16: 6 full batches and a partial one, so the
    # end-of-data path (and on 2 replicas, unequal shards) runs every epoch.
    data, model = _classifier(strategy, 100)
    model.fit(
        data,
        validation_data=data,
        epochs=EPOCHS,
        verbose=0,
        callbacks=[log, *extra_callbacks],
    )
    return log


def _check(log, step="one_step_on_data"):
    traces = log.traces
    # `step`: the compiled step's name (upstream Keras's outside MWMS,
    # keras_comm's `training.step` under it).
    first = traces[0]
    assert any(step in name for name in first), first
    later = [traces[epoch] for epoch in range(1, EPOCHS)]
    for epoch, epoch_traces in enumerate(later, start=1):
        others = [name for name in epoch_traces if name not in _PER_ITERATOR]
        assert others == [], f"traced in epoch {epoch}: {others}"
    # Every later epoch builds exactly the same (per-iterator) graphs.
    assert all(sorted(t) == sorted(later[0]) for t in later), later


def test_no_retrace_after_first_epoch_single_process(monkeypatch):
    log = _fit_logging_traces(monkeypatch, tf.distribute.get_strategy())
    _check(log)


@pytest.mark.parametrize("num_replicas", [2])
def test_no_retrace_after_first_epoch_mwms(monkeypatch, num_replicas):
    log = _fit_logging_traces(monkeypatch, make_strategy(num_replicas))
    # keras_comm's step takes the batch as a `tf.experimental.Optional`
    # pulled by a compiled `next_optional`.
    _check(log, step="one_step_on_optional")
    # The data path, counted (issue 18): no batch pulled eagerly (on real
    # workers each eager pull all-reduces "has data" through a new
    # ThreadPool: 7 train + 7 validation pulls per epoch here before).
    assert dict(log.eager_nexts) == {}, dict(log.eager_nexts)


def test_check_catches_a_function_traced_every_epoch(monkeypatch):
    log = _fit_logging_traces(
        monkeypatch, tf.distribute.get_strategy(), [_TracesEveryEpoch()]
    )
    with pytest.raises(AssertionError, match="traced in epoch 1"):
        _check(log)


def test_end_of_data_call_runs_nothing_of_the_step():
    # 25 samples in batches of 6: 5 steps per epoch; with steps_per_execution
    # 3 the second call of each epoch meets the end of data on its third
    # step. That step must not run: before the fix its input-independent
    # optimizer update still ran beside the failing `get_next` (iterations
    # 6 per epoch), and Adam's bias correction moved every later step.
    rng = np.random.default_rng(0)
    x = rng.normal(size=(25, 4)).astype("float32")
    y = rng.integers(0, 2, size=(25,))
    with make_strategy(2).scope():
        model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(2)])
        model.compile(
            "adam",
            keras.losses.SparseCategoricalCrossentropy(from_logits=True),
            steps_per_execution=3,
        )
    model.fit(x, y, batch_size=6, epochs=2, shuffle=False, verbose=0)
    assert int(model.optimizer.iterations.numpy()) == 10


# --- What one step costs on the host, counted (issue 18) ---------------------


class _CallLog(keras.callbacks.Callback):
    def __init__(self):
        super().__init__()
        self.epoch = "before fit"
        self.calls = collections.defaultdict(collections.Counter)
        self.iterators = collections.Counter()

    def on_epoch_begin(self, epoch, logs=None):
        self.epoch = epoch


def _fit_counting_calls(monkeypatch, strategy, samples=100, epochs=3):
    """`fit` with validation; per epoch: tf.function calls by name, iterators made."""
    log = _CallLog()
    original_call = polymorphic_function.Function.__call__

    def counted_call(self, *args, **kwargs):
        log.calls[log.epoch][self.__name__] += 1
        return original_call(self, *args, **kwargs)

    monkeypatch.setattr(polymorphic_function.Function, "__call__", counted_call)
    original_iter = input_lib.DistributedDataset.__iter__

    def counted_iter(self):
        log.iterators[log.epoch] += 1
        return original_iter(self)

    monkeypatch.setattr(input_lib.DistributedDataset, "__iter__", counted_iter)
    data, model = _classifier(strategy, samples)
    model.fit(data, validation_data=data, epochs=epochs, verbose=0, callbacks=[log])
    return log


def test_two_compiled_calls_per_step_and_one_iterator_per_epoch_mwms(monkeypatch):
    # 100 samples in batches of 16: 7 train and 7 validation steps per epoch.
    # Each step is two compiled calls, the pull and the step (a step that
    # made more, or pulled eagerly, fails here); each epoch creates one
    # distributed iterator for fit and one for its validation, not also the
    # spare one upstream's epoch iterator builds as each epoch ends.
    log = _fit_counting_calls(monkeypatch, make_strategy(2))
    for epoch in (1, 2):
        assert dict(log.calls[epoch]) == {
            "next_optional": 7 + 7, "one_step_on_optional": 7 + 7}, (epoch, dict(log.calls[epoch]))
        assert log.iterators[epoch] == 2, (epoch, dict(log.iterators))
    # The first epoch traces, then counts the same.
    assert log.calls[0]["one_step_on_optional"] == 7 + 7, dict(log.calls[0])
    assert log.iterators[0] == 2, dict(log.iterators)


def test_end_of_data_of_unknown_length_mwms(monkeypatch):
    # A dataset of unknown length: each epoch ends when the pull finds no
    # value on any replica, every replica on the same call (2 replicas,
    # 100 samples in batches of 16: the last batch is split unequally). That
    # call runs nothing of the step (its iteration count), and the next
    # epoch's collectives still work (an aborted collective would fail them).
    rng = np.random.default_rng(0)
    x = rng.normal(size=(100, 8)).astype("float32")
    y = rng.integers(0, 3, size=(100,))
    data = (
        tf.data.Dataset.from_tensor_slices((x, y))
        .batch(16)
        .filter(lambda a, b: True)  # cardinality unknown
    )
    assert int(data.cardinality()) == tf.data.UNKNOWN_CARDINALITY
    with make_strategy(2).scope():
        model = keras.Sequential([keras.Input((8,)), keras.layers.Dense(3)])
        model.compile(
            "adam",
            keras.losses.SparseCategoricalCrossentropy(from_logits=True),
            metrics=["accuracy"],
        )
    history = model.fit(data, epochs=3, verbose=0)
    assert int(model.optimizer.iterations.numpy()) == 3 * 7
    assert len(history.history["loss"]) == 3
    assert np.all(np.isfinite(history.history["loss"]))
