"""One replica's forward and backward pass over one batch: what every policy computes first.

`forward` is the replicated pass (every replica holds every weight); the
pipeline policy (`keras_comm.training.pipeline`) returns the same `Forward`
record from its schedule. Both weight the loss by `global_batch_weight`, so
the gradients summed over replicas are those of the mean over the global
batch.
"""

import dataclasses

import keras
import tensorflow as tf

from keras_comm._private import keras_api
from keras_comm.ops._fusion import fusion_scope
from keras_comm.training import step


@dataclasses.dataclass
class Forward:
    """One replica's forward and backward pass over one batch.

    Attributes:
        grads: one gradient (or None) per `model.trainable_weights`, of the
            loss carrying the global-batch weight and the loss scale.
        x, y, sample_weight: the unpacked batch.
        y_pred: the model's predictions.
    """

    grads: list
    x: object
    y: object
    y_pred: object
    sample_weight: object

    def metrics(self, model):
        """`model.compute_metrics` on this pass's batch and predictions."""
        return model.compute_metrics(
            self.x, self.y, self.y_pred, sample_weight=self.sample_weight
        )


def global_batch_weight(local_batch_size, dtype):
    """`num_replicas * local / global` batch size, as a loss multiplier.

    Keras scales each replica's mean loss by 1/num_replicas; multiplying by
    this turns that into the replica's share of the mean over the global
    batch. Exactly 1.0 when all replicas hold equally many samples. None
    outside a multi-replica MultiWorkerMirroredStrategy.
    """
    strategy = tf.distribute.get_strategy()
    if not step.is_mwms(strategy):
        return None
    local = tf.cast(local_batch_size, tf.float32)
    total = tf.distribute.get_replica_context().all_reduce(
        tf.distribute.ReduceOp.SUM, local
    )
    weight = tf.math.divide_no_nan(local * float(strategy.num_replicas_in_sync), total)
    return tf.cast(weight, dtype)


def forward(model, data):
    """This replica's loss gradients for one batch; nothing is reduced.

    Summing the returned gradients over replicas gives what stock Keras
    would apply (before unscaling). The step's fusion groups are packed when
    the scope closes, before the gradients are used (see
    keras_comm.ops.fusion_scope).

    Args:
        model: a compiled Keras model (TensorFlow backend).
        data: one batch as `fit` passes it to `train_step`.

    Returns:
        A `Forward`.
    """
    x, y, sample_weight = keras.utils.unpack_x_y_sample_weight(data)
    with fusion_scope():
        with tf.GradientTape() as tape:
            if keras_api.call_has_training_arg(model):
                y_pred = model(x, training=True)
            else:
                y_pred = model(x)
            loss = keras_api.compute_loss(model, x, y, y_pred, sample_weight)
            batch_size = tf.shape(
                next(i for i in keras.tree.flatten(x) if i is not None)
            )[0]
            keras_api.track_loss(model, loss, batch_size)
            weight = global_batch_weight(batch_size, loss.dtype)
            if weight is not None:
                loss = loss * weight
            if model.optimizer is not None:
                loss = model.optimizer.scale_loss(loss)
        grads = []
        if model.trainable_weights:
            grads = tape.gradient(loss, model.trainable_weights)
    return Forward(grads, x, y, y_pred, sample_weight)
