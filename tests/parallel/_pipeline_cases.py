"""Cases shared by the in-process pipeline tests (test_pipeline.py) and the
pipeline worker (parallel/pipeline_worker.py).

Imports Keras: a worker imports this after creating its strategy.
"""

import keras
import tensorflow as tf


def bn_stages():
    """Two stages holding BatchNormalization (moving statistics in the stage buffer)."""
    return [
        keras.Sequential([keras.layers.Dense(5), keras.layers.BatchNormalization(momentum=0.5),
                          keras.layers.Activation("tanh")]),
        keras.Sequential([keras.layers.BatchNormalization(momentum=0.7), keras.layers.Dense(6)]),
    ]


def bn_unsplit():
    """`bn_stages` unsplit, after a Dense(4) on 3 features."""
    return keras.Sequential([
        keras.Input((3,)), keras.layers.Dense(4), keras.layers.Dense(5),
        keras.layers.BatchNormalization(momentum=0.5), keras.layers.Activation("tanh"),
        keras.layers.BatchNormalization(momentum=0.7), keras.layers.Dense(6),
    ])


def micro_batch_steps(ref, optimizer, x, y, batch, m):
    """The unsplit model trained as the pipeline computes: BatchNormalization
    over each micro-batch, its moving statistics updated micro-batch by
    micro-batch, one update per global batch (the mean of the micro-batch losses)."""
    mb = batch // m
    for start in range(0, len(x), batch):
        with tf.GradientTape() as tape:
            loss = tf.add_n([
                tf.reduce_mean(tf.square(ref(x[start + i * mb : start + (i + 1) * mb], training=True)
                                         - y[start + i * mb : start + (i + 1) * mb]))
                for i in range(m)
            ]) / m
        grads = tape.gradient(loss, ref.trainable_variables)
        optimizer.apply_gradients(zip(grads, ref.trainable_variables))


def data_group_steps(ref, optimizer, x, y, batch, m, groups):
    """The unsplit model trained as a pipeline on `groups` data replicas of
    its stages computes, one update per global batch of `batch` rows:

    the weights follow the mean of all ``groups * m`` micro-batch losses
    (group 0's rows first, as the data groups hold them); each stage's
    moving statistics are the mean over the groups of its replicas'
    micro-batch by micro-batch trajectories (exact: BatchNormalization's
    update is linear), from the step's start.
    """
    moving = ["moving" in w.path for w in ref.weights]
    rows = batch // groups
    mb = rows // m
    for start in range(0, len(x), batch):
        before = ref.get_weights()
        micro_batch_steps(ref, optimizer, x[start : start + batch], y[start : start + batch],
                          batch, groups * m)
        trained = ref.get_weights()
        stats = []
        for g in range(groups):
            ref.set_weights(before)
            for i in range(m):
                lo = start + g * rows + i * mb
                ref(x[lo : lo + mb], training=True)
            stats.append(ref.get_weights())
        ref.set_weights([
            sum(s[k] for s in stats) / groups if mv else w
            for k, (w, mv) in enumerate(zip(trained, moving))
        ])
