"""`keras_comm.parallel.Pipeline` on in-process replicas: exact against the unsplit model.

Every check trains the pipelined model with `model.fit` for two steps and the
unsplit model (the same layers in one Sequential, the same initial weights)
in one process on the same global batches, and compares the weights
(<= 1e-5 relative). Cross-worker runs are in test_pipeline_multiprocess.py.
"""

import keras
import numpy as np
import pytest
import tensorflow as tf

import keras_comm
from _pipeline_cases import bn_stages
from _pipeline_cases import bn_unsplit
from _pipeline_cases import data_group_steps
from _pipeline_cases import micro_batch_steps
from conftest import make_strategy
from keras_comm._private import keras_api
from keras_comm.callbacks import ParallelOptimizer
from keras_comm.parallel import ColumnParallelDense
from keras_comm.parallel import Mesh
from keras_comm.parallel import RowParallelDense
from keras_comm.parallel import Pipeline
from keras_comm.parallel import full_weights
from keras_comm.parallel import set_full_weights

WIDTHS = (5, 6, 4, 7)  # stage s: Dense(WIDTHS[s]); unequal stage sizes


def _stages(p):
    return [keras.layers.Dense(WIDTHS[s], activation="tanh") for s in range(p)]


def _models(p, m, schedule, strategy, post=False, mesh=None):
    layers = [keras.Input((3,)), keras.layers.Dense(4)]
    tail = [keras.layers.Dense(2)] if post else []
    with strategy.scope():
        model = keras.Sequential(
            layers + [Pipeline(_stages(p), num_micro_batches=m, schedule=schedule, mesh=mesh)] + tail
        )
        model.compile(optimizer=keras.optimizers.SGD(0.1), loss="mse", metrics=["mae"])
    ref = keras.Sequential([keras.Input((3,)), keras.layers.Dense(4)] + _stages(p) + [keras.layers.Dense(2)] * post)
    ref.compile(optimizer=keras.optimizers.SGD(0.1), loss="mse", metrics=["mae"])
    ref.set_weights(full_weights(model))
    return model, ref


def _data(global_batch, out):
    rng = np.random.default_rng(0)
    x = rng.normal(size=(2 * global_batch, 3)).astype("float32")
    y = rng.normal(size=(2 * global_batch, out)).astype("float32")
    return x, y


def _rel(a, b):
    return float(np.max(np.abs(a - b)) / max(np.max(np.abs(b)), 1e-12))


def _check_exact(model, ref, x, y, batch):
    h = model.fit(x, y, batch_size=batch, epochs=1, shuffle=False, verbose=0).history
    h_ref = ref.fit(x, y, batch_size=batch, epochs=1, shuffle=False, verbose=0).history
    got, want = full_weights(model), ref.get_weights()
    assert [w.shape for w in got] == [w.shape for w in want]
    assert max(_rel(a, b) for a, b in zip(got, want)) <= 1e-5
    assert h["loss"][0] == pytest.approx(h_ref["loss"][0], rel=1e-5)
    assert h["mae"][0] == pytest.approx(h_ref["mae"][0], rel=1e-5)
    np.testing.assert_allclose(
        model.predict(x, batch_size=batch, verbose=0), ref.predict(x, verbose=0), rtol=1e-5, atol=1e-6
    )


# (p, m, schedule, layers after the pipeline), one case per code path (the
# schedules' tables themselves -- every p, m, both schedules -- are checked
# by simulation in test_schedules.py; p = 2 with m = 1, 4 (and 8 under
# KERAS_COMM_FULL_GRID=1), p = 4 with both schedules and the 1F1B table as a
# layer run on real workers in test_pipeline_multiprocess.py):
GRID = [
    # The 1F1B training step (training/pipeline.py): a steady state (m >= p,
    # backward 0 before forward p) and a middle stage that receives and
    # sends both activations and gradients.
    (3, 4, "1f1b", False),
    # The layer's path (forward half in call, backward half as its custom
    # gradient), with a middle stage and a layer after the pipeline whose
    # gradient enters the backward half.
    (3, 2, "gpipe", True),
]


def _compute_order(instructions):
    return [(op.kind, op.micro_batch) for op in instructions if op.kind in ("forward", "backward")]


