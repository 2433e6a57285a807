"""The pipeline training step: a policy whose replica step runs a schedule.

1F1B starts micro-batch i's backward before later micro-batches' forwards,
so it needs micro-batch i's loss while the pipeline is still running. A
layer cannot have it: Keras computes the loss after every layer has run. So
for a model whose output is a `keras_comm.parallel.Pipeline` with
``schedule="1f1b"``, the step is this policy's instead of the replicated
one (`keras_comm.training.replicated.train_step` takes its gradients from
here). The schedule itself is the layer's (`Pipeline.run_training_schedule`):

1. the layers before the pipeline run on each replica's batch (a tape);
2. their outputs, labels and sample weights are all-gathered over the
   pipeline group; the stages run the full 1F1B table through the
   pipeline's executor, the last stage computing micro-batch i's loss
   (its share of the mean over the global batch) right after its forward
   and backpropagating it at once;
3. stage 0's input gradient goes back to each replica's rows
   (reduce-scatter) and through the tape of step 1;
4. the optimizer applies the gradients: the stage buffer's reduced over the
   stage's data group (its gradient hook), every other weight world-wide
   (`forward` is steps 1-3 and 5; `ParallelOptimizer`'s step calls it too
   and accumulates or shards the gradients instead);
5. the last stage's outputs, summed over the group, give every replica its
   own samples' predictions, for the loss metric and the metrics.

The gradient equals the full-batch gradient (the loss of micro-batch i is
weighted by its share of the global batch, as `replicated.forward` weights a
replica's). Layers after the pipeline are not supported by this step
(model.fit then uses the layer's GPipe order): their weights would have to
run on the last stage. Regularization losses (``model.losses``) are
refused. Stages' non-trainable state (BatchNormalization's moving
statistics) advances micro-batch by micro-batch and is averaged over the
stage's replicas after the schedule.
"""

import weakref

import keras
import tensorflow as tf

from keras_comm._private import keras_api
from keras_comm.parallel import _collectives
from keras_comm.parallel.pipeline import Pipeline
from keras_comm.training.forward import Forward
from keras_comm.training.forward import global_batch_weight

# Per model: its output Pipeline when that layer takes the training step, or
# None. Per Pipeline: the model of the layers before it ("identity" when
# there are none).
_PLUG_INS = weakref.WeakKeyDictionary()
_PRE_MODELS = weakref.WeakKeyDictionary()


def _pipeline_layer(model):
    """The model's output `Pipeline` when its schedule needs the loss, or None."""
    if model in _PLUG_INS:
        return _PLUG_INS[model]
    layer = None
    layers = getattr(model, "layers", [])
    if layers and isinstance(layers[-1], Pipeline) and layers[-1].computes_loss_in_schedule:
        candidate = layers[-1]
        try:
            outputs = list(model.outputs)
            if len(outputs) == 1 and candidate.output is outputs[0]:
                layer = candidate
        except (AttributeError, ValueError):
            layer = None
    _PLUG_INS[model] = layer
    return layer


def applies(model):
    """Whether `model` trains through this step (in replica context)."""
    layer = _pipeline_layer(model)
    return layer is not None and layer.built and layer.group().size > 1


def _pre_model(model, layer):
    pre = _PRE_MODELS.get(layer)
    if pre is None:
        inputs = list(model.inputs)
        if len(inputs) == 1 and layer.input is inputs[0]:
            pre = "identity"
        else:
            pre = keras.Model(inputs if len(inputs) > 1 else inputs[0], layer.input)
        _PRE_MODELS[layer] = pre
    return pre


def forward(model, data):
    """This replica's gradients for one batch through the full 1F1B table; nothing reduced.

    What `keras_comm.training.forward.forward` is for other models: one
    gradient (or None) per `model.trainable_weights`, the loss tracked, and
    the predictions for the metrics; the caller applies them
    (`replicated.train_step`) or accumulates and shards them
    (`ParallelOptimizer`). The stage buffer's gradient is this stage's,
    reduced later by its gradient hook over the stage's data group.

    Returns:
        A `keras_comm.training.forward.Forward`.
    """
    layer = _pipeline_layer(model)
    if model.losses:
        raise ValueError(
            f"The pipeline training step of {layer.name!r} does not support "
            "regularization losses (model.losses). Received: "
            f"{len(model.losses)} losses"
        )
    x, y, sample_weight = keras.utils.unpack_x_y_sample_weight(data)
    pre = _pre_model(model, layer)
    group = layer.group()
    name, timeout = layer.name, layer.timeout
    with tf.GradientTape() as tape:
        h = x if pre == "identity" else pre(x, training=True)
    pre_weights = [] if pre == "identity" else list(pre.trainable_weights)
    batch = tf.shape(h)[0]

    def gather(t):
        return None if t is None else _collectives.gather_batch(t, group, name, timeout)

    hg = gather(h)
    yg = tf.nest.map_structure(gather, y)
    swg = tf.nest.map_structure(gather, sample_weight)
    mb = tf.shape(hg)[0] // layer.num_micro_batches
    # Micro-batch i's share of the loss over the global batch: Keras's
    # per-replica loss is mean / num_replicas, so scale it by
    # num_replicas * (micro-batch size) / (global batch size).
    weight = global_batch_weight(batch, tf.float32)
    if weight is not None:
        weight = weight * tf.math.divide_no_nan(tf.cast(mb, tf.float32), tf.cast(batch, tf.float32))

    def rows(t, i):
        return None if t is None else t[i * mb : (i + 1) * mb]

    def loss_fn(i, y_pred):
        yi = tf.nest.map_structure(lambda t: rows(t, i), yg)
        swi = tf.nest.map_structure(lambda t: rows(t, i), swg)
        loss = keras_api.compute_loss(model, None, yi, y_pred, swi)
        if weight is not None:
            loss = loss * tf.cast(weight, loss.dtype)
        if model.optimizer is not None:
            loss = model.optimizer.scale_loss(loss)
        return loss

    result = layer.run_training_schedule(hg, loss_fn)
    grads = []
    if pre_weights:
        grads = tape.gradient(h, pre_weights, output_gradients=result.input_gradient())
    by_id = {id(w): g for w, g in zip(pre_weights, grads)}
    by_id.update((id(w), g) for w, g in result.gradients)
    # The loss metric: this replica's own samples, as the replicated step tracks it.
    loss = keras_api.compute_loss(model, x, y, result.output, sample_weight)
    keras_api.track_loss(model, loss, batch)
    return Forward(
        [by_id.get(id(w)) for w in model.trainable_weights], x, y, result.output, sample_weight
    )
