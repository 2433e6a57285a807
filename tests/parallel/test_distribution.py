"""keras.distribution on TensorFlow (keras_comm.distribution), in one process.

Pure block maths first; then models built under logical-device strategies
and a `ModelParallel` / `DataParallel` distribution, trained on global
batches and compared with the same model trained alone
(tests/parallel/distribution_worker.py); then the errors a distribution
keras_comm cannot honour raises at build.
"""

import keras
import numpy as np
import pytest
import tensorflow as tf

import keras_comm
from conftest import make_strategy
from keras_comm.distribution import _blocks
import distribution_worker as W

RTOL = W.RTOL


# --- Blocks (pure) ----------------------------------------------------------------


def test_blocks_of_a_two_axis_layout():
    b = _blocks.resolve("w", (4, 6), ("model", "batch"), (2, 2), ("batch", "model"))
    assert b.block_shape == (2, 3)
    # rank = batch * 2 + model
    assert [b.block_index(r) for r in range(4)] == [(0, 0), (1, 0), (0, 1), (1, 1)]
    assert b.gather_group(0, 1).ranks == (0, 1)  # dimension 0 over "model"
    assert b.gather_group(1, 1).ranks == (1, 3)  # dimension 1 over "batch"
    assert b.data_group(1).ranks == (1,)  # every axis used: no replica shares a block
    full = np.arange(24).reshape(4, 6)
    blocks = {b.block_index(r): b.slice(full, r) for r in range(4)}
    np.testing.assert_array_equal(b.assemble(blocks.get, lambda p, a: np.concatenate(p, a)), full)


def test_blocks_of_a_one_axis_layout_have_a_data_group():
    b = _blocks.resolve("w", (8,), ("model",), (2, 2), ("batch", "model"))
    assert b.block_shape == (4,)
    assert b.data_group(1).ranks == (1, 3)
    assert b.gather_group(0, 2).ranks == (2, 3)
    both = _blocks.resolve("w", (8,), (("batch", "model"),), (2, 2), ("batch", "model"))
    assert [both.block_index(r) for r in range(4)] == [(0,), (1,), (2,), (3,)]


@pytest.mark.parametrize(
    "shape, axes, match",
    [
        ((4, 6), ("model",), "one entry .* per dimension"),
        ((4, 6), ("model", "seq"), "mesh axis 'seq', which the mesh does not have"),
        ((4, 6), ("model", "model"), "splits more than one dimension"),
        ((5, 6), ("model", None), r"divisible by 2. Received: w.shape\[0\]=5"),
        ((4, 6), (("model", "batch"), None), "in the mesh's order"),
    ],
)
def test_bad_layouts_name_the_weight_and_the_layout(shape, axes, match):
    with pytest.raises(ValueError, match=match) as info:
        _blocks.resolve("w", shape, axes, (2, 2), ("batch", "model"))
    assert "Weight 'w'" in str(info.value)


# --- Models ----------------------------------------------------------------------


# A mesh axis of size 1 splits nothing: under (4, 1) only d2's kernel
# (its dimension 1 over "batch") is split.
@pytest.mark.parametrize("mesh_shape, split", [((2, 2), 3), ((1, 4), 3), ((4, 1), 1)])
def test_model_parallel_mlp_equals_one_process(mesh_shape, split):
    out = W.train_and_compare(make_strategy(4), "mlp", mesh_shape)
    assert out["split"] == split and out["blocks_stored"], out
    # d1's kernel splits columns over "model" and d2's rows; under (4, 1)
    # d2's kernel is split over "batch" only: FSDP, gathered whole.
    # The split bias is always gathered on use.
    whole = ["mlp/d2/kernel"] if mesh_shape == (4, 1) else ["mlp/d1/bias"]
    assert out["gathered_whole"] == whole, out
    assert out["slots_split"] == 2 * split, out  # Adam's two moments per split weight
    assert out["stored_fraction"] < 0.9, out
    for key in ("initial", "loss", "weights", "predict", "saved_to_plain", "plain_to_split"):
        assert out[key] <= RTOL, (key, out)


