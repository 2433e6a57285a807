"""Where `fit` destroys each epoch's iterator (issue 18's later-epoch stall).

With tf.data autotuning on, destroying an iterator can sleep until its
autotuning thread's next optimization, up to a minute (a lost wakeup in
TensorFlow: see `keras_comm.training.step._releasing_previous_iterator`).
Under MultiWorkerMirroredStrategy that sleep on one worker's host thread is
a wait for every other worker in the next collective. keras_comm hands each
used iterator whose pipeline autotunes to a releaser thread; without
autotuning the destructor has nothing to wait for and runs on the host as
in stock Keras.

Checked by where each iterator that the train function used is finalized
(the thread that drops its last reference), not by time: deterministic. The
suite turns autotuning off for every distributed dataset
(`_shared.without_tf_data_autotune`); the test with autotuning on undoes
that for its own fit.
"""

import gc
import inspect
import threading
import weakref

import keras
import numpy as np
import pytest
import tensorflow as tf

import keras_comm  # noqa: F401  (applies compat)
from conftest import make_strategy
from keras_comm.training import step

EPOCHS = 3


def _fit_recording_releases(autotune):
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
                finalized.setdefault("order", []).append(id(iterator))
            return function(iterator)

        model.train_function = recording
        return recording

    model.make_train_function = make_recording
    model.fit(data, epochs=EPOCHS, verbose=0)
    order = finalized.pop("order")
    assert len(order) == EPOCHS, order  # one iterator per epoch
    gc.collect()
    assert step.wait_for_releases(120)
    # The last epoch's iterator stays held by the train function while the
    # model lives (here past the test): not checked.
    return [finalized.get(key) for key in order[:-1]]


@pytest.fixture
def autotune_on(monkeypatch):
    """Undoes the suite's `without_tf_data_autotune` for one test."""
    wrapped = tf.distribute.Strategy.experimental_distribute_dataset
    original = inspect.getclosurevars(wrapped).nonlocals.get("original")
    if original is not None:
        monkeypatch.setattr(
            tf.distribute.Strategy, "experimental_distribute_dataset", original
        )


def test_autotuned_iterators_are_released_off_the_host(autotune_on):
    # Every epoch's iterator is destroyed on the releaser thread: never on
    # the host thread, where stock Keras destroys it at the next epoch's
    # start.
    threads = _fit_recording_releases(autotune=True)
    assert threads == [step.RELEASER_THREAD_NAME] * (EPOCHS - 1), threads


def test_iterators_without_autotuning_are_released_on_the_host():
    # Nothing to wait for: released where stock Keras releases it.
    threads = _fit_recording_releases(autotune=False)
    assert threads == ["MainThread"] * (EPOCHS - 1), threads
