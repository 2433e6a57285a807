"""Model parallelism for `model.fit`: per-replica (sharded) weights, meshes,
tensor-parallel dense and embedding layers, mixture of experts, pipelines,
fully sharded layers.

The modules, one concern each:

* `mesh`: `Mesh`, the replicas as a grid of named axes;
* `sharded_weights`: weights of which each replica holds one slice
  (`ShardSpec`, `add_sharded_weight`, `gather_full`, process shards);
* `dense`, `embedding`, `moe`: the tensor- and expert-parallel layers;
* `pipeline`, `schedules`, `pipeline_stage`: pipeline parallelism;
* `fully_sharded`: `FullyShard` and `fully_shard` (ZeRO-3), and the model-wide
  `full_weights` / `set_full_weights`, which cover every kind of weight.

Older names, importable and not listed in `__all__`: `local_shards` and
`assign_local_shards` (now `process_shards`, `assign_process_shards`), and
the modules `sharded` (now `sharded_weights`) and `flat_shard` (now
`fully_sharded`'s per-weight layout and `keras_comm.variables.packing`).
"""

from keras_comm.parallel import schedules
from keras_comm.parallel.dense import ColumnParallelDense
from keras_comm.parallel.dense import RowParallelDense
from keras_comm.parallel.embedding import ParallelEmbedding
from keras_comm.parallel.fully_sharded import Accumulation
from keras_comm.parallel.fully_sharded import FlatShardSpec
from keras_comm.parallel.fully_sharded import FullyShard
from keras_comm.parallel.fully_sharded import full_weights
from keras_comm.parallel.fully_sharded import deferred_weights
from keras_comm.parallel.fully_sharded import fully_shard
from keras_comm.parallel.fully_sharded import gathered
from keras_comm.parallel.fully_sharded import replica_state_bytes
from keras_comm.parallel.fully_sharded import set_checkpoint_names
from keras_comm.parallel.fully_sharded import set_full_weights
from keras_comm.parallel.mesh import Mesh
from keras_comm.parallel.moe import MixtureOfExperts
from keras_comm.parallel.pipeline import Pipeline
from keras_comm.parallel.pipeline_stage import PipelineStage
from keras_comm.parallel.sharded_weights import ShardSpec
from keras_comm.parallel.sharded_weights import add_sharded_weight
from keras_comm.parallel.sharded_weights import assign_process_shards
from keras_comm.parallel.sharded_weights import gather_full
from keras_comm.parallel.sharded_weights import is_sharded
from keras_comm.parallel.sharded_weights import process_shards
from keras_comm.parallel.sharded_weights import shard_nbytes
from keras_comm.parallel.sharded_weights import shard_spec

# Older names (see the module docstring).
from keras_comm.parallel import sharded_weights as sharded  # noqa: E402
from keras_comm.parallel.fully_sharded import _param as flat_shard  # noqa: E402
from keras_comm.parallel.sharded_weights import assign_local_shards  # noqa: E402
from keras_comm.parallel.sharded_weights import local_shards  # noqa: E402

__all__ = [
    "Accumulation",
    "ColumnParallelDense",
    "FlatShardSpec",
    "FullyShard",
    "Mesh",
    "MixtureOfExperts",
    "ParallelEmbedding",
    "Pipeline",
    "PipelineStage",
    "RowParallelDense",
    "ShardSpec",
    "add_sharded_weight",
    "deferred_weights",
    "assign_process_shards",
    "full_weights",
    "fully_shard",
    "gather_full",
    "gathered",
    "is_sharded",
    "process_shards",
    "replica_state_bytes",
    "schedules",
    "set_checkpoint_names",
    "set_full_weights",
    "shard_nbytes",
    "shard_spec",
]
