"""Worker: non-trainable state across real workers (issue 19), many checks per launch.

Each worker is one replica. In one launch:

1. "bn": a small CNN with BatchNormalization (not synchronized) and a Dropout
   trained with `fit` under keras_comm; then the same model, data and initial
   weights under tf-keras (Keras 2) on the same MultiWorkerMirroredStrategy,
   whose BatchNormalization keeps its moving statistics per replica
   (ON_READ, MEAN): `get_weights` outside the replicas reads their mean over
   workers, the reference. Reports every weight (the test compares workers),
   the max difference to tf-keras, evaluate's loss and predict's output.
2. "sync": BatchNormalization(synchronized=True) (no bias before it) against
   the same model trained in this process alone on the global batches.
3. "norm": a `keras.layers.Normalization` adapted on each worker's own
   shard (the layer then normalizes differently by worker), pooled with
   `nontrainable.agree_adapted`, then trained: its statistics, what it
   computes and predict afterwards (identical on every worker: the union's
   statistics).
4. "resume": the BN model with `keras_comm.callbacks.BackupAndRestore`,
   interrupted mid-epoch and resumed (in this process, a fresh model), against
   the same fit uninterrupted (case 1's model, trained once for both): each
   worker's weights, moving statistics included.

Run by tests/acceptance/test_collectives_multiprocess.py in the suite's
shared 3-worker launch (acceptance/shared_launch_worker.py): that launch's
import and cluster setup serve every group it runs.
"""

import os
from pathlib import Path

import numpy as np
import tensorflow as tf

from _cluster import finish, write_result
from _strategy import strategy

import keras  # noqa: E402
import tf_keras  # noqa: E402

import keras_comm  # noqa: E402  (after the strategy: TF_CONFIG is read once)
from _shared import InterruptAt  # noqa: E402

N = strategy.num_replicas_in_sync
RANK = int(strategy.cluster_resolver.task_id)
LOCAL = 4  # samples per worker per step
STEPS = 4


def data():
    rng = np.random.default_rng(0)
    n = STEPS * N * LOCAL
    x = rng.normal(size=(n, 6, 6, 2)).astype("float32") + 0.5
    y = rng.normal(size=(n, 3)).astype("float32")
    return x, y


def dataset(x, y, batch):
    ds = tf.data.Dataset.from_tensor_slices((x, y)).batch(batch)
    options = tf.data.Options()
    options.experimental_distribute.auto_shard_policy = tf.data.experimental.AutoShardPolicy.DATA
    return ds.with_options(options)


def cnn(K, synchronized=False, dropout=True):
    inp = K.Input((6, 6, 2))
    h = K.layers.Conv2D(4, 3, use_bias=False)(inp)
    if K is tf_keras:
        # Its fused kernel applies Bessel's correction to the moving
        # variance; Keras 3 does not (unrelated to distribution).
        h = K.layers.BatchNormalization(momentum=0.9, fused=False)(h)
    else:
        h = K.layers.BatchNormalization(momentum=0.9, synchronized=synchronized)(h)
    h = K.layers.ReLU()(h)
    h = K.layers.GlobalAveragePooling2D()(h)
    if dropout:
        h = K.layers.Dropout(0.25, seed=3)(h)
    return K.Model(inp, K.layers.Dense(3)(h))


def spread_free(weights):
    return [np.asarray(w).tolist() for w in weights]


def case_bn(x, y):
    keras.utils.set_random_seed(1)
    with strategy.scope():
        model = cnn(keras, dropout=False)
        model.compile(keras.optimizers.SGD(0.1, momentum=0.9), "mse")
    initial = model.get_weights()
    model.fit(dataset(x, y, N * LOCAL), epochs=2, verbose=0)
    with strategy.scope():
        ref = cnn(tf_keras, dropout=False)
        ref.compile(tf_keras.optimizers.SGD(0.1, momentum=0.9), "mse")
    ref.set_weights(initial)
    ref.fit(dataset(x, y, N * LOCAL), epochs=2, verbose=0)
    diffs = {
        v.path: float(np.abs(a - b).max())
        for v, a, b in zip(model.weights, model.get_weights(), ref.get_weights())
    }
    loss = model.evaluate(dataset(x, y, N * LOCAL), verbose=0)
    pred = model.predict(x, batch_size=N * LOCAL, verbose=0)
    # A distributed predict gives every worker the same rows (each worker's
    # share, gathered) whatever their statistics; what shows they agree is
    # that it equals this process alone predicting with this worker's weights.
    alone = cnn(keras, dropout=False)
    alone.set_weights(model.get_weights())
    pred_vs_alone = float(np.abs(alone.predict(x, batch_size=N * LOCAL, verbose=0) - pred).max())
    # With Dropout (its seed state is integer state: left alone) and Adam, as
    # a user would: every weight identical across workers.
    keras.utils.set_random_seed(1)
    with strategy.scope():
        adam = cnn(keras, dropout=True)
        adam.compile(keras.optimizers.Adam(0.01), "mse")
    adam.fit(dataset(x, y, N * LOCAL), epochs=2, verbose=0)
    return {
        "weights": spread_free(model.get_weights()),
        "local": spread_free([v.value.numpy() for v in model.weights]),
        "adam_weights": spread_free(adam.get_weights()),
        "diff_to_tf_keras": diffs,
        "loss": float(loss),
        "pred": pred.tolist(),
        "pred_vs_alone": pred_vs_alone,
    }


