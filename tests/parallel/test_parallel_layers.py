"""keras_comm.parallel on in-process replicas (logical CPU devices): model.fit
of tensor-parallel (2 and 2 x 2) models vs the unsplit model, memory per
replica, mixture of experts vs a dense simulation, the 2-stage pipeline.

The scenarios live in tests/parallel/parallel_worker.py and also run across
real processes (tests/parallel/test_parallel_multiprocess.py).
"""

import keras
import numpy as np
import pytest
import tensorflow as tf

import keras_comm
from keras_comm import parallel as P
from conftest import make_strategy
import parallel_worker as cases


@pytest.mark.inprocess
@pytest.mark.parametrize("n, mesh", [(2, None), (4, (2, 2))], ids=["tp2", "dp2xtp2"])
def test_tensor_parallel_fit_matches_unsplit(n, mesh):
    mesh = P.Mesh(mesh, ("data", "model")) if mesh else None
    got = cases.tp_fit(make_strategy(n), mesh)
    assert got["num_sharded"] == 4  # embedding, column kernel + bias, row kernel
    assert got["loss_rel"] <= cases.RTOL, got
    assert got["weights_rel"] <= cases.RTOL, got
    assert got["evaluate_rel"] <= cases.RTOL, got
    assert got["predict_rel"] <= cases.RTOL, got
    # Memory: every replica holds exactly 1/group of every sharded weight.
    assert got["shard_fractions"] == [1 / got["group_size"]], got


@pytest.mark.inprocess
@pytest.mark.parametrize("zero_stage", [0, 1])
def test_tensor_parallel_fit_with_parallel_optimizer(zero_stage):
    """Sharded weights keep their own (group) reduction under the callback.

    The callback packs and (with ZeRO-1) shards the mirrored weights' state,
    while the sharded weights go through their own reduction hook once and
    are updated whole: a world-wide sum would double their gradient.

    SGD with momentum, not Adam: the embedding's gradient is sparse, and
    Keras's Adam squares an IndexedSlices gradient row by row *before*
    summing duplicate rows, while the callback sums first (the dense
    gradient's Adam). Momentum SGD is linear in the gradient, so both agree.
    """
    callback = keras_comm.callbacks.ParallelOptimizer(zero_stage=zero_stage)
    got = cases.tp_fit(
        make_strategy(2),
        None,
        callbacks=[callback],
        optimizer=lambda: keras.optimizers.SGD(0.1, momentum=0.9),
    )
    assert got["weights_rel"] <= cases.RTOL, got
    assert got["loss_rel"] <= cases.RTOL, got


@pytest.mark.inprocess
def test_shards_differ_per_replica_and_gather_to_the_seeded_weight():
    strategy = make_strategy(2)
    with strategy.scope():
        layer = P.ColumnParallelDense(4, seed=3, use_bias=False)
        layer.build((None, 3))
    full = np.asarray(keras.initializers.GlorotUniform(seed=3)((3, 4)))
    shards = P.process_shards(layer.kernel)
    np.testing.assert_array_equal(shards[0], full[:, :2])
    np.testing.assert_array_equal(shards[1], full[:, 2:])
    np.testing.assert_array_equal(P.full_weights(layer)[0], full)
    P.assign_process_shards(layer.kernel, {1: np.ones((3, 2))})
    np.testing.assert_array_equal(P.full_weights(layer)[0][:, 2:], 1.0)
    # The names before the rename still work.
    assert (P.local_shards, P.assign_local_shards) == (P.process_shards, P.assign_process_shards)


@pytest.mark.inprocess
def test_column_gather_output_equals_dense():
    strategy = make_strategy(2)
    x = np.random.RandomState(0).randn(4, 3).astype("float32")
    dense = keras.layers.Dense(6, activation="relu")
    dense.build((None, 3))
    with strategy.scope():
        inp = keras.Input((3,))
        model = keras.Model(inp, P.ColumnParallelDense(6, activation="relu", gather_output=True)(inp))
    P.set_full_weights(model, dense.get_weights())
    np.testing.assert_allclose(model.predict(x, batch_size=4, verbose=0), dense(x), rtol=1e-6)


@pytest.mark.inprocess
def test_mesh_not_matching_world_at_build():
    strategy = make_strategy(2)
    with strategy.scope(), pytest.raises(ValueError, match=r"spans 4 replicas, but 2"):
        P.RowParallelDense(4, mesh=P.Mesh((2, 2), ("data", "model"))).build((None, 4))
    with strategy.scope(), pytest.raises(ValueError, match="Received: units=3"):
        P.ColumnParallelDense(3).build((None, 4))


@pytest.mark.inprocess
@pytest.mark.parametrize("n, mode", [(2, "eager"), (2, "function"), (4, "function")])
def test_moe_matches_dense_simulation(n, mode):
    got = cases.moe_check(make_strategy(n), mode=mode)
    assert got["dropped"] > 0  # the capacity limit is exercised
    for name, err in got["errors"].items():
        assert err <= 1e-9, (name, got)


@pytest.mark.inprocess
def test_moe_wrong_backward_would_fail():
    """The check can fail: a capacity that drops nothing changes the output."""
    got = cases.moe_check(make_strategy(2), capacity_factor=4.0)
    assert got["dropped"] == 0 and got["errors"]["forward"] <= 1e-9
    probs = tf.constant([[0.9, 0.1], [0.8, 0.2]], tf.float64)
    assert not np.array_equal(
        cases.reference_keep(probs.numpy(), 1, 1), cases.reference_keep(probs.numpy(), 1, 2)
    )


@pytest.mark.inprocess
def test_pipeline_fit_matches_single_process():
    got = cases.pipeline_fit(make_strategy(2))
    assert got["loss_rel"] <= cases.RTOL and got["weights_rel"] <= cases.RTOL, got