@pytest.mark.parametrize("p, m, schedule, post", GRID)
def test_pipeline_trains_exactly_as_the_unsplit_model(p, m, schedule, post):
    strategy = make_strategy(p)
    model, ref = _models(p, m, schedule, strategy, post=post)
    x, y = _data(2 * p * m, 2 if post else WIDTHS[p - 1])
    _check_exact(model, ref, x, y, batch=2 * p * m)
    # What stage 0 traced for training: the whole 1F1B table (interleaved)
    # when the pipeline is the model's last layer, else the forward and the
    # backward halves (GPipe's order).
    layer = [lay for lay in model.layers if isinstance(lay, Pipeline)][0]
    table = keras_comm.parallel.schedules.train_schedule(schedule, p, m)[0]
    runs = layer._traced_instructions[0]
    if schedule == "1f1b" and not post:
        assert table in runs
        if m >= p:
            order = _compute_order(table)
            assert order.index(("backward", 0)) < order.index(("forward", p))
    else:
        assert keras_comm.parallel.schedules.forward_only(table) in runs
        assert keras_comm.parallel.schedules.backward_only(table) in runs


def test_each_replica_holds_only_its_stage():
    p = 4
    strategy = make_strategy(p)
    model, _ = _models(p, 2, "1f1b", strategy)
    layer = model.layers[1]
    stage_sizes = [layer.stage_nbytes(s) // 4 for s in range(p)]
    assert stage_sizes == [4 * 5 + 5, 5 * 6 + 6, 6 * 4 + 4, 4 * 7 + 7]
    # The replica's trainable parameters: the layers around the pipeline
    # and one buffer as large as the largest stage, not all stages.
    (buffer,) = [v for v in model.trainable_variables if "stage_weights" in v.path]
    assert buffer.shape == (max(stage_sizes),)
    per_replica = sum(int(np.prod(v.shape)) for v in model.trainable_variables)
    assert per_replica == 3 * 4 + 4 + max(stage_sizes)
    # Each replica's component holds its own stage's weights (then padding).
    comps = keras_comm.parallel.process_shards(buffer)
    values = layer.full_values()
    for s in range(p):
        flat = np.concatenate([np.ravel(v) for v in values[2 * s : 2 * s + 2]])  # kernel, bias
        np.testing.assert_array_equal(comps[s][: flat.size], flat)
        assert not comps[s][flat.size :].any()


def test_the_stage_layers_never_allocate_their_own_weights():
    # The buffer holds the stage values; the stage layers' variables stay
    # shape-only through build, fit, predict and full_weights. (Keras
    # allocates variables made in a StatelessScope when the next outermost
    # one closes -- the first traced step opens one -- which would give every
    # replica the whole model besides its buffer.)
    p = 2
    strategy = make_strategy(p)
    model, _ = _models(p, 2, "1f1b", strategy)
    x, y = _data(8, WIDTHS[p - 1])
    model.fit(x, y, batch_size=8, epochs=1, verbose=0)
    model.predict(x, batch_size=8, verbose=0)
    full_weights(model)
    stage_vars = [v for stage in model.layers[1].stage_layers() for v in stage.variables]
    assert stage_vars
    allocated = [v.path for v in stage_vars if not keras_api.is_uninitialized(v)]
    assert allocated == [], allocated


# Pipeline x data parallel (a stage's gradient reduced over its data group
# only): in process through the layer's path in
# test_parallel_optimizer_accumulates_and_shards_with_a_pipeline and
# test_batch_normalization_statistics_agree_over_the_stages_data_group; the
# 1F1B step on a 2 x 2 mesh of real workers (test_pipeline_multiprocess.py).


def _tp_models(mesh, schedule, m):
    """Stage 0 is Megatron's MLP split over the mesh's "model" axis."""
    strategy = make_strategy(4)
    adam = lambda: keras.optimizers.Adam(0.01)  # noqa: E731  (moments per shard)
    # Fixed seed and names: unseeded shards draw from their weights' paths, so
    # without them the initial values (and how far Adam's first step, g/(|g|+eps)
    # for a near-zero g, amplifies summation order) followed the test order of
    # the pytest worker (one CI run: 9.9e-5 against 1e-5; others passed).
    keras.utils.set_random_seed(0)
    with strategy.scope():
        stages = [
            keras.Sequential([
                ColumnParallelDense(8, activation="relu", mesh=mesh, axis="model", name="tp_column"),
                RowParallelDense(6, mesh=mesh, axis="model", name="tp_row"),
            ], name="tp_stage0"),
            keras.layers.Dense(5, activation="tanh", name="tp_stage1"),
        ]
        model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(4, name="tp_first"),
                                  Pipeline(stages, m, schedule, mesh=mesh, name="tp_pipeline")],
                                 name="tp_model")
        model.compile(optimizer=adam(), loss="mse", metrics=["mae"])
    ref = keras.Sequential([
        keras.Input((3,)), keras.layers.Dense(4), keras.layers.Dense(8, activation="relu"),
        keras.layers.Dense(6), keras.layers.Dense(5, activation="tanh"),
    ])
    ref.compile(optimizer=adam(), loss="mse", metrics=["mae"])
    ref.set_weights(full_weights(model))
    return strategy, model, ref


