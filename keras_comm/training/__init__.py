"""The training step: one owner that compiles it, policies that plug into it.

`keras_comm.training.step` is the only code that compiles a train, test,
predict or flush step: the host loop of `steps_per_execution`, the fusion scope, the
watchdog guard, the exact metric reduction and the error translation.
`keras_comm.compat` installs it into Keras's trainer;
`keras_comm.callbacks.ParallelOptimizer` asks it for its step functions.

A *policy* decides what one replica does with one batch. Three exist:

* `replicated`: every replica holds every weight; the exact replicated step
  (`model.fit`'s default `train_step`, made exact over the global batch).
* `accumulate`: gradient accumulation and ZeRO-1/2 sharded optimizer state
  (`ParallelOptimizer`); its state lives in `optimizer_shards`, its update
  maths in the pure `accumulate.apply_update`, when to apply and in which
  buckets in the pure `accumulate_plan` (the flat-shard layout is
  `keras_comm.variables.packing`).
* `pipeline`: the interleaved 1F1B step of a model whose last layer is a
  1F1B `keras_comm.parallel.Pipeline`, whose schedule it runs through the
  layer's plug-in (`Pipeline.run_training_schedule`);
  `replicated.train_step` takes its gradients from it.

Fully sharded parameters (`keras_comm.parallel.FullyShard`, ZeRO-3) need no
policy: the layer gathers its weights in its own forward and backward, and
its shards' gradients leave reduce-scattered, so their gradient hook
(step 2 below) has nothing left to reduce over the shard group.

The plug-in contract. A policy provides replica steps, ``fn(data) -> logs``
(or ``fn() -> tensor`` for a step without a batch), and compiles them only
through `step.make_function(model, fn)` or
`step.compile_replica_call(strategy, fn, what)`, never with its own
`tf.function`. Inside a replica step a policy:

1. computes gradients with `forward.forward` (the loss made exact over
   the global batch, loss scaling, the `Forward` record for metrics);
2. reduces each gradient exactly once -- the world-wide sum unless the
   variable carries its own reduction (`keras_comm.variables.annotations.gradient_hook`);
3. updates the weights, then calls `nontrainable.sync(model)` (replicas
   agree on the non-trainable state the forward updated);
4. returns `Forward.metrics(model)`, computed after the update, as upstream
   Keras does; the step owner reduces the logs across replicas.
"""

from keras_comm.training import accumulate
from keras_comm.training import accumulate_plan
from keras_comm.training import forward
from keras_comm.training import metrics
from keras_comm.training import nontrainable
from keras_comm.training import optimizer_shards
from keras_comm.training import pipeline
from keras_comm.training import reduction
from keras_comm.training import replicated
from keras_comm.training import step

# Older module names.
sharded_state = optimizer_shards
sharding = accumulate_plan

__all__ = [
    "accumulate",
    "accumulate_plan",
    "forward",
    "metrics",
    "nontrainable",
    "optimizer_shards",
    "pipeline",
    "reduction",
    "replicated",
    "step",
]
