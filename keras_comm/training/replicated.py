"""The exact replicated step: every replica holds every weight (data parallel).

Upstream's `train_step` averages the loss per replica and sums the replicas'
gradients scaled by 1/num_replicas: a mean of per-replica means, which is the
mean over the global batch only when every replica holds as many samples as
the others. This step is upstream's with the loss scaled by
``num_replicas * local_batch / global_batch`` (one scalar all-reduce), which
is exactly 1 for equal shards and makes the final partial batch exact too.

A gradient's path, top to bottom:

1. `forward`: loss over this replica's batch, weighted by
   `global_batch_weight`, scaled by the optimizer's loss scale; gradients by
   the tape. (Shared with `keras_comm.training.accumulate`.)
2. `optimizer.apply_gradients`: reduces each gradient once
   (`keras_comm.training.reduction.all_reduce_sum_gradients`), unscales,
   clips and updates.
3. `nontrainable.sync`: the non-trainable state the forward updated
   (BatchNormalization's moving statistics) set to its mean over replicas,
   one packed all-reduce (see `keras_comm.training.nontrainable`).
4. `compute_metrics` on the forward's predictions, after the update as
   upstream; the step owner (`keras_comm.training.step`) reduces the logs
   exactly across replicas.
"""

import dataclasses
import warnings

import keras
import tensorflow as tf

from keras_comm._private import keras_api
from keras_comm.ops._fusion import fusion_scope
from keras_comm.training import nontrainable
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


def train_step(self, data):
    """Replaces `TensorFlowTrainer.train_step` (a model method).

    Upstream's step, in upstream's order (update, then metrics), with the
    global-batch loss weight of `global_batch_weight`, and the replicas'
    non-trainable state averaged between the update and the metrics
    (`nontrainable.sync`). A model whose output is a 1F1B
    `keras_comm.parallel.Pipeline` trains through the pipeline step instead
    (`keras_comm.training.pipeline`).
    """
    from keras_comm.training import pipeline

    if pipeline.applies(self):
        return pipeline.train_step(self, data)
    result = forward(self, data)
    if self.trainable_weights:
        self.optimizer.apply_gradients(zip(result.grads, self.trainable_weights))
    else:
        # Upstream's warning, kept so behaviour matches stock Keras.
        warnings.warn("The model does not have any trainable weights.")
    nontrainable.sync(self)
    return result.metrics(self)


def train_step_gradients(model, data):
    """This replica's gradients and metric logs for one batch: the default
    `train_step` without the update.

    Returns:
        ``(grads, logs)``: one gradient (or None) per
        `model.trainable_weights`, and `model.compute_metrics`'s logs.
    """
    result = forward(model, data)
    return result.grads, result.metrics(model)
