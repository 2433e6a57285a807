"""The shared host gather (`sharded_weights.gather_values`), in one process.

`full_weights`, `save_weights` and `save` of FullyShard and tensor-parallel
models (and a Pipeline's optimizer slots) cut every full value out of one
all-gather per dtype and shard grouping, at most `GATHER_BYTES` at a time.
Each check compares it with the value assembled on the host
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



@pytest.mark.inprocess
def test_values_are_gathered_in_bounded_batches_one_batch_at_a_time(tmp_path, monkeypatch):
    """`iter_gather_values` gathers at most GATHER_BYTES of full values at
    once (a larger variable alone) and yields each batch's values before it
    gathers the next, so a save that writes each value as it comes holds one
    batch, not every weight and optimizer slot; the values and the saved
    file are the ones gathered at once."""
    strategy = make_strategy(2)
    keras.utils.set_random_seed(0)
    with strategy.scope():
        model = keras.Sequential([keras.Input((64,))] + [
            layer(64, name=f"hg_batch{i}")
            for i, layer in enumerate([P.ColumnParallelDense, P.RowParallelDense] * 2)
        ])
        model.compile(optimizer="adam", loss="mse")
    x = np.random.RandomState(0).randn(4, 64).astype("float32")
    model.fit(x, x[:, :64], batch_size=4, verbose=0)
    pairs = [(w, sharded_weights.shard_spec(w)) for w in model.weights]
    whole = sharded_weights.gather_values(pairs)
    events = []
    original = sharded_weights._host_gather_fn

    def recording(strategy, grouping, name):
        fn = original(strategy, grouping, name)

        def gather(flats):
            events.append(("gather", int(flats.values[0].shape[0]) * 2 * 4))  # 2 shards, float32
            return fn(flats)

        return gather

    monkeypatch.setattr(sharded_weights, "_host_gather_fn", recording)
    # A kernel is 16 KiB in full, a split bias 256 B: a 20 KiB bound
    # gathers one kernel (and the column layer's bias) at a time.
    monkeypatch.setattr(sharded_weights, "GATHER_BYTES", 20 * 2**10)
    for i, value in sharded_weights.iter_gather_values(pairs):
        events.append(("value", i))
        np.testing.assert_array_equal(value, whole[i])
    gathers = [size for kind, size in events if kind == "gather"]
    assert len(gathers) == 4 and max(gathers) <= 20 * 2**10, events
    # Each batch's values come before the next gather.
    kinds = [kind for kind, _ in events]
    assert all(kinds[j - 1] == "value" for j, kind in enumerate(kinds) if kind == "gather" and j), kinds
    assert sorted(i for kind, i in events if kind == "value") == list(range(len(pairs))), events
    monkeypatch.setattr(sharded_weights, "GATHER_BYTES", 2**40)
    events.clear()
    assert len(list(sharded_weights.iter_gather_values(pairs))) == len(pairs)
    assert [kind for kind, _ in events].count("gather") == 1, events
    # The optimizer's slots too: a save in batches writes what one gather writes.
    for bound, name in ((20 * 2**10, "batches"), (2**40, "once")):
        monkeypatch.setattr(sharded_weights, "GATHER_BYTES", bound)
        model.save_weights(str(tmp_path / f"{name}.weights.h5"))
    import h5py

    def entries(path):
        out = {}
        with h5py.File(path, "r") as f:
            f.visititems(lambda k, v: out.__setitem__(k, v[()]) if isinstance(v, h5py.Dataset) else None)
        return out

    batches, once = entries(tmp_path / "batches.weights.h5"), entries(tmp_path / "once.weights.h5")
    assert sorted(batches) == sorted(once) and any("optimizer" in k for k in once), sorted(once)
    for key in once:
        np.testing.assert_array_equal(batches[key], once[key])
