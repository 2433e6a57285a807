"""What the accumulate/shard step (`keras_comm.training.accumulate`) holds in memory.

Counted by TensorFlow's CPU allocator (`tf.config.experimental.get_memory_info`):
the bytes of its live tensors, not the process's resident memory. One
replica, no strategy: the buffers and the steps are those of every replica.

- a micro step updates the accumulation buffers in place: after an update
  has cleared them, the next micro step holds no second copy of them (a
  cleared buffer sharing a constant of the compiled step would be copied);
- creating the state (`ParallelOptimizer`'s train begin) never holds the
  masters, the optimizer's slots and the accumulation buffers all at once.
"""

import keras
import numpy as np
import pytest
import tensorflow as tf

from keras_comm.callbacks import ParallelOptimizer

MIB = 2**20
FEATURES, UNITS = 1024, 4096  # a 16 MiB kernel: large beside everything else a step holds


def _live():
    try:
        return tf.config.experimental.get_memory_info("CPU:0")
    except (ValueError, RuntimeError, tf.errors.OpError):
        pytest.skip("TensorFlow does not count its CPU tensors here (system allocator)")


def _model():
    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.Input((FEATURES,)), keras.layers.Dense(UNITS)])
    model.compile(optimizer=keras.optimizers.Adam(1e-3), loss="mse")
    return model


def _ds(steps, batch=8):
    rng = np.random.default_rng(0)
    x = rng.normal(size=(steps * batch, FEATURES)).astype("float32")
    y = rng.normal(size=(steps * batch, UNITS)).astype("float32")
    return tf.data.Dataset.from_tensor_slices((x, y)).batch(batch)


class _LiveAtBatches(keras.callbacks.Callback):
    """TensorFlow's live bytes at each batch's begin and end."""

    def __init__(self):
        super().__init__()
        self.begin, self.end = {}, {}

    def on_train_batch_begin(self, batch, logs=None):
        self.begin[batch] = _live()["current"]

    def on_train_batch_end(self, batch, logs=None):
        self.end[batch] = _live()["current"]


@pytest.mark.parametrize("zero", [1, 2])
def test_micro_step_after_an_update_adds_in_place(zero):
    _live()
    model = _model()
    po = ParallelOptimizer(accumulation_steps=2, zero_stage=zero)
    probe = _LiveAtBatches()
    # Micro step, update, micro step, update.
    model.fit(_ds(4), epochs=1, verbose=0, callbacks=[po, probe])
    assert po.counts == {"micro_steps": 4, "updates": 2}
    acc = po.state_bytes(breakdown=True)["accumulation"]
    assert acc >= 16 * MIB
    # Step 2 adds to the buffers step 1 cleared: nothing new stays alive.
    grown = probe.end[2] - probe.begin[2]
    assert grown < acc / 4, (
        f"a micro step after an update left {grown / MIB:.1f} MiB more alive "
        f"(accumulation buffers: {acc / MIB:.1f} MiB)"
    )


class _PeakOfTrainBegin(keras.callbacks.Callback):
    """Placed before and after ParallelOptimizer: the live peak of its train begin."""

    def __init__(self, start):
        super().__init__()
        self.start, self.before, self.rise = start, None, None

    def on_train_begin(self, logs=None):
        if self.start is None:
            tf.config.experimental.reset_memory_stats("CPU:0")
            self.before = _live()["current"]
        else:
            self.rise = _live()["peak"] - self.start.before


def test_state_creation_holds_one_kind_at_a_time():
    _live()
    model = _model()
    # The optimizer's own slots exist before fit, as after a first fit or a load.
    model.optimizer.build(model.trainable_variables)
    po = ParallelOptimizer(accumulation_steps=2, zero_stage=1)
    first = _PeakOfTrainBegin(None)
    last = _PeakOfTrainBegin(first)
    model.fit(_ds(2), epochs=1, verbose=0, callbacks=[first, po, last])
    parts = po.state_bytes(breakdown=True)  # one replica: whole slots, masters and buffers
    assert parts["optimizer"] >= 32 * MIB
    # Alone this measures the largest kind (32 MiB); in a long-lived process
    # two kinds can be alive together (what keeps a released one is not
    # known), so the bound is: never all three at once.
    total, smallest = sum(parts.values()), min(parts.values())
    assert last.rise < total - smallest / 2, (
        f"creating the state peaked {last.rise / MIB:.1f} MiB above what was alive; "
        f"its kinds take {total / MIB:.1f} MiB together ({parts})"
    )