# Llama's untied embedding gets a sparse gradient in the plain model and a
# dense one when its layout splits it: equal only because keras_comm sums a
# sparse gradient's repeated rows before Adam (tests/training/test_sparse_gradients.py).
@pytest.mark.parametrize("name", ["llama", "gemma"])
def test_kerashub_layout_maps_equal_one_process(name, kerashub_references):
    out = W.train_and_compare(make_strategy(4), name, (2, 2), reference_dir=kerashub_references)
    assert out["split"] >= 10 and out["blocks_stored"], out
    # Every split kernel computes split; Gemma's tied table is read whole by
    # its output projection (gathered on use).
    assert out["gathered_whole"] == W.EXPECTED_WHOLE[name], out
    for key in ("initial", "loss", "weights", "predict", "saved_to_plain", "plain_to_split"):
        assert out[key] <= W.bound(key), (key, out)
    assert out["generate_equal"], out


def test_data_parallel_gpt2_equals_one_process(kerashub_references):
    out = W.train_and_compare(
        make_strategy(2), "gpt2", None, mode="data", reference_dir=kerashub_references
    )
    assert out["split"] == 0, out
    for key in ("initial", "loss", "weights", "predict"):
        assert out[key] <= RTOL, (key, out)
    assert out["generate_equal"], out


# --- What cannot be honoured raises at build --------------------------------------


def _mp(mesh, key, axes):
    layout_map = keras.distribution.LayoutMap(mesh)
    layout_map[key] = axes
    return keras.distribution.ModelParallel(layout_map=layout_map, batch_dim_name="batch")


def test_a_mesh_larger_than_the_job_raises():
    strategy = make_strategy(2)
    mesh = keras.distribution.DeviceMesh((2, 2), ("batch", "model"), devices=[f"cpu:{i}" for i in range(4)])
    with strategy.scope(), _mp(mesh, "mlp/d1/kernel", (None, "model")).scope():
        with pytest.raises(ValueError, match="spans 4 devices, but the job has 2 replica"):
            W.mlp()


def test_a_dimension_that_does_not_divide_raises():
    strategy = make_strategy(4)
    mesh = keras.distribution.DeviceMesh((1, 4), ("batch", "model"), devices=keras_comm.distribution.list_devices(strategy))
    with strategy.scope(), _mp(mesh, "mlp/d1/kernel", ("model", None)).scope():
        with pytest.raises(ValueError, match=r"Weight 'mlp/d1/kernel' of shape \(6, 8\).*divisible by 4"):
            W.mlp()


def test_a_batch_dim_the_mesh_lacks_and_other_distributions_raise():
    strategy = make_strategy(2)
    devices = keras_comm.distribution.list_devices(strategy)
    mesh = keras.distribution.DeviceMesh((2,), ("model",), devices=devices)
    layout_map = keras.distribution.LayoutMap(mesh)
    dist = keras.distribution.ModelParallel(layout_map=layout_map, batch_dim_name="data")
    with strategy.scope(), dist.scope():
        with pytest.raises(ValueError, match="`batch_dim_name` must be an axis"):
            W.mlp()

    class Planned(keras.distribution.ModelParallel.__mro__[1]):  # keras.distribution's base
        def get_variable_layout(self, variable):
            return None

    with strategy.scope(), Planned(mesh).scope():
        with pytest.raises(TypeError, match="DataParallel and ModelParallel"):
            W.mlp()


def test_devices_in_another_order_raise():
    strategy = make_strategy(2)
    mesh = keras.distribution.DeviceMesh((1, 2), ("batch", "model"), devices=["cpu:1", "cpu:0"])
    with strategy.scope(), _mp(mesh, "mlp/d1/kernel", (None, "model")).scope():
        with pytest.raises(ValueError, match="in rank order"):
            W.mlp()


def test_without_a_distribution_nothing_changes():
    strategy = make_strategy(2)
    with strategy.scope():
        model = W.mlp()
    assert not any(keras_comm.distribution.is_sharded(v) for v in model.weights)
    assert all(tuple(v.value.shape) == tuple(v.shape) for v in model.weights)
