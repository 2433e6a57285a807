"""The Keras multi-worker tutorial flow, as scenarios shared by workers and tests.

`run_all(strategy)` builds, compiles and trains small deterministic models
inside `strategy.scope()` (or without a strategy when `strategy` is None, the
single-process reference) and returns plain-Python results: weights, history,
evaluate and predict outputs. Every worker passes the same global data, so the
reference sees exactly the global batches the workers split between them.

The sample counts leave a partial final batch, smaller than the number of
workers in one case, so some workers get empty shards.
"""

import contextlib

import numpy as np

import keras
import tensorflow as tf

NUM_SAMPLES = 25
BATCH_SIZE = 6  # 25 = 4 * 6 + 1: the last global batch has a single sample.
NUM_VAL = 10
VAL_BATCH_SIZE = 4  # 10 = 2 * 4 + 2
EPOCHS = 2


def _data(seed):
    rng = np.random.default_rng(seed)
    a = rng.normal(size=(NUM_SAMPLES, 3)).astype("float32")
    b = rng.normal(size=(NUM_SAMPLES, 2)).astype("float32")
    y = ((a.sum(1) - b.sum(1)) > 0).astype("float32")[:, None]
    sw = rng.uniform(0.25, 2.0, size=(NUM_SAMPLES,)).astype("float32")
    return a, b, y, sw


def _init(seed):
    return keras.initializers.GlorotUniform(seed=seed)


def _metrics():
    return [
        "accuracy",
        keras.metrics.AUC(name="auc"),
        keras.metrics.Precision(name="precision"),
    ]


def _tuple_model():
    inputs = keras.Input((3,))
    hidden = keras.layers.Dense(
        4,
        activation="tanh",
        kernel_initializer=_init(1),
        kernel_regularizer=keras.regularizers.L2(1e-2),
    )(inputs)
    outputs = keras.layers.Dense(1, activation="sigmoid", kernel_initializer=_init(2))(
        hidden
    )
    model = keras.Model(inputs, outputs)
    model.compile(
        optimizer=keras.optimizers.SGD(0.2, momentum=0.9),
        loss="binary_crossentropy",
        metrics=_metrics(),
        weighted_metrics=["mse"],
    )
    return model


def _dict_model(steps_per_execution):
    a = keras.Input((3,), name="a")
    b = keras.Input((2,), name="b")
    hidden = keras.layers.Concatenate()([a, b])
    hidden = keras.layers.Dense(5, activation="relu", kernel_initializer=_init(3))(hidden)
    outputs = keras.layers.Dense(1, activation="sigmoid", kernel_initializer=_init(4))(
        hidden
    )
    model = keras.Model({"a": a, "b": b}, outputs)
    model.compile(
        optimizer=keras.optimizers.Adam(0.05),
        loss="binary_crossentropy",
        metrics=_metrics(),
        weighted_metrics=["mse"],
        steps_per_execution=steps_per_execution,
    )
    return model


def _result(model, history, evaluated, predicted):
    return {
        "weights": [w.tolist() for w in model.get_weights()],
        "history": {k: [float(v) for v in vs] for k, vs in history.history.items()},
        "evaluate": {k: float(v) for k, v in evaluated.items()},
        "predict": np.asarray(predicted).tolist(),
    }


def tuple_dataset_flow(scope):
    """tf.data (x, y, sample_weight) with validation data; steps_per_execution=1."""
    a, _, y, sw = _data(0)
    va, _, vy, _ = _data(1)
    train = tf.data.Dataset.from_tensor_slices((a, y, sw)).batch(BATCH_SIZE)
    val = tf.data.Dataset.from_tensor_slices((va[:NUM_VAL], vy[:NUM_VAL])).batch(
        VAL_BATCH_SIZE
    )
    with scope():
        model = _tuple_model()
    history = model.fit(
        train, validation_data=val, epochs=EPOCHS, shuffle=False, verbose=0
    )
    evaluated = model.evaluate(val, verbose=0, return_dict=True)
    predicted = model.predict(
        tf.data.Dataset.from_tensor_slices(a).batch(BATCH_SIZE), verbose=0
    )
    return _result(model, history, evaluated, predicted)


def dict_numpy_flow(scope, steps_per_execution=3):
    """NumPy dict inputs, sample weights, validation data, steps_per_execution."""
    a, b, y, sw = _data(2)
    va, vb, vy, _ = _data(3)
    val_x = {"a": va[:NUM_VAL], "b": vb[:NUM_VAL]}
    with scope():
        model = _dict_model(steps_per_execution)
    history = model.fit(
        {"a": a, "b": b},
        y,
        sample_weight=sw,
        batch_size=BATCH_SIZE,
        epochs=EPOCHS,
        shuffle=False,
        validation_data=(val_x, vy[:NUM_VAL]),
        validation_batch_size=VAL_BATCH_SIZE,
        verbose=0,
    )
    evaluated = model.evaluate(
        val_x, vy[:NUM_VAL], batch_size=VAL_BATCH_SIZE, verbose=0, return_dict=True
    )
    predicted = model.predict({"a": a, "b": b}, batch_size=BATCH_SIZE, verbose=0)
    return _result(model, history, evaluated, predicted)


def generator_flow(scope):
    """A Python generator with steps_per_epoch: its iterator lives across
    epochs and a batch pulled out of it is gone, so building the model must
    not consume one. Also steps_per_execution=2 over 5 steps per epoch."""
    a, _, y, sw = _data(4)

    def batches():
        while True:
            for start in range(0, NUM_SAMPLES, BATCH_SIZE):
                stop = start + BATCH_SIZE
                yield a[start:stop], y[start:stop], sw[start:stop]

    steps = -(-NUM_SAMPLES // BATCH_SIZE)
    with scope():
        model = _tuple_model()
        model.compile(
            optimizer=keras.optimizers.SGD(0.2, momentum=0.9),
            loss="binary_crossentropy",
            metrics=_metrics(),
            weighted_metrics=["mse"],
            steps_per_execution=2,
        )
    history = model.fit(
        batches(), steps_per_epoch=steps, epochs=EPOCHS, shuffle=False, verbose=0
    )
    evaluated = model.evaluate(batches(), steps=steps, verbose=0, return_dict=True)
    predicted = model.predict(a, batch_size=BATCH_SIZE, verbose=0)
    return _result(model, history, evaluated, predicted)


def run_all(strategy=None):
    """Runs every scenario under `strategy` (None: single process).

    Nothing here draws random numbers (seeded initializers, no dropout, no
    shuffling), so no global seed is needed and none is touched.
    """
    scope = strategy.scope if strategy is not None else contextlib.nullcontext
    return {
        "tuple_dataset": tuple_dataset_flow(scope),
        "dict_numpy_spe3": dict_numpy_flow(scope),
        "generator_spe2": generator_flow(scope),
    }
