"""Worker: stock Keras under MultiWorkerMirroredStrategy, to see upstream's bugs.

Reverts keras_comm.compat and reports the error `fit` raises, then restores
only the symbolic-build fix and reports the next error. When upstream fixes
keras-team/keras#20585 these stop failing, and tests/compat/test_compat.py says so.
"""

import numpy as np
import tensorflow as tf

from _cluster import write_result
from keras_comm import compat

strategy = tf.distribute.MultiWorkerMirroredStrategy()

import keras  # noqa: E402
from keras_comm._private import keras_api  # noqa: E402

# `TensorFlowTrainer` (Keras <= 3.15) or `Trainer` (3.16).
TensorFlowTrainer = keras_api.trainer_class()


def fit_error():
    x = np.linspace(0.0, 1.0, 24, dtype="float32").reshape(8, 3)
    y = (x.sum(axis=1, keepdims=True) > 1.5).astype("float32")
    with strategy.scope():
        model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(1)])
        model.compile(optimizer="sgd", loss="mse", metrics=["mae"])
    try:
        model.fit(tf.data.Dataset.from_tensor_slices((x, y)).batch(4), verbose=0)
    except Exception as e:  # noqa: BLE001  the report is the point
        return f"{type(e).__name__}: {e}"
    return None


compat.revert()
stock = fit_error()
# Only the build fixed: the next upstream failure, in the step's reduction.
TensorFlowTrainer._maybe_symbolic_build = compat._maybe_symbolic_build
build_fixed = fit_error()
write_result({"stock": stock, "build_fixed": build_fixed})
