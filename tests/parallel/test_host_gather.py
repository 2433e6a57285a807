"""The shared host gather (`sharded_weights.gather_values`), in one process.

`full_weights`, `save_weights` and `save` of FullyShard and tensor-parallel
models (and a Pipeline's optimizer slots) cut every full value out of one
all-gather per dtype and shard grouping. Each check compares it with the value assembled on the host
from the replicas' components (all 4 are local here, component i is rank i):
a Pipeline's stage buffer (`StageBufferSpec`) next to tensor-parallel
weights of the same mesh, whose model groups differ; and weights split by a
`keras.distribution` layout (no shard spec) next to sharded ones, which
must read as their full host values, not a replica's block.
"""

import keras
import numpy as np
import pytest

from conftest import make_strategy
from keras_comm import parallel as P
from keras_comm.parallel import sharded_weights
import distribution_worker as W


def _expected(variable, spec):
    """Rank 0's gather: its model group's components joined in rank order."""
    comps = [c.numpy() for c in sharded_weights.components(variable)]
    with sharded_weights.strategy_of([variable]).scope():  # the world is the strategy's
        ranks = spec.model_group(0).ranks
    return np.concatenate([comps[r] for r in ranks], axis=spec.shard_axis)


@pytest.mark.inprocess
def test_a_stage_buffer_is_gathered_whole_beside_tensor_parallel_weights():
    strategy = make_strategy(4)
    mesh = P.Mesh((2, 2), ("pipeline", "model"))
    keras.utils.set_random_seed(0)
    with strategy.scope():
        stages = [
            keras.Sequential([
                P.ColumnParallelDense(8, mesh=mesh, axis="model", name="hg_column"),
                P.RowParallelDense(6, mesh=mesh, axis="model", name="hg_row"),
            ], name="hg_stage0"),
            keras.layers.Dense(5, name="hg_stage1"),
        ]
        pipeline = P.Pipeline(stages, 2, "1f1b", mesh=mesh, name="hg_pipeline")
        model = keras.Sequential([
            keras.Input((3,)),
            P.ColumnParallelDense(4, mesh=mesh, axis="model", name="hg_outside"),
            pipeline,
        ])
    buffer = pipeline._buffer
    outside = model.layers[0].weights
    pairs = [(buffer, sharded_weights.shard_spec(buffer))]
    pairs += [(w, sharded_weights.shard_spec(w)) for w in outside]
    # The stage buffer's group is all 4 replicas (both axes vary), the
    # Column layer's one "model" pair: two groupings in one call.
    with strategy.scope():
        assert pairs[0][1].model_group(0).size == 4 and pairs[1][1].model_group(0).size == 2
    values = sharded_weights.gather_values(pairs)
    for (v, spec), got in zip(pairs, values):
        np.testing.assert_array_equal(got, _expected(v, spec))
    # Its rows whole: the buffer's spec turns them into the unsplit layout,
    # the stages' full weights one after another.
    full_stages = P.full_weights(pipeline)
    np.testing.assert_array_equal(
        pairs[0][1].to_full(values[0]), np.concatenate([np.ravel(w) for w in full_stages])
    )


@pytest.mark.inprocess
def test_layout_map_weights_read_whole_beside_sharded_weights():
    strategy = make_strategy(4)
    ref = W.mlp()
    dist = W.distribution_for("mlp", (2, 2), "model", strategy)
    with strategy.scope():
        with dist.scope():
            model = W.mlp()
        column = P.ColumnParallelDense(4, name="hg_column_1d")
        column.build((None, 3))
    split = W.split_weights(model)
    assert split and all(tuple(v.value.shape) != tuple(v.shape) for v in split)
    # A mixed list: the layout-map weights are plain to sharded_weights.
    weights = list(model.weights) + list(column.weights)
    values = sharded_weights.full_weights_of(weights)
    for got, want in zip(values[: len(model.weights)], ref.get_weights(), strict=True):
        np.testing.assert_array_equal(got, want)
    for w, got in zip(column.weights, values[len(model.weights):], strict=True):
        np.testing.assert_array_equal(got, _expected(w, sharded_weights.shard_spec(w)))
    # gather_values reads an unsharded weight as its host value.
    pairs = [(w, sharded_weights.shard_spec(w)) for w in weights]
    for got, want in zip(sharded_weights.gather_values(pairs), values, strict=True):
        np.testing.assert_array_equal(got, want)