def test_tensor_parallel_layers_inside_a_stage(tmp_path):
    # 2 stages x 2 tensor-parallel shards; 1F1B's interleaved training step.
    # (The layer's GPipe path runs the same executor and gradient hook: the
    # real-worker launch trains it with GPipe.)
    mesh = Mesh((2, 2), ("pipeline", "model"))
    strategy, model, ref = _tp_models(mesh, "1f1b", 2)
    x, y = _data(16, 5)
    _check_exact(model, ref, x, y, batch=16)
    # Each replica holds its stage's shard: stage 0's replicas half of each
    # split weight (Column kernel 4x4 of 4x8, bias 4 of 8, Row kernel 4x6 of
    # 8x6) and the whole Row bias; stage 1's replicas the Dense(5).
    layer = model.layers[1]
    split = 4 * 4 + 4 + 4 * 6  # Column kernel/bias shards + Row kernel shard
    assert layer.stage_nbytes(0) // 4 == split + 6 and int(layer._buffer.shape[0]) == max(split + 6, 6 * 5 + 5)
    # The optimizer's moments are per shard: a .keras round trip brings each
    # replica's own back (not the chief's), and training on continues alike.
    model.save(str(tmp_path / "tp.keras"))
    with strategy.scope():
        loaded = keras.saving.load_model(str(tmp_path / "tp.keras"))
    for a, b in zip(full_weights(loaded), full_weights(model)):
        np.testing.assert_array_equal(a, b)
    for a, b in zip(loaded.optimizer.variables, model.optimizer.variables):
        for r, v in keras_comm.parallel.process_shards(b).items():
            np.testing.assert_array_equal(keras_comm.parallel.process_shards(a)[r], v)


def test_a_tensor_parallel_stage_must_share_the_pipelines_mesh():
    mesh = Mesh((2, 2), ("pipeline", "model"))
    other = Mesh((2, 2), ("model", "pipeline"))
    strategy = make_strategy(4)
    with strategy.scope():
        with pytest.raises(ValueError, match="must be split over an axis of the pipeline's mesh"):
            keras.Sequential([keras.Input((3,)), Pipeline(
                [ColumnParallelDense(4, gather_output=True, mesh=other, axis="model"), keras.layers.Dense(2)],
                mesh=mesh)])


def test_parallel_optimizer_accumulates_and_shards_with_a_pipeline():
    # 2 stages x 2 data replicas, Adam, 2 micro-batches accumulated per
    # update, ZeRO-1: the weights before the pipeline are ZeRO-sharded over
    # the world; the stage buffer (it carries its own gradient reduction)
    # is reduce-scattered over its data group, its moments sharded over it
    # (test_zero_shards_the_stage_optimizer_state_over_its_data_group).
    # The schedule is 1F1B's interleaved table, under the callback too.
    model, ref = _zero_pipeline_models(make_strategy(4), Mesh((2, 2), ("data", "pipeline")))
    x, y = _data(16, WIDTHS[1])  # 32 samples: 2 updates of 2 micro-batches of 8
    po = ParallelOptimizer(accumulation_steps=2, zero_stage=1)
    model.fit(x, y, batch_size=8, epochs=1, shuffle=False, verbose=0, callbacks=[po])
    ref.fit(x, y, batch_size=16, epochs=1, shuffle=False, verbose=0)
    assert po.counts["updates"] == 2
    assert max(_rel(a, b) for a, b in zip(full_weights(model), ref.get_weights())) <= 1e-5
    # The callback's step ran the whole 1F1B table (training/pipeline.forward),
    # not the layer's halves: rank 1 (stage 1) interleaves F0 B0 F1 B1.
    layer = model.layers[1]
    table = keras_comm.parallel.schedules.train_schedule("1f1b", 2, 2)[1]
    assert table in layer._traced_instructions[1]
    assert keras_comm.parallel.schedules.forward_only(table) not in layer._traced_instructions[1]
    order = _compute_order(table)
    assert order.index(("backward", 0)) < order.index(("forward", 1))


