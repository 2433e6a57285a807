"""Where and when `fit` destroys each epoch's iterator (issue 18's later-epoch stall).

With tf.data autotuning on, destroying an iterator can sleep until its
autotuning thread's next optimization, up to a minute (a lost wakeup in
TensorFlow: see the release section of `keras_comm.training.step`). Under
MultiWorkerMirroredStrategy that sleep on one worker's host thread is a wait
for every other worker in the next collective. keras_comm drops each used
iterator whose pipeline autotunes on a release thread, and joins every such
thread before `fit` returns or raises; without autotuning the destructor has
nothing to wait for and runs on the host as in stock Keras.

Checked by which thread drops each used iterator's last reference
(`weakref.finalize` records it), whether that happened before `fit`
returned, and which threads are alive after it: deterministic, no timing.
The suite turns autotuning off for every distributed dataset
(`_shared.without_tf_data_autotune`); the tests with autotuning on undo that
for their own fits.
"""

import threading
import time
import weakref

import keras
import numpy as np
import pytest
import tensorflow as tf

import keras_comm  # noqa: F401  (applies compat)
from _shared import distribute_dataset_class
from conftest import make_strategy
from keras_comm.training import step

EPOCHS = 3


class _Stop(Exception):
    pass


class _RaiseInEpoch(keras.callbacks.Callback):
    def __init__(self, epoch):
        super().__init__()
        self.raise_epoch = epoch
        self.epoch = None

    def on_epoch_begin(self, epoch, logs=None):
        self.epoch = epoch

    def on_train_batch_end(self, batch, logs=None):
        # After the epoch's first call, so the previous iterator's release
        # has been started.
        if self.epoch == self.raise_epoch and batch == 1:
            raise _Stop()


def _fit_recording_releases(autotune, callbacks=()):
    """Fits EPOCHS epochs; per used iterator, the thread that finalized it by fit's end.

    Returns (threads, alive): `threads[i]` is the name of the thread that
    dropped epoch i's iterator, or None if it was still alive when `fit`
    returned or raised; `alive` the release threads running at that moment.
    """
    rng = np.random.default_rng(0)
    # 40 samples in batches of 8: 5 steps per epoch, one replica batch of 4.
    x = rng.normal(size=(40, 4)).astype("float32")
    y = rng.integers(0, 2, size=(40,))
    data = tf.data.Dataset.from_tensor_slices((x, y)).batch(8).cache()
    options = tf.data.Options()
    options.autotune.enabled = autotune
    data = data.with_options(options)
    with make_strategy(2).scope():
        model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(2)])
        model.compile(
            "sgd", keras.losses.SparseCategoricalCrossentropy(from_logits=True)
        )
    finalized = {}  # id(iterator) -> name of the thread that finalized it
    order = []
    used = []

    def record(key):
        finalized[key] = threading.current_thread().name

    make_train_function = model.make_train_function

    def make_recording(force=False):
        make_train_function(force)
        function = model.train_function

        def recording(iterator):
            if all(ref() is not iterator for ref in used):
                used.append(weakref.ref(iterator))
                weakref.finalize(iterator, record, id(iterator))
                order.append(id(iterator))
            return function(iterator)

        model.train_function = recording
        return recording

    model.make_train_function = make_recording
    try:
        model.fit(data, epochs=EPOCHS, verbose=0, callbacks=list(callbacks))
    except _Stop:
        pass
    # Read at once: what fit left behind, before any collection.
    threads = [finalized.get(key) for key in order]
    alive = step.pending_releases()
    return threads, alive


@pytest.fixture
def autotune_on(monkeypatch):
    """Undoes the suite's `without_tf_data_autotune` for one test."""
    cls = distribute_dataset_class()
    original = getattr(vars(cls)["experimental_distribute_dataset"], "original", None)
    if original is not None:
        monkeypatch.setattr(cls, "experimental_distribute_dataset", original)


@pytest.fixture
def slow_release(monkeypatch):
    """Each release takes 0.3 s more, so one that is not joined is still running."""
    drop = step._drop

    def slow_drop(box):
        time.sleep(0.3)
        drop(box)

    monkeypatch.setattr(step, "_drop", slow_drop)


def test_autotuned_iterators_are_released_off_the_host_and_joined(autotune_on, slow_release):
    # Every epoch's iterator is destroyed on a release thread -- never on the
    # host thread, where stock Keras destroys it at the next epoch's first
    # step -- and all of them before fit returns, the last one included:
    # no release thread outlives fit.
    threads, alive = _fit_recording_releases(autotune=True)
    assert threads == [step.RELEASE_THREAD_NAME] * EPOCHS, threads
    assert alive == [], alive


def test_releases_are_joined_when_fit_raises(autotune_on, slow_release):
    # fit raises in epoch 2 (0-based 1) after the previous iterator's release
    # started: that release is finished, and no release thread is alive,
    # when the exception leaves fit. (Epoch 2's iterator stays referenced by
    # fit's frame in the traceback; it is not checked.)
    threads, alive = _fit_recording_releases(
        autotune=True, callbacks=[_RaiseInEpoch(1)]
    )
    assert len(threads) == 2, threads
    assert threads[0] == step.RELEASE_THREAD_NAME, threads
    assert alive == [], alive


def test_iterators_without_autotuning_are_released_on_the_host():
    # Nothing to wait for: destroyed on the host thread, as in stock Keras
    # (the suite's code path), and no thread is started.
    threads, alive = _fit_recording_releases(autotune=False)
    assert threads == [threading.main_thread().name] * EPOCHS, threads
    assert alive == [], alive
