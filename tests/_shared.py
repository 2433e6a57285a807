"""What tests and their worker scripts share: a weight comparison, a
callback that interrupts `fit` at a chosen step (the crash a resume test
recovers from), one that sends a preemption notice (SIGTERM) at a chosen
step, and the resume workers' dataset and model.

Import it after the worker has created its strategy, where it imports Keras.
"""

import keras
import numpy as np


def rel(expected, actual, floor=1e-30):
    """Max over paired arrays of max|e - a| / max|e| (denominator >= `floor`)."""
    worst = 0.0
    for e, a in zip(expected, actual, strict=True):
        e, a = np.asarray(e, np.float64), np.asarray(a, np.float64)
        worst = max(worst, float(np.max(np.abs(e - a)) / max(np.max(np.abs(e)), floor)))
    return worst


def resume_dataset(global_batch, steps, features=None):
    """`steps` global batches of `(x, y)` drawn from seed 0, split by data.

    The dataset the resume workers train on (x drawn before y, so every
    worker, the interrupted run and the uninterrupted reference see the same
    numbers). Auto-sharding by DATA: every worker reads the whole dataset and
    keeps its slice of each global batch, so a restart resumes on the same
    batches.

    Args:
        global_batch: samples per global batch.
        steps: global batches.
        features: `(rng, n) -> x`; by default `n` float32 rows of 5 normals.
            y is always `n` float32 rows of 3 normals.
    """
    import tensorflow as tf

    rng = np.random.default_rng(0)
    n = global_batch * steps
    x = rng.normal(size=(n, 5)).astype("float32") if features is None else features(rng, n)
    y = rng.normal(size=(n, 3)).astype("float32")
    ds = tf.data.Dataset.from_tensor_slices((x, y)).batch(global_batch)
    options = tf.data.Options()
    options.experimental_distribute.auto_shard_policy = tf.data.experimental.AutoShardPolicy.DATA
    return ds.with_options(options)


def resume_model(strategy, units=4, learning_rate=0.05):
    """The resume checks' model, built in `strategy`'s scope from seed 1:
    Dense(`units`, tanh) -> Dense(3) on 5 features, Adam(`learning_rate`), mse."""
    keras.utils.set_random_seed(1)
    with strategy.scope():
        model = keras.Sequential(
            [keras.Input((5,)), keras.layers.Dense(units, activation="tanh"), keras.layers.Dense(3)]
        )
        model.compile(optimizer=keras.optimizers.Adam(learning_rate), loss="mse")
    return model


class SigtermAt(keras.callbacks.Callback):
    """Sends this process SIGTERM `times` times at (epoch, batch) begin, or at
    an epoch's end (batch None), each time waiting until `backup`'s preemption
    watch has noticed it (as a signal arriving during that step would be seen:
    after the step's boundary). `on_send()`, if given, runs first."""

    def __init__(self, backup, epoch, batch, times=1, on_send=None):
        super().__init__()
        self.backup, self.at, self.times, self.on_send, self.epoch = (
            backup, (epoch, batch), times, on_send, 0)

    def _send(self):
        import os
        import signal
        import time

        if self.on_send is not None:
            self.on_send()
        for _ in range(self.times):
            os.kill(os.getpid(), signal.SIGTERM)
            deadline = time.monotonic() + 10
            while not self.backup._preemption.noticed.is_set() and time.monotonic() < deadline:
                time.sleep(0.005)

    def on_epoch_begin(self, epoch, logs=None):
        self.epoch = epoch

    def on_train_batch_begin(self, batch, logs=None):
        if (self.epoch, batch) == self.at:
            self._send()

    def on_epoch_end(self, epoch, logs=None):
        if (epoch, None) == self.at:
            self._send()


class InterruptAt(keras.callbacks.Callback):
    """Raises RuntimeError("interrupted") before global step `step` of `fit`
    (`steps_per_epoch` steps per epoch), as a crash would."""

    def __init__(self, step, steps_per_epoch):
        super().__init__()
        self.step, self.steps_per_epoch, self.epoch = step, steps_per_epoch, 0

    def on_epoch_begin(self, epoch, logs=None):
        self.epoch = epoch

    def on_train_batch_begin(self, batch, logs=None):
        if self.epoch * self.steps_per_epoch + batch == self.step:
            raise RuntimeError("interrupted")


def distribute_dataset_class():
    """The strategy class that defines `experimental_distribute_dataset`
    (every strategy, the default one included, inherits it from there)."""
    import tensorflow as tf

    return next(
        cls for cls in tf.distribute.Strategy.__mro__
        if "experimental_distribute_dataset" in vars(cls)
    )


def without_tf_data_autotune():
    """Turns tf.data autotuning off in every dataset a tf.distribute strategy
    (the default one included) distributes in this process (the suite's datasets; values and order are
    unchanged: autotuning only sizes buffers and thread pools).

    Also the per-device pipelines of tf.data's multi-device iterator (what
    a strategy reads through with several devices per worker: the in-process
    replicas), which tf.data builds with default options, autotuning on
    whatever the source dataset says. They have nothing to tune (a generator
    and a fixed-size prefetch).

    Why: with autotuning on, destroying an iterator can sleep for tens of
    seconds (~30 s at the first epoch change of a 2-replica fit, 0.3 s of
    CPU). `fit` and `evaluate` drop theirs on release threads, but an iterator
    kept alive by a reference cycle (a fit that raised: its traceback's
    frames) is destroyed by whichever garbage collection finds it, on the
    thread of a later test (25-140 s idle stalls in suite runs, native stack
    `RootDataset::Iterator::~Iterator` joining its autotuning thread).
    Set KERAS_COMM_TEST_AUTOTUNE=1 to keep autotuning. Idempotent.
    """
    import os

    import tensorflow as tf

    if os.environ.get("KERAS_COMM_TEST_AUTOTUNE") == "1":
        return
    # The class that defines the method, so that every strategy sees the
    # patch: tf.distribute.Strategy and the default strategy (the reference
    # fits in one process, whose Keras epoch iterator distributes through it
    # too) both inherit it from there. Patching tf.distribute.Strategy alone
    # left the references' iterators autotuning; their destructors then
    # slept at whatever garbage collection collected them, inside a later
    # test's guarded step (60 s timeout, then every collective of that
    # pytest worker aborted).
    strategy_cls = distribute_dataset_class()
    if getattr(strategy_cls.experimental_distribute_dataset, "_keras_comm_no_autotune", False):
        return
    original = strategy_cls.experimental_distribute_dataset

    def experimental_distribute_dataset(self, dataset, options=None):
        if isinstance(dataset, tf.data.Dataset):
            off = tf.data.Options()
            off.autotune.enabled = False
            dataset = dataset.with_options(off)
        return original(self, dataset, options)

    experimental_distribute_dataset._keras_comm_no_autotune = True
    experimental_distribute_dataset.original = original
    strategy_cls.experimental_distribute_dataset = experimental_distribute_dataset

    from tensorflow.python.data.ops import multi_device_iterator_ops

    create_device_dataset = multi_device_iterator_ops._create_device_dataset

    def _create_device_dataset(*args, **kwargs):
        off = tf.data.Options()
        off.autotune.enabled = False
        return create_device_dataset(*args, **kwargs).with_options(off)

    _create_device_dataset.original = create_device_dataset
    multi_device_iterator_ops._create_device_dataset = _create_device_dataset