def case_sync(x, y):
    keras.utils.set_random_seed(1)
    with strategy.scope():
        model = cnn(keras, synchronized=True, dropout=False)
        model.compile(keras.optimizers.SGD(0.1, momentum=0.9), "mse")
    single = cnn(keras, synchronized=True, dropout=False)
    single.compile(keras.optimizers.SGD(0.1, momentum=0.9), "mse")
    single.set_weights(model.get_weights())
    model.fit(dataset(x, y, N * LOCAL), epochs=2, verbose=0)
    single.fit(x, y, batch_size=N * LOCAL, epochs=2, shuffle=False, verbose=0)
    return {
        "max_abs": max(
            float(np.abs(a - b).max()) for a, b in zip(model.get_weights(), single.get_weights())
        )
    }


def case_norm(x, y):
    from keras_comm.training import nontrainable

    flat = x.reshape(len(x), -1)[:, :3]
    keras.utils.set_random_seed(1)
    with strategy.scope():
        norm = keras.layers.Normalization()
        model = keras.Sequential([keras.Input((3,)), norm, keras.layers.Dense(3)])
        model.compile(keras.optimizers.SGD(0.1), "mse")
    shard = flat[RANK::N]
    norm.adapt(shard)
    adapted = [norm.mean.numpy().tolist(), norm.variance.numpy().tolist()]
    # Left alone, each worker keeps (and normalizes with) its own statistics:
    # the per-step sync does not touch them. (The layer itself, not predict:
    # a distributed predict concatenates every worker's share of the rows.)
    kept = norm(flat).numpy()
    pooled = nontrainable.agree_adapted(model) == [norm]
    model.fit(dataset(flat, y, N * LOCAL), epochs=1, verbose=0)
    return {
        "adapted": adapted,
        "pooled": pooled,
        "kept_pred": kept.tolist(),
        "after": [v.value.numpy().tolist() for v in model.non_trainable_weights],
        "normalized": norm(flat).numpy().tolist(),
        "pred": model.predict(flat, batch_size=N * LOCAL, verbose=0).tolist(),
        "union": [flat.astype(np.float64).mean(0).tolist(), flat.astype(np.float64).var(0).tolist()],
    }


def case_resume(x, y, uninterrupted):
    """`uninterrupted`: case_bn's model's values (`[v.value.numpy() for v in
    model.weights]`), the same model, seed, data and `fit` left uninterrupted,
    so not trained a second time here."""
    backup = str(Path(os.environ["KERAS_COMM_TEST_OUT"]) / "backup")

    def fresh():
        keras.utils.set_random_seed(1)
        with strategy.scope():
            model = cnn(keras, dropout=False)
            model.compile(keras.optimizers.SGD(0.1, momentum=0.9), "mse")
        return model

    def fit(model, callbacks):
        model.fit(dataset(x, y, N * LOCAL), epochs=2, verbose=0, callbacks=callbacks)

    try:
        fit(fresh(), [keras_comm.callbacks.BackupAndRestore(backup, save_freq=3), InterruptAt(6, STEPS)])
        raise AssertionError("not interrupted")
    except RuntimeError as e:
        assert "interrupted" in str(e), e
    resumed = fresh()
    fit(resumed, [keras_comm.callbacks.BackupAndRestore(backup, save_freq=3)])
    assert len(resumed.weights) == len(uninterrupted)
    return {
        "max_abs": {
            v.path: float(np.abs(v.value.numpy() - np.asarray(w)).max())
            for v, w in zip(resumed.weights, uninterrupted, strict=True)
        }
    }


def results():
    """Every case's numbers (the test compares them across workers)."""
    x, y = data()
    bn = case_bn(x, y)
    return {
        "rank": RANK,
        "world": N,
        "bn": bn,
        "sync": case_sync(x, y),
        "norm": case_norm(x, y),
        "resume": case_resume(x, y, bn["local"]),
    }


if __name__ == "__main__":
    write_result(results())
    finish()  # _cluster.finish: skip the slow teardown
