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
  (`ParallelOptimizer`); its state lives in `sharded_state`, its update maths
  in the pure `accumulate.apply_update`, its layout and packing maths in
  `sharding` (pure Python and TensorFlow, no collectives).
* `pipeline` (imported on use: it needs `keras_comm.parallel`): the
  interleaved 1F1B step of a model whose last layer is a 1F1B
  `keras_comm.parallel.Pipeline`; `replicated.train_step` hands over to it.

Fully sharded parameters (`keras_comm.parallel.FullyShard`, ZeRO-3) need no
policy: the layer gathers its weights in its own forward and backward, and
its shards' gradients leave reduce-scattered, so their gradient hook
(step 2 below) has nothing left to reduce over the shard group.

The plug-in contract. A policy provides replica steps, ``fn(data) -> logs``
(or ``fn() -> tensor`` for a step without a batch), and compiles them only
through `step.make_function(model, fn)` or
`step.compile_replica_call(strategy, fn, what)`, never with its own
`tf.function`. Inside a replica step a policy:

1. computes gradients with `replicated.forward` (the loss made exact over
   the global batch, loss scaling, the `Forward` record for metrics);
2. reduces each gradient exactly once -- the world-wide sum unless the
   variable carries its own reduction (`reduction.gradient_hook`);
3. updates the weights, then calls `nontrainable.sync(model)` (replicas
   agree on the non-trainable state the forward updated);
4. returns `Forward.metrics(model)`, computed after the update, as upstream
   Keras does; the step owner reduces the logs across replicas.

Where future work plugs in:

* gradient bucketing or compression: `reduction` (the optimizer's path,
  `all_reduce_sum_gradients`) and `accumulate._contribution`/`_update`
  (which already reduce in 16 MiB buckets);
* taking the batch inside the compiled step (issue: the second-epoch
  stall): `step.make_function`.
"""

from keras_comm.training import accumulate
from keras_comm.training import metrics
from keras_comm.training import nontrainable
from keras_comm.training import reduction
from keras_comm.training import replicated
from keras_comm.training import sharded_state
from keras_comm.training import sharding
from keras_comm.training import step

__all__ = ["accumulate", "metrics", "nontrainable", "reduction", "replicated", "sharded_state", "sharding", "step"]
