"""The exact replicated step: every replica holds every weight (data parallel).

Upstream's `train_step` averages the loss per replica and sums the replicas'
gradients scaled by 1/num_replicas: a mean of per-replica means, which is the
mean over the global batch only when every replica holds as many samples as
the others. This step is upstream's with the loss scaled by
``num_replicas * local_batch / global_batch`` (one scalar all-reduce), which
is exactly 1 for equal shards and makes the final partial batch exact too.

A gradient's path, top to bottom:

1. `forward` (`keras_comm.training.forward`): loss over this replica's
   batch, weighted by `global_batch_weight`, scaled by the optimizer's loss
   scale; gradients by the tape. A model whose output is a 1F1B `Pipeline`
   gets its gradients from the pipeline's schedule instead
   (`keras_comm.training.pipeline.forward`). (Shared with
   `keras_comm.training.accumulate`.)
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

import warnings

from keras_comm.training import nontrainable
from keras_comm.training import pipeline
from keras_comm.training.forward import Forward  # noqa: F401
from keras_comm.training.forward import forward
from keras_comm.training.forward import global_batch_weight  # noqa: F401


def train_step(self, data):
    """Replaces `TensorFlowTrainer.train_step` (a model method).

    Upstream's step, in upstream's order (update, then metrics), with the
    global-batch loss weight of `global_batch_weight`, and the replicas'
    non-trainable state averaged between the update and the metrics
    (`nontrainable.sync`). A model whose output is a 1F1B
    `keras_comm.parallel.Pipeline` computes its gradients through the
    pipeline's schedule (`keras_comm.training.pipeline.forward`); the update,
    the sync and the metrics are the same.
    """
    result = (pipeline.forward if pipeline.applies(self) else forward)(self, data)
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
