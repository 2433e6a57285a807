"""Model parallelism for `model.fit`: per-replica (sharded) weights, meshes,
tensor-parallel dense and embedding layers, mixture of experts, pipelines.

See `keras_comm.parallel.sharded` for how sharded weights stay per replica
under `tf.distribute.MultiWorkerMirroredStrategy`.
"""

from keras_comm.parallel.dense import ColumnParallelDense
from keras_comm.parallel.dense import RowParallelDense
from keras_comm.parallel.embedding import ParallelEmbedding
from keras_comm.parallel.mesh import Mesh
from keras_comm.parallel.moe import MixtureOfExperts
from keras_comm.parallel.pipeline import PipelineStage
from keras_comm.parallel.pipeline import Pipeline
from keras_comm.parallel import schedules
from keras_comm.parallel.sharded import ShardSpec
from keras_comm.parallel.sharded import add_sharded_weight
from keras_comm.parallel.sharded import assign_local_shards
from keras_comm.parallel.sharded import assign_process_shards
from keras_comm.parallel.sharded import full_weights
from keras_comm.parallel.sharded import gather_full
from keras_comm.parallel.sharded import is_sharded
from keras_comm.parallel.sharded import local_shards
from keras_comm.parallel.sharded import process_shards
from keras_comm.parallel.sharded import set_full_weights
from keras_comm.parallel.sharded import shard_nbytes
from keras_comm.parallel.sharded import shard_spec
# Fully sharded layers; their full_weights / set_full_weights also handle the
# tensor-parallel weights above (they replace those two names).
from keras_comm.parallel.flat_shard import FlatShardSpec
from keras_comm.parallel.fully_sharded import Accumulation
from keras_comm.parallel.fully_sharded import FullyShard
from keras_comm.parallel.fully_sharded import full_weights  # noqa: F811
from keras_comm.parallel.fully_sharded import fully_shard
from keras_comm.parallel.fully_sharded import replica_state_bytes
from keras_comm.parallel.fully_sharded import set_full_weights  # noqa: F811
from keras_comm.parallel.fully_sharded import set_checkpoint_names

__all__ = [
    "ColumnParallelDense",
    "Mesh",
    "MixtureOfExperts",
    "ParallelEmbedding",
    "PipelineStage",
    "Pipeline",
    "schedules",
    "RowParallelDense",
    "ShardSpec",
    "add_sharded_weight",
    "assign_local_shards",
    "assign_process_shards",
    "full_weights",
    "gather_full",
    "is_sharded",
    "local_shards",
    "process_shards",
    "set_full_weights",
    "shard_nbytes",
    "shard_spec",
    "Accumulation",
    "FlatShardSpec",
    "FullyShard",
    "fully_shard",
    "replica_state_bytes",
    "set_checkpoint_names",
]
