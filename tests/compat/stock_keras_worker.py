"""Worker: stock Keras under MultiWorkerMirroredStrategy, to see upstream's bugs.

Reverts keras_comm.compat and reports the error `fit` raises, then restores
only the symbolic-build fix and reports the next error; then applies compat
again. When upstream fixes keras-team/keras#20585 these stop failing, and
tests/compat/test_compat.py says so. The suite runs `results` in a shared
launch (tests/acceptance/shared_launch_worker.py).
"""

import numpy as np
import tensorflow as tf

import keras
from keras_comm import compat
from keras_comm._private import keras_api


def fit_error(strategy):
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


def results(strategy):
    """{"stock": fit's error without compat, "build_fixed": with only the build fix}."""
    # `TensorFlowTrainer` (Keras <= 3.15) or `Trainer` (3.16).
    trainer = keras_api.trainer_class()
    compat.revert()
    stock_build = trainer.__dict__["_maybe_symbolic_build"]
    try:
        stock = fit_error(strategy)
        # Only the build fixed: the next upstream failure, in the step's reduction.
        trainer._maybe_symbolic_build = compat._maybe_symbolic_build
        build_fixed = fit_error(strategy)
    finally:
        # Stock Keras again, then compat: the launch's later groups run as users do.
        trainer._maybe_symbolic_build = stock_build
        compat.apply()
    return {"stock": stock, "build_fixed": build_fixed}


if __name__ == "__main__":
    from _cluster import finish, write_result
    from _strategy import strategy

    write_result(results(strategy))
    finish()
