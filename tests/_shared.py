"""What tests and their worker scripts share: a weight comparison and a
callback that interrupts `fit` at a chosen step (the crash a resume test
recovers from).

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
