"""Where and when `fit` destroys each epoch's iterator (issue 18's later-epoch stall).

With tf.data autotuning on, destroying an iterator can sleep until its
autotuning thread's next optimization, up to a minute (a lost wakeup in
TensorFlow: see the release section of `keras_comm.training.step`). Under
MultiWorkerMirroredStrategy that sleep on one worker's host thread is a wait
for every other worker in the next collective, and at the end of `fit` for
whatever runs next. keras_comm drops each used iterator on a release
thread -- the last one too, when `fit` returns or raises -- and does not wait
for those threads; they are not daemons, so the interpreter joins them before
it exits (and keras-comm-run before its exit barrier). That holds with
autotuning off in the user's dataset too: with several devices per worker the
per-device pipelines tf.data builds autotune anyway.

Checked by which thread drops each used iterator's last reference
(`weakref.finalize` records it), with releases held until the test lets them
go: which iterators were finalized when `fit` returned, which release threads
were still running, and who finalized each one in the end. Deterministic, no
timing. A child interpreter checks the exit.
The suite turns autotuning off for every distributed dataset
(`_shared.without_tf_data_autotune`); the tests with autotuning on undo that
for their own fits.
"""

import threading
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


def _fit_recording_releases(autotune, callbacks=(), let_go=None):
    """Fits EPOCHS epochs; per used iterator, the thread that finalized it.

    Returns (at_return, alive, finally_): `at_return[i]` is the name of the
    thread that had dropped epoch i's iterator when `fit` returned or raised
    (None: still alive), `alive` the number of release threads running at that
    moment, and `finally_` the same as `at_return` once `let_go` (the
    held_releases fixture's event) is set and every release thread joined.
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
    at_return = [finalized.get(key) for key in order]
    alive = len(step.pending_releases())
    if let_go is not None:
        let_go.set()
    for thread in step.pending_releases():
        thread.join(60)
    finally_ = [finalized.get(key) for key in order]
    return at_return, alive, finally_


@pytest.fixture
def autotune_on(monkeypatch):
    """Undoes the suite's `without_tf_data_autotune` for one test."""
    from tensorflow.python.data.ops import multi_device_iterator_ops

    cls = distribute_dataset_class()
    original = getattr(vars(cls)["experimental_distribute_dataset"], "original", None)
    if original is not None:
        monkeypatch.setattr(cls, "experimental_distribute_dataset", original)
    original = getattr(multi_device_iterator_ops._create_device_dataset, "original", None)
    if original is not None:
        monkeypatch.setattr(multi_device_iterator_ops, "_create_device_dataset", original)


@pytest.fixture
def held_releases(monkeypatch):
    """Every release waits until the test sets the returned event."""
    drop = step._drop
    let_go = threading.Event()

    def held_drop(box):
        let_go.wait(60)
        drop(box)

    monkeypatch.setattr(step, "_drop", held_drop)
    yield let_go
    let_go.set()
    for thread in step.pending_releases():
        thread.join(60)


@pytest.mark.parametrize("autotune", [True, False], ids=["autotune", "autotune_off"])
def test_iterators_are_released_off_the_host_and_fit_does_not_wait(
    autotune, autotune_on, held_releases
):
    # Every epoch's iterator is destroyed on a release thread -- never on the
    # host thread, where stock Keras destroys it at the next epoch's first
    # step -- the last one included, and fit returns while all of them are
    # still held: a sleeping destructor delays no step and not fit's return.
    # With autotuning off in the user's dataset too: 2 replicas read through a
    # MultiDeviceIterator, whose per-device pipelines autotune regardless.
    at_return, alive, finally_ = _fit_recording_releases(
        autotune=autotune, let_go=held_releases
    )
    assert at_return == [None] * EPOCHS and alive == EPOCHS, (at_return, alive)
    assert finally_ == [step.RELEASE_THREAD_NAME] * EPOCHS, finally_


def test_a_raising_fit_releases_its_iterators_without_waiting(autotune_on, held_releases):
    # fit raises in epoch 2 (0-based 1) after the previous iterator's release
    # started: the exception leaves fit with that release still running, and
    # the release thread destroys it. (Epoch 2's iterator stays referenced by
    # fit's frame in the traceback; it is not checked.)
    at_return, alive, finally_ = _fit_recording_releases(
        autotune=True, callbacks=[_RaiseInEpoch(1)], let_go=held_releases
    )
    assert len(at_return) == 2 and at_return[0] is None and alive >= 1, (at_return, alive)
    assert finally_[0] == step.RELEASE_THREAD_NAME, finally_


_EXIT_SCRIPT = """
import sys, threading, time, weakref
import keras, numpy as np, tensorflow as tf
import keras_comm
from keras_comm.training import step

drop = step._drop
let_go = threading.Event()
def slow_drop(box):
    let_go.wait(60)
    time.sleep(1.0)  # a destructor's sleep, still running when the script ends
    drop(box)
step._drop = slow_drop

done = []
original = step._ReleaseScope.release
def release(self, box):
    if box:
        weakref.finalize(box[0], lambda: done.append(threading.current_thread().name))
    original(self, box)
step._ReleaseScope.release = release

strategy = tf.distribute.MultiWorkerMirroredStrategy()
x = np.zeros((16, 4), "float32")
data = tf.data.Dataset.from_tensor_slices((x, x[:, :1])).batch(8)
options = tf.data.Options()
options.autotune.enabled = True
with strategy.scope():
    model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(1)])
    model.compile("sgd", "mse")
model.fit(data.with_options(options), epochs=2, verbose=0)
print("pending at the end of the script:", len(step.pending_releases()), flush=True)
let_go.set()
import atexit
atexit.register(lambda: print("finalized before exit:", done, flush=True))
"""


def test_the_interpreter_waits_for_pending_releases_and_exits_cleanly(tmp_path):
    # The script ends with its last iterators' releases still sleeping: the
    # interpreter joins the (non-daemon) release threads before its atexit
    # handlers and finalization, so the destructors finish on their thread
    # and the process exits 0 -- not SIGABRT inside TensorFlow's destructor.
    import os
    import subprocess
    import sys

    script = tmp_path / "exit.py"
    script.write_text(_EXIT_SCRIPT)
    env = {k: v for k, v in os.environ.items() if k != "TF_CONFIG"}
    proc = subprocess.run([sys.executable, str(script)], capture_output=True, text=True,
                          timeout=300, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "pending at the end of the script: 2" in proc.stdout, proc.stdout
    assert f"finalized before exit: {[step.RELEASE_THREAD_NAME] * 2}" in proc.stdout, proc.stdout