def _zero_pipeline_models(strategy, mesh):
    adam = lambda: keras.optimizers.Adam(0.01)  # noqa: E731
    with strategy.scope():
        model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(4), Pipeline(_stages(2), 2, "1f1b", mesh=mesh)])
        model.compile(optimizer=adam(), loss="mse")
    ref = keras.Sequential([keras.Input((3,)), keras.layers.Dense(4)] + _stages(2))
    ref.compile(optimizer=adam(), loss="mse")
    ref.set_weights(full_weights(model))
    return model, ref


def _same_h5(a, b):
    import h5py

    def arrays(path):
        out = {}
        with h5py.File(path, "r") as f:
            f.visititems(lambda k, v: out.__setitem__(k, v[()]) if isinstance(v, h5py.Dataset) else None)
        return out

    want, got = arrays(a), arrays(b)
    assert sorted(want) == sorted(got) and any("optimizer" in k for k in want)
    for k in want:
        np.testing.assert_array_equal(got[k], want[k], err_msg=k)


def _held(variable):
    """Elements `variable`'s buffer holds now (0 once released)."""

    v = keras_api.tf_variable(variable) if not isinstance(variable, tf.Variable) else variable
    return int(tf.size(v.read_value()))


# ZeRO-1 without accumulation, ZeRO-2 with (its reduce-scatter per
# micro-batch); ZeRO-1 with accumulation in
# test_parallel_optimizer_accumulates_and_shards_with_a_pipeline and, with a
# resume, on real workers (test_pipeline_multiprocess.py). The checkpoints once.
@pytest.mark.parametrize("zero, k", [(1, 1), (2, 2)])
def test_zero_shards_the_stage_optimizer_state_over_its_data_group(zero, k, tmp_path):
    # 2 data replicas x 2 stages, Adam, 1F1B: ZeRO-1/2 shard the stage
    # buffer's moments over the stage's data group (reduce-scatter over the
    # group, a 1/2 update, all-gather over the group); exact against the
    # unsplit model, per replica 1/2 of its stage's optimizer state.
    mesh = Mesh((2, 2), ("data", "pipeline"))
    strategy = make_strategy(4)
    model, ref = _zero_pipeline_models(strategy, mesh)
    x, y = _data(16, WIDTHS[1])  # 32 samples
    po = ParallelOptimizer(accumulation_steps=k, zero_stage=zero)
    model.fit(x, y, batch_size=16 // k, epochs=1, shuffle=False, verbose=0, callbacks=[po])
    ref.fit(x, y, batch_size=16, epochs=1, shuffle=False, verbose=0)
    assert po.counts["updates"] == 2
    assert max(_rel(a, b) for a, b in zip(full_weights(model), ref.get_weights())) <= 1e-5
    layer = model.layers[1]
    state = po._engine.state
    assert [v.path for v in state.grouped] == [layer._buffer.path]
    # Optimizer-state bytes on each replica's variables: the buffer's two
    # Adam moments are ceil(L / 2) floats each (L: the buffer, the largest
    # stage), and the optimizer's own full-size buffer slots hold nothing.
    length = int(layer._buffer.shape[0])
    # (The Dense(4) before the pipeline: its kernel and bias ZeRO-sharded over the world.)
    for replica, pairs in zip(state.replicas, state.slot_pairs):
        grouped = [int(np.prod(slot.value.shape)) for slot, _, _ in pairs[2]]
        assert grouped == [-(-length // 2)] * 2
        plain = sum(int(np.prod(slot.value.shape)) for slot, _, _ in pairs[0])
        assert plain == 2 * (-(-3 * 4 // 4) + -(-4 // 4))
        assert sum(_held(m) for m in replica.all_masters()) == 0  # released between updates
    for user in state.grouped_user_slots():
        assert [_held(c) for c in keras_comm.training.sharded_state.local_components(user)] == [0] * 4
    assert po.state_bytes(breakdown=True)["optimizer"] == 4 * (
        2 * -(-length // 2) + 2 * (-(-3 * 4 // 4) + -(-4 // 4)))
    if zero == 2:
        return
    # The file holds the unsplit optimizer state: the one-process model
    # loads it and its buffer's moments are the unsplit model's.
    model.save_weights(str(tmp_path / "a.weights.h5"))
    model.save(str(tmp_path / "a.keras"))
    local = keras.Sequential([keras.Input((3,)), keras.layers.Dense(4), Pipeline(_stages(2), 2)])
    local.compile(optimizer=keras.optimizers.Adam(0.01), loss="mse")
    local.optimizer.build(local.trainable_variables)
    local.load_weights(str(tmp_path / "a.weights.h5"))
    for a, b in zip(full_weights(local), full_weights(model)):
        np.testing.assert_array_equal(a, b)
    stage_slots = {}
    for v in ref.optimizer.variables:
        stage_slots.setdefault(v.name.rsplit("_", 1)[-1], []).append(np.asarray(v))
    for kind in ("momentum", "velocity"):
        (got,) = [np.asarray(v) for v in local.optimizer.variables if "stage_weights" in v.name and kind in v.name]
        want = np.concatenate([np.ravel(a) for a in stage_slots[kind][2:]])  # after the Dense(4)'s
        assert _rel(got, want) <= 1e-5
    # .keras: loaded on the same mesh, it writes back the same file contents.
    with strategy.scope():
        again = keras.saving.load_model(str(tmp_path / "a.keras"))
    again.save_weights(str(tmp_path / "b.weights.h5"))
    _same_h5(tmp_path / "a.weights.h5", tmp_path / "b.weights.h5")
    # A load into the running state (its slots are the callback's: each
    # replica cuts its data-group shard of its stage) gathers back the same file.
    model.load_weights(str(tmp_path / "b.weights.h5"))
    model.save_weights(str(tmp_path / "c.weights.h5"))
    _same_h5(tmp_path / "a.weights.h5", tmp_path / "c.weights.h5")


def _bn_models(strategy, m, schedule, mesh=None):
    with strategy.scope():
        model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(4), Pipeline(bn_stages(), m, schedule, mesh=mesh)])
        model.compile(optimizer=keras.optimizers.SGD(0.1), loss="mse")
    ref = bn_unsplit()
    ref.compile(optimizer=keras.optimizers.SGD(0.1), loss="mse")
    ref.set_weights(full_weights(model))  # the unsplit order: kernel, bias, gamma, beta, moving mean, variance
    return model, ref


def _close(got, want):
    # atol: the biases just before a BatchNormalization get a zero gradient
    # (the normalization removes their shift); their values are round-off.
    for a, b in zip(got, want, strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)


def test_batch_normalization_inside_stages_trains_exactly(tmp_path):
    # 1F1B's interleaved step; the moving statistics live on the stage's
    # replica and advance micro-batch by micro-batch.
    strategy = make_strategy(2)
    model, ref = _bn_models(strategy, 2, "1f1b")
    x, y = _data(8, 6)  # 2 steps of 8
    model.fit(x, y, batch_size=8, epochs=1, shuffle=False, verbose=0)
    micro_batch_steps(ref, ref.optimizer, x, y, 8, 2)
    _close(full_weights(model), ref.get_weights())
    assert not np.allclose(ref.layers[2].moving_mean.numpy(), 0)  # the statistics moved
    # predict normalizes with the moving statistics.
    np.testing.assert_allclose(model.predict(x, batch_size=8, verbose=0), ref.predict(x, verbose=0), rtol=1e-5, atol=1e-5)
    # The statistics are saved with the stages' weights, in the unsplit order.
    model.save_weights(str(tmp_path / "bn.weights.h5"))
    local = keras.Sequential([keras.Input((3,)), keras.layers.Dense(4), Pipeline(bn_stages(), 2)])
    local.load_weights(str(tmp_path / "bn.weights.h5"))
    for a, b in zip(full_weights(local), full_weights(model), strict=True):
        np.testing.assert_array_equal(a, b)


def test_batch_normalization_statistics_agree_over_the_stages_data_group():
    # 2 data replicas x 2 stages, GPipe (the layer's path), one step: each
    # stage's statistics are the mean of its two replicas' micro-batch
    # trajectories (exact: BatchNormalization's update is linear), the
    # same on both; the weights follow the mean of all micro-batch losses.
    mesh = Mesh((2, 2), ("data", "pipeline"))
    model, ref = _bn_models(make_strategy(4), 2, "gpipe", mesh=mesh)
    x, y = _data(8, 6)
    x, y = x[:16], y[:16]  # one global batch of 16: per pipeline group 8, micro-batches of 4
    model.fit(x, y, batch_size=16, epochs=1, shuffle=False, verbose=0)
    data_group_steps(ref, ref.optimizer, x, y, 16, 2, 2)  # per group 8: 2 micro-batches of 4
    want = ref.get_weights()
    _close(full_weights(model), want)
    # Both replicas of each stage hold the same statistics.
    layer = model.layers[1]
    shards = keras_comm.parallel.process_shards(layer._state_buffer)
    for r in range(2):
        np.testing.assert_array_equal(shards[r], shards[r + 2])


def test_one_process_pipeline_is_the_unsplit_model_and_loads_its_files(tmp_path):
    strategy = make_strategy(2)
    model, _ = _models(2, 2, "1f1b", strategy)
    x, y = _data(8, WIDTHS[1])
    model.fit(x, y, batch_size=8, epochs=1, shuffle=False, verbose=0)
    weights = full_weights(model)
    model.save_weights(str(tmp_path / "w.weights.h5"))
    model.save(str(tmp_path / "m.keras"))
    # No strategy: one replica holds both stages.
    local = keras.Sequential([keras.Input((3,)), keras.layers.Dense(4), Pipeline(_stages(2), 2)])
    local.load_weights(str(tmp_path / "w.weights.h5"))
    for a, b in zip(full_weights(local), weights):
        np.testing.assert_array_equal(a, b)
    loaded = keras.saving.load_model(str(tmp_path / "m.keras"))
    for a, b in zip(full_weights(loaded), weights):
        np.testing.assert_array_equal(a, b)
    np.testing.assert_allclose(
        loaded.predict(x, verbose=0), model.predict(x, batch_size=8, verbose=0), rtol=1e-6, atol=1e-6
    )
    # And back: the one-process weights set onto the pipelined model.
    set_full_weights(model, full_weights(loaded))
    for a, b in zip(full_weights(model), weights):
        np.testing.assert_array_equal(a, b)


def test_config_round_trip():
    layer = Pipeline(_stages(3), num_micro_batches=4, schedule="gpipe", axis="pp")
    config = layer.get_config()
    again = Pipeline.from_config(config)
    assert again.get_config() == config
    assert again.num_stages == 3 and again.schedule == "gpipe"


@pytest.mark.parametrize(
    "kwargs, text",
    [
        (dict(stages=[keras.layers.Dense(2)]), "at least 2"),
        (dict(stages=[keras.layers.Dense(2), "dense"]), "stages[1]"),
        (dict(stages=[keras.layers.Dense(2)] * 2, num_micro_batches=0), "num_micro_batches"),
        (dict(stages=[keras.layers.Dense(2)] * 2, schedule="zb"), "schedule"),
        (dict(stages=[keras.layers.Dense(2)] * 3, mesh=Mesh((2, 2), ("data", "pipeline"))), "must have 3"),
    ],
)
def test_bad_arguments_at_construction(kwargs, text):
    with pytest.raises((ValueError, TypeError), match="Received") as info:
        Pipeline(**kwargs)
    assert text in str(info.value)


def test_build_time_errors():
    strategy = make_strategy(2)
    with strategy.scope():
        # Three stages do not fit a world of two.
        with pytest.raises(ValueError, match=r"must have 3 replicas .*Received: 'pipeline' axis of size 2"):
            keras.Sequential([keras.Input((3,)), Pipeline(_stages(3))])
        # A stage built for another input.
        built = keras.layers.Dense(2)
        built.build((None, 9))
        with pytest.raises(ValueError, match=r"stage 1 .* cannot take stage 0's output of shape \(None, 5\)"):
            keras.Sequential([keras.Input((3,)), Pipeline([keras.layers.Dense(5), built])])
        # A static batch that does not split into micro-batches.
        with pytest.raises(ValueError, match="divisible into `num_micro_batches`.*Received: num_micro_batches=3"):
            keras.Sequential([keras.Input((3,), batch_size=4), Pipeline(_stages(2), 3)])
        with pytest.raises(ValueError, match=r"not floating point .*Dropout.*Received: \['seed_generator"):
            keras.Sequential([keras.Input((3,)), Pipeline([keras.layers.Dropout(0.5), keras.layers.Dense(2)])])


def test_a_batch_not_divisible_at_run_time_is_an_error_not_a_hang():
    strategy = make_strategy(2)
    model, _ = _models(2, 3, "gpipe", strategy, post=True)
    x, y = _data(4, 2)
    with pytest.raises(tf.errors.InvalidArgumentError, match="not divisible by num_micro_batches=3"):
        model.fit(x, y, batch_size=4, epochs=1, verbose=0)
