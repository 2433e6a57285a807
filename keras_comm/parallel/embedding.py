"""`ParallelEmbedding`: an embedding table split on the vocabulary."""

import keras
import tensorflow as tf

from keras_comm import _validation
from keras_comm.parallel import _collectives
from keras_comm.parallel import _common
from keras_comm.parallel import sharded_weights


@keras.saving.register_keras_serializable(package="keras_comm")
class ParallelEmbedding(_common.ParallelLayer):
    """Embedding whose table rows (the vocabulary) are split over a group.

    Forward: the model group all-gathers its token ids; member k looks up
    the ids in its rows ``[k * V/n, (k+1) * V/n)`` (zeros for other ids);
    a reduce-scatter along the batch sums the members' partial lookups and
    gives each member its own samples' embeddings. Backward (exact
    adjoint): dy is all-gathered, each member's table shard gets the
    (sparse) gradient of its own rows, summed over its data-parallel group
    only.

    Args:
        input_dim: vocabulary size; divisible by the group size.
        output_dim: embedding size.
        embeddings_initializer: initializer of the FULL table.
        mesh, axis, seed, timeout: see `ParallelLayer`.

    Input shape: int ids ``(batch, ...)``. Output shape ``(batch, ..., output_dim)``.

    Raises:
        ValueError: `input_dim` not divisible by the group size.
    """

    def __init__(
        self,
        input_dim,
        output_dim,
        embeddings_initializer="uniform",
        mesh=None,
        axis="model",
        seed=None,
        timeout=None,
        **kwargs,
    ):
        super().__init__(mesh=mesh, axis=axis, seed=seed, timeout=timeout, **kwargs)
        input_dim = _validation.positive_int(input_dim, "input_dim")
        self.output_dim = _validation.positive_int(output_dim, "output_dim")
        self.input_dim = self.split_size(input_dim, "input_dim")
        self.embeddings_initializer = keras.initializers.get(embeddings_initializer)

    def build(self, input_shape):
        self.split_size(self.input_dim, "input_dim", built=True)
        self.embeddings = sharded_weights.add_sharded_weight(
            self, "embeddings", (self.input_dim, self.output_dim), 0, self.mesh,
            self.axis, self.embeddings_initializer, self.weight_seed(0),
        )

    def call(self, inputs):
        group = self.group()
        ids = tf.cast(inputs, tf.int32)
        ids = _collectives.gather_batch(ids, group, self.name, self.timeout)
        rows = self.input_dim // group.size
        local = ids - group.index(_collectives.my_rank()) * rows
        mine = tf.logical_and(local >= 0, local < rows)
        table = tf.convert_to_tensor(self.embeddings)
        out = tf.gather(table, tf.where(mine, local, tf.zeros_like(local)))
        out = out * tf.cast(mine, out.dtype)[..., None]
        return _collectives.scatter_batch_sum(out, group, self.name, self.timeout)

    def compute_output_shape(self, input_shape):
        return tuple(input_shape) + (self.output_dim,)

    def get_config(self):
        config = super().get_config()
        config.update(
            input_dim=self.input_dim,
            output_dim=self.output_dim,
            embeddings_initializer=keras.initializers.serialize(self.embeddings_initializer),
        )
        return config
