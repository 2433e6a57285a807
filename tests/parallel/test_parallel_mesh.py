"""keras_comm.parallel without a cluster: Mesh, routing maths, argument
errors, configs, save/load in a world of one, and the optimizer-hook guard."""

import keras
import numpy as np
import pytest
import tensorflow as tf

import keras_comm
from keras_comm import parallel as P
from keras_comm.parallel import moe
import parallel_worker as cases


def test_mesh_groups_row_major():
    mesh = P.Mesh(shape=(2, 2), axes=("data", "model"))
    assert [g.ranks for g in mesh.groups("model")] == [(0, 1), (2, 3)]
    assert [g.ranks for g in mesh.groups("data")] == [(0, 2), (1, 3)]
    assert mesh.group("data", rank=3).ranks == (1, 3)
    assert mesh.other_axes_group("model", rank=1).ranks == (1, 3)
    assert mesh.coordinates(2) == (1, 0)
    assert P.Mesh.from_config(mesh.get_config()) == mesh


def test_mesh_from_groups_and_config():
    mesh = P.Mesh.from_groups([[0, 2], [1, 3]])
    assert [g.ranks for g in mesh.groups("model")] == [(0, 2), (1, 3)]
    assert [g.ranks for g in mesh.groups("data")] == [(0, 1), (2, 3)]
    assert P.Mesh.from_config(mesh.get_config()) == mesh


@pytest.mark.parametrize(
    "kwargs, error, text",
    [
        (dict(shape=(2, 0), axes=("a", "b")), ValueError, "Received: shape=(2, 0)"),
        (dict(shape=(2, 2), axes=("a",)), ValueError, "Received: axes=('a',)"),
        (dict(shape=(2, 2), axes=("a", "a")), ValueError, "distinct"),
        (dict(shape=4, axes=("a",)), TypeError, "Received: shape=4"),
    ],
)
def test_mesh_bad_arguments(kwargs, error, text):
    with pytest.raises(error, match=None) as info:
        P.Mesh(**kwargs)
    assert text in str(info.value)


def test_mesh_not_matching_world():
    with pytest.raises(ValueError, match=r"spans 4 replicas, but 1 replica\(s\).*Received: shape=\(2, 2\)"):
        P.Mesh((2, 2), ("data", "model")).check_world(1)


def test_group_overlap_is_an_error():
    with pytest.raises(ValueError, match=r"overlap: rank 1 .*Received: groups=\[\[0, 1\], \[1, 2\]\]"):
        P.Mesh.from_groups([[0, 1], [1, 2]])
    with pytest.raises(ValueError, match="overlap"):
        P.ColumnParallelDense(4, mesh=[[0, 1], [1, 2]])
    with pytest.raises(ValueError, match="cover ranks 0..3"):
        P.Mesh.from_groups([[0, 1], [2, 4]])


def test_units_not_divisible_by_group_size():
    mesh = P.Mesh((2, 2), ("data", "model"))
    with pytest.raises(ValueError, match=r"`units` must be divisible by the 'model' group size 2. Received: units=5"):
        P.ColumnParallelDense(5, mesh=mesh)
    with pytest.raises(ValueError, match=r"Received: input_dim=7"):
        P.ParallelEmbedding(7, 3, mesh=mesh)
    with pytest.raises(ValueError, match=r"Received: num_experts=3"):
        P.MixtureOfExperts(3, 2, mesh=mesh)
    with pytest.raises(ValueError, match=r"Received: top_k=4"):
        P.MixtureOfExperts(2, 2, top_k=4)
    with pytest.raises(ValueError, match=r"Received: capacity_factor=0"):
        P.MixtureOfExperts(2, 2, capacity_factor=0)
    with pytest.raises(ValueError, match=r"Received: stages=\(0, 2\)"):
        P.PipelineStage(keras.layers.Dense(2), keras.layers.Dense(2), stages=(0, 2))
    with pytest.raises(ValueError, match=r"Received: num_micro_batches=0"):
        P.PipelineStage(keras.layers.Dense(2), keras.layers.Dense(2), num_micro_batches=0)


def test_route_capacity_and_priority():
    # 4 tokens, 2 experts, top-1, capacity 1: tokens 0 and 1 both pick
    # expert 0: token 0 keeps its slot, token 1 is dropped.
    probs = tf.constant([[0.9, 0.1], [0.8, 0.2], [0.3, 0.7], [0.4, 0.6]], tf.float64)
    dispatch, combine = moe.route(probs, 1, 1)
    np.testing.assert_array_equal(dispatch.numpy().sum(-1), [[1, 0], [0, 0], [0, 1], [0, 0]])
    np.testing.assert_allclose(combine.numpy()[0, 0, 0], 0.9)
    # top-2, capacity 2: second choices queue behind every first choice.
    dispatch, _ = moe.route(probs, 2, 2)
    keep = dispatch.numpy().sum(-1)
    np.testing.assert_array_equal(keep, cases.reference_keep(probs.numpy(), 2, 2))
    assert int(moe.capacity(6, 4, 2, 0.75)) == 3


def test_world_of_one_matches_keras_and_saves(tmp_path):
    """Outside any strategy the layers are their unsplit selves."""
    x, y = cases.tp_data(8)
    keras.utils.set_random_seed(0)
    ref = cases.tp_model(False)
    model = cases.tp_model(True)
    model.set_weights(ref.get_weights())
    np.testing.assert_allclose(model.predict(x, verbose=0), ref.predict(x, verbose=0), rtol=1e-6)
    path = str(tmp_path / "tp.keras")
    model.save(path)
    loaded = keras.saving.load_model(path)
    np.testing.assert_allclose(loaded.predict(x, verbose=0), model.predict(x, verbose=0), rtol=1e-6)
    for layer in model.layers:
        if isinstance(layer, P.ColumnParallelDense):
            assert type(layer).from_config(layer.get_config()).get_config() == layer.get_config()


def test_sharded_initializer_is_seeded_full_weight():
    layer = P.ColumnParallelDense(4, seed=7)
    layer.build((None, 3))
    expected = keras.initializers.GlorotUniform(seed=7)((3, 4))
    np.testing.assert_array_equal(layer.kernel.numpy(), np.asarray(expected))
    assert P.shard_spec(layer.kernel).full_shape == (3, 4)


def test_optimizer_hook_installed():
    # The hashes of the optimizer code the hook wraps and relies on
    # (_all_reduce_sum_gradients, _backend_update_step) are checked per Keras
    # version in tests/compat/test_private_api.py.
    from keras_comm import compat
    from keras_comm._private import keras_api

    assert keras_api.current_gradient_reduction() is compat._all_reduce_sum_gradients
