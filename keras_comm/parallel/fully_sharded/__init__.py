"""Fully sharded data parallelism (ZeRO-3): `FullyShard` and `fully_shard`.

`FullyShard(layer)` wraps any Keras layer with weights. Every replica of the
shard group persistently holds 1/N of each of the layer's trainable weights
(flattened and padded, `keras_comm.variables.packing`); the full weights
exist only while the layer computes:

* **Forward**: one all-gather of the layer's packed shards (in the layer's
  compute dtype), the layer run on the gathered tensors
  (`Layer.stateless_call`), the gathered weights dropped.
* **Backward**: the shards are gathered again and the layer's forward is
  recomputed under a tape (nothing of the forward is kept but the inputs),
  then one reduce-scatter (SUM) of the packed full-weight gradients: each
  replica receives its shards' gradients already summed over the shard
  group. The input gradient flows on as usual.
* **Optimizer**: the shards are ordinary trainable weights of the model, so
  a plain Keras optimizer updates them and its slots are shard-sized. Each
  shard carries its own gradient reduction
  (`keras_comm.variables.annotations.set_gradient_hook`), which replaces the world all-reduce:
  nothing when the shard group is the world, a SUM over the replicas that
  hold the same shard otherwise (the other axes of a `Mesh`). No gradient is
  reduced twice.

With `prefetch` (the default) each gather may start one wrapped layer
early, to overlap the previous layer's compute: at most about two layers'
full weights are gathered at once.

The inner layer is built inside a `keras.StatelessScope`, so its own
variables are never allocated: they give the shapes, dtypes, initializers and
the checkpoint structure, nothing else. Non-trainable weights (BatchNorm's
moving statistics) are held whole on every replica and updated as in plain
data parallelism.

Gradient accumulation (`keras_comm.callbacks.ParallelOptimizer(
accumulation_steps=k)`) composes in two ways, chosen by `accumulation`:

* ``"sharded"`` (default): every micro-batch's gradient is reduce-scattered
  at once, and ParallelOptimizer accumulates the 1/N gradient shards.
  Memory stays 1/N; the reduce-scatter runs k times per update.
* ``"local"``: each replica adds its full-size local gradient into a padded
  buffer of the layer's size and reduce-scatters it once per update (on the
  k-th backward; the others hand zeros to the optimizer). One
  reduce-scatter per update, at the price of a full-size gradient buffer per
  layer on every replica. `accumulation_steps` must equal the callback's.

Saving: a `FullyShard` writes its inner layer's structure (its variables at
its own path, its sublayers' below it), every weight full-size, gathered from
the shards; so `.keras` / `save_weights` / `BackupAndRestore` files are what
the unwrapped model holds and loads, and any cluster size loads them. Keras
names a file's entries after the layers' classes ("fully_shard", "dense_1");
a wrapper given `checkpoint_name` (`fully_shard` sets it to the entry name
the unwrapped model uses) writes and reads its entry under that name, so the
file is the unwrapped model's: each loads the other's files directly.
Optimizer slots are written full-size in the unwrapped weight's shape
(`keras_comm.parallel._checkpoint`).

The package follows PyTorch FSDP2's layout: `_param` (how each weight is
split, its gradient hook, the accumulation modes), `_collectives` (gather,
prefetch, reduce-scatter), `_layer` (the `FullyShard` layer),
`_checkpoint_names` (its entries in a Keras file) and `_model` (wrapping a
whole model, its full weights and memory).
"""

from keras_comm.parallel.fully_sharded._layer import FullyShard
from keras_comm.parallel.fully_sharded._model import deferred_weights
from keras_comm.parallel.fully_sharded._model import full_weights
from keras_comm.parallel.fully_sharded._model import fully_shard
from keras_comm.parallel.fully_sharded._model import fully_sharded_layers
from keras_comm.parallel.fully_sharded._model import gathered
from keras_comm.parallel.fully_sharded._model import replica_state_bytes
from keras_comm.parallel.fully_sharded._model import set_checkpoint_names
from keras_comm.parallel.fully_sharded._model import set_full_weights
from keras_comm.parallel.fully_sharded._param import Accumulation
from keras_comm.parallel.fully_sharded._param import FlatShardSpec

__all__ = [
    "Accumulation",
    "FlatShardSpec",
    "FullyShard",
    "deferred_weights",
    "full_weights",
    "fully_shard",
    "fully_sharded_layers",
    "gathered",
    "replica_state_bytes",
    "set_checkpoint_names",
    "set_full_weights",
]
