"""Replicas agree on non-trainable state (keras_comm.training.nontrainable, issue 19).

In-process replicas; the real-worker checks (2 and 3 workers, tf-keras's
MultiWorkerMirroredStrategy as the reference) are in
tests/acceptance/test_collectives_multiprocess.py (nontrainable_worker.py there).

The reference for the values is tf-keras (Keras 2) on the same strategy,
data and initial weights: it keeps BatchNormalization's moving statistics
per replica (ON_READ, MEAN), so reading them outside the replicas gives
their mean over replicas -- what keras_comm's per-step mean must equal up to
round-off. tf-keras's BatchNormalization runs with ``fused=False``: its fused
kernel applies Bessel's correction to the moving variance, Keras 3 does not.
"""

import numpy as np
import pytest
import tensorflow as tf

import keras
import tf_keras

import keras_comm
from keras_comm.training import nontrainable

from conftest import make_strategy
from conftest import run_replicas


def _components(variable):
    v = keras_comm._private.keras_api.tf_variable(variable)
    if isinstance(v, tf.distribute.DistributedValues):
        return [np.asarray(c.numpy()) for c in v.values]
    return [np.asarray(v.numpy())]


def _max_spread(model):
    """The largest difference between two replicas' copies of any weight."""
    return max(
        max(float(np.abs(c.astype(np.float64) - comps[0]).max()) for c in comps)
        for comps in (_components(v) for v in model.weights)
    )


class RunningStats(keras.layers.Layer):
    """A user layer with the kinds of non-trainable state a layer may keep."""

    def build(self, input_shape):
        d = input_shape[-1]
        # Keras's default aggregation ("none"): averaged by the step.
        self.average = self.add_weight(shape=(d,), initializer="zeros", trainable=False, name="average")
        # A count: each replica counts its own samples (on_read), a read
        # outside the replicas sums them (the global count); left alone.
        self.seen = keras.Variable(
            0.0, trainable=False, aggregation="sum", synchronization="on_read", name="seen"
        )
        # The same kind of count, different on each replica (its shard's
        # samples with a positive last feature).
        self.positive = keras.Variable(
            0.0, trainable=False, aggregation="sum", synchronization="on_read", name="positive"
        )

    def call(self, x, training=False):
        if training:
            self.average.assign(0.8 * self.average + 0.2 * keras.ops.mean(x, axis=0))
            self.seen.assign_add(keras.ops.cast(keras.ops.shape(x)[0], "float32"))
            self.positive.assign_add(keras.ops.sum(keras.ops.cast(x[:, -1] > 0, "float32")))
        return x


def _model(K, n_features=3, user_layer=True):
    inp = K.Input((6, 6, 2))
    h = K.layers.Conv2D(4, 3, use_bias=False)(inp)
    kwargs = {"fused": False} if K is tf_keras else {}
    h = K.layers.BatchNormalization(momentum=0.9, **kwargs)(h)
    h = K.layers.ReLU()(h)
    h = K.layers.GlobalAveragePooling2D()(h)
    if user_layer:
        h = RunningStats()(h)
    out = K.layers.Dense(n_features)(h)
    return K.Model(inp, out)


def _data(num_replicas, steps=3, per_replica=4):
    rng = np.random.default_rng(0)
    n = steps * num_replicas * per_replica
    x = rng.normal(size=(n, 6, 6, 2)).astype("float32")
    y = rng.normal(size=(n, 3)).astype("float32")
    return x, y, num_replicas * per_replica


def _dataset(x, y, batch):
    return tf.data.Dataset.from_tensor_slices((x, y)).batch(batch)


# --- which variables, by kind (pure) ---------------------------------------


def test_agreement_rule_by_kind():
    strategy = make_strategy(2)
    outside = keras.Variable(np.zeros(3, "float32"), trainable=False)
    with strategy.scope():
        bn = keras.layers.BatchNormalization()
        bn.build((None, 3))
        drop = keras.layers.Dropout(0.5, seed=1)
        mirror = keras_comm.layers.MirrorMiniStepOperator(2)
        mirror.build((3,))
        stats = RunningStats()
        stats.build((None, 3))
        layer = keras.layers.Layer()
        mean_var = layer.add_weight(shape=(2,), trainable=False, aggregation="mean")
        first = layer.add_weight(shape=(2,), trainable=False, aggregation="only_first_replica")
        integer = layer.add_weight(shape=(), dtype="int32", trainable=False, initializer="zeros")
        kept = nontrainable.keep_per_replica(layer.add_weight(shape=(2,), trainable=False))
        shard = keras_comm.parallel.add_sharded_weight(
            layer, "shard", (4,), 0, None, "model", "zeros", trainable=False
        )
    rule = nontrainable.agreement_rule
    assert rule(bn.moving_mean) == rule(bn.moving_variance) == "mean"
    assert rule(stats.average) == "mean"
    assert rule(bn.gamma) is None  # trainable: the optimizer keeps it identical
    assert rule(drop.seed_generator.state) is None  # integer, same increments
    assert rule(mirror.accumulator) is None and rule(mirror.step) is None  # on_read
    assert rule(stats.seen) is None and rule(mean_var) is None and rule(first) is None
    assert rule(integer) is None
    assert rule(kept) is None and nontrainable.is_kept_per_replica(kept)
    assert rule(shard) is None
    assert rule(outside) is None  # not distributed: one copy for all replicas


def test_pack_unpack_round_trip():
    values = [tf.constant([[1.0, 2.0], [3.0, 4.0]]), tf.constant([5.0], tf.float16)]
    dtype = nontrainable.pack_dtype([v.dtype for v in values])
    assert dtype == tf.float32
    assert nontrainable.pack_dtype([tf.float16, tf.float64]) == tf.float64
    flat, sizes = nontrainable.pack(values, dtype)
    assert sizes == [4, 1] and flat.dtype == tf.float32
    back = nontrainable.unpack(flat, sizes, [v.shape for v in values], [v.dtype for v in values])
    for a, b in zip(back, values):
        assert a.dtype == b.dtype and np.array_equal(a.numpy(), b.numpy())


# --- the sync itself: closed form, one collective ----------------------------


class _State(keras.layers.Layer):
    def build(self, input_shape):
        self.a = self.add_weight(shape=(3,), initializer="zeros", trainable=False)
        self.b = self.add_weight(shape=(2, 2), initializer="zeros", trainable=False)
        self.kept = nontrainable.keep_per_replica(
            self.add_weight(shape=(2,), initializer="zeros", trainable=False)
        )

    def call(self, x):
        return x


def _collectives(graph_def):
    ops = list(graph_def.node)
    for f in graph_def.library.function:
        ops.extend(f.node_def)
    return sum(1 for op in ops if op.op.startswith("CollectiveReduce"))


def test_sync_sets_every_replica_to_the_mean(strategy):
    n = strategy.num_replicas_in_sync
    with strategy.scope():
        inp = keras.Input((2,))
        state = _State()
        model = keras.Model(inp, state(inp))

    def replica():
        r = tf.cast(keras_comm.rank(), tf.float32) + 1.0
        state.a.assign(r * tf.constant([1.0, 2.0, 4.0]))
        state.b.assign(r * tf.constant([[1.0, -1.0], [0.5, 3.0]]))
        state.kept.assign(r * tf.ones(2))
        nontrainable.sync(model)
        return [tf.identity(keras.ops.convert_to_tensor(v)) for v in (state.a, state.b, state.kept)]

    out = run_replicas(strategy, replica)
    mean = (n + 1) / 2.0
    for rank, (a, b, kept) in enumerate(out):
        np.testing.assert_allclose(a, mean * np.array([1.0, 2.0, 4.0]), rtol=1e-6)
        np.testing.assert_allclose(b, mean * np.array([[1.0, -1.0], [0.5, 3.0]]), rtol=1e-6)
        np.testing.assert_array_equal(kept, (rank + 1) * np.ones(2))  # left alone

    # All of them in one all-reduce (one op per local replica).
    graph = tf.function(lambda: strategy.run(nontrainable.sync, args=(model,)))
    assert _collectives(graph.get_concrete_function().graph.as_graph_def()) == n


def test_no_collective_without_state():
    strategy = make_strategy(2)
    with strategy.scope():
        model = keras.Sequential([keras.Input((2,)), keras.layers.Dense(2)])
    graph = tf.function(lambda: strategy.run(nontrainable.sync, args=(model,)))
    assert _collectives(graph.get_concrete_function().graph.as_graph_def()) == 0


# --- fit: identical on every replica, at tf-keras's value ----------------------


def _fit_both(strategy, epochs=1):
    n = strategy.num_replicas_in_sync
    x, y, batch = _data(n)
    keras.utils.set_random_seed(1)
    with strategy.scope():
        model = _model(keras)
        model.compile(keras.optimizers.SGD(0.1), "mse")
    initial = model.get_weights()
    with strategy.scope():
        reference = _model(tf_keras, user_layer=False)
        reference.compile(tf_keras.optimizers.SGD(0.1), "mse")
    reference.set_weights([w for w, v in zip(initial, model.weights) if "running_stats" not in v.path])
    model.fit(_dataset(x, y, batch), epochs=epochs, verbose=0)
    reference.fit(_dataset(x, y, batch), epochs=epochs, verbose=0)
    return model, reference, (x, y, batch)


@pytest.mark.parametrize("kind", ["mwms2", "mirrored2"])
def test_fit_agrees_at_tf_keras_value(kind):
    if kind == "mirrored2":
        strategy = tf.distribute.MirroredStrategy(["/cpu:0", "/cpu:1"])
    else:
        strategy = make_strategy(int(kind[-1]))
    n = strategy.num_replicas_in_sync
    model, reference, (x, y, batch) = _fit_both(strategy)
    assert _max_spread(model) == 0.0
    ours = [(v.path, w) for v, w in zip(model.weights, model.get_weights())]
    ours = [(p, w) for p, w in ours if "running_stats" not in p]
    theirs = reference.get_weights()  # outside the replicas: the mean of each replica's
    assert len(ours) == len(theirs)
    for (path, value), expected in zip(ours, theirs):
        np.testing.assert_allclose(value, expected, rtol=2e-6, atol=2e-7, err_msg=path)
    # A count kept per replica and summed on read counts the global samples.
    seen = [v for v in model.non_trainable_weights if v.path.endswith("seen")][0]
    assert [float(c) for c in _components(seen)] == [len(x) / n] * n
    assert float(keras.ops.convert_to_numpy(seen)) == len(x)
    if kind == "mwms2":
        _check_evaluate_and_predict(model, x, y, batch)


def test_user_running_average_is_the_mean_of_each_update():
    # A linear user update: average <- 0.8 average + 0.2 mean(x) on each
    # replica's shard; the mean over replicas is the update with the mean of
    # the replicas' shard means, here the global batch mean (equal shards).
    strategy = make_strategy(2)
    with strategy.scope():
        inp = keras.Input((3,))
        stats = RunningStats()
        model = keras.Model(inp, keras.layers.Dense(1)(stats(inp)))
        model.compile(keras.optimizers.SGD(0.0), "mse")
    rng = np.random.default_rng(3)
    x = rng.normal(size=(24, 3)).astype("float32")
    y = np.zeros((24, 1), "float32")
    model.fit(_dataset(x, y, 8), epochs=1, verbose=0)
    expected = np.zeros(3)
    for step in range(3):
        expected = 0.8 * expected + 0.2 * x[8 * step : 8 * step + 8].astype(np.float64).mean(0)
    for c in _components(stats.average):
        np.testing.assert_allclose(c, expected, rtol=1e-5, atol=1e-7)
    # A count that differs per replica stays per replica (replica r saw rows
    # 4r..4r+3 of every batch of 8) and reads as the global count.
    shard = [float(sum((x[8 * s + 4 * r : 8 * s + 4 * r + 4, -1] > 0).sum() for s in range(3))) for r in range(2)]
    assert shard[0] != shard[1]
    assert [float(c) for c in _components(stats.positive)] == shard
    assert float(keras.ops.convert_to_numpy(stats.positive)) == sum(shard)


def _check_evaluate_and_predict(model, x, y, batch):
    # evaluate and predict change no state and equal one process's.
    before = [_components(v) for v in model.weights]
    loss = model.evaluate(_dataset(x, y, batch), verbose=0)
    pred = model.predict(x, batch_size=batch, verbose=0)
    after = [_components(v) for v in model.weights]
    for b, a in zip(before, after):
        for cb, ca in zip(b, a):
            np.testing.assert_array_equal(cb, ca)
    # The same weights in one process, no strategy.
    single = _model(keras)
    single.compile(keras.optimizers.SGD(0.1), "mse")
    single.set_weights(model.get_weights())
    np.testing.assert_allclose(loss, single.evaluate(x, y, batch_size=batch, verbose=0), rtol=1e-5)
    np.testing.assert_allclose(pred, single.predict(x, batch_size=batch, verbose=0), rtol=1e-5, atol=1e-6)


def test_parallel_optimizer_agrees():
    strategy = make_strategy(2)
    rng = np.random.default_rng(2)
    x = rng.normal(size=(16, 4)).astype("float32")
    y = rng.normal(size=(16, 2)).astype("float32")
    batch = 4
    keras.utils.set_random_seed(1)
    with strategy.scope():
        model = keras.Sequential([
            keras.Input((4,)), keras.layers.Dense(3), keras.layers.BatchNormalization(),
            keras.layers.Dropout(0.3), keras.layers.Dense(2),
        ])
        model.compile(keras.optimizers.Adam(0.01), "mse")
    po = keras_comm.callbacks.ParallelOptimizer(accumulation_steps=2, zero_stage=1)
    model.fit(_dataset(x, y, batch), epochs=1, verbose=0, callbacks=[po])
    assert _max_spread(model) == 0.0


def test_benchmark_summary_takes_the_slowest_rank_per_round():
    from benchmarks import nontrainable as bench

    ranks = [
        {"step_times": {"synced": [1.0, 3.0], "per_replica": [2.0, 1.0]},
         "sync_alone_s": [0.1, 0.3], "global_batch": 8, "params": 1, "bn_layers": 7, "sync_bytes": 4},
        {"step_times": {"synced": [2.0, 1.0], "per_replica": [1.0, 2.0]},
         "sync_alone_s": [0.2, 0.1], "global_batch": 8, "params": 1, "bn_layers": 7, "sync_bytes": 4},
    ]
    row = bench.summarize(ranks)
    assert row["ratio_min"] == 1.0 and row["ratio_max"] == 1.5 and row["ratio"] == 1.25
    assert row["sync_alone_s"] == 0.25 and row["workers"] == 2


class ObservedModel(keras.Model):
    """Its metrics observe the step: the optimizer's step count and the
    square of a moving mean (whose mean over replicas is the square of the
    agreed value only if every replica already holds it)."""

    def compute_metrics(self, x, y, y_pred, sample_weight=None):
        logs = dict(super().compute_metrics(x, y, y_pred, sample_weight))
        bn = [layer for layer in self.layers if isinstance(layer, keras.layers.BatchNormalization)][0]
        logs["iterations"] = keras.ops.cast(self.optimizer.iterations, "float32")
        logs["m2"] = keras.ops.sum(keras.ops.square(bn.moving_mean))
        return logs


def test_metrics_see_the_updated_and_agreed_state():
    # Upstream's order: update, then metrics; here the sync sits between.
    strategy = make_strategy(2)
    rng = np.random.default_rng(4)
    x = rng.normal(size=(8, 3)).astype("float32")
    y = rng.normal(size=(8, 1)).astype("float32")
    with strategy.scope():
        inp = keras.Input((3,))
        bn = keras.layers.BatchNormalization()
        model = ObservedModel(inp, keras.layers.Dense(1)(bn(inp)))
        model.compile(keras.optimizers.SGD(0.1), "mse")
    history = model.fit(_dataset(x, y, 8), epochs=2, verbose=0).history
    assert history["iterations"] == [1.0, 2.0]
    agreed = _components(bn.moving_mean)[0].astype(np.float64)
    np.testing.assert_allclose(history["m2"][-1], np.sum(agreed**2), rtol=1e-6)


class _WeightTrace(keras.callbacks.Callback):
    """Records the model's trainable weights after every batch (float64)."""

    def __init__(self):
        super().__init__()
        self.weights = []

    def on_train_batch_end(self, batch, logs=None):
        self.weights.append([np.asarray(w, np.float64) for w in self.model.get_weights()[:2]])


def test_optimizer_ema_agrees_with_one_process():
    # use_ema=True: the optimizer's averages of the trainable weights are
    # identical on every replica and equal to one process on the global
    # batches; the average itself is recomputed in float64 from the weights
    # each step left (Keras's rule: momentum 0 on the first step).
    # `finalize_variable_values` (outside the replicas, after fit) then
    # writes the average into every replica's weights.
    strategy = make_strategy(2)
    rng = np.random.default_rng(5)
    x = rng.normal(size=(24, 3)).astype("float32")
    y = rng.normal(size=(24, 2)).astype("float32")

    def build(overwrite=None):
        keras.utils.set_random_seed(2)
        model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(2)])
        model.compile(
            keras.optimizers.SGD(0.1, use_ema=True, ema_momentum=0.5, ema_overwrite_frequency=overwrite),
            "mse",
        )
        return model

    with strategy.scope():
        model = build()
    single = build()
    single.set_weights(model.get_weights())
    trace = _WeightTrace()
    model.fit(_dataset(x, y, 8), epochs=1, verbose=0, callbacks=[trace])
    single.fit(x, y, batch_size=8, epochs=1, shuffle=False, verbose=0)
    averages = model.optimizer._model_variables_moving_average
    assert len(averages) == 2
    assert _max_spread(model) == 0.0
    for avg, ref in zip(averages, single.optimizer._model_variables_moving_average):
        comps = _components(avg)
        assert all(np.array_equal(c, comps[0]) for c in comps), avg.path
        np.testing.assert_allclose(comps[0], ref.numpy(), rtol=1e-6, atol=1e-7)
    for a, b in zip(model.get_weights(), single.get_weights()):
        np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-7)
    # The closed form: average_1 = w_1, average_t = 0.5 average_{t-1} + 0.5 w_t.
    expected = trace.weights[0]
    for w in trace.weights[1:]:
        expected = [0.5 * e + 0.5 * wi for e, wi in zip(expected, w)]
    for avg, e in zip(averages, expected):
        np.testing.assert_allclose(_components(avg)[0], e, rtol=1e-5, atol=1e-6)
    model.optimizer.finalize_variable_values(model.trainable_variables)
    assert _max_spread(model) == 0.0
    for v, e in zip(model.trainable_variables, expected):
        np.testing.assert_allclose(_components(v)[0], e, rtol=1e-5, atol=1e-6)

    # ema_overwrite_frequency under a multi-replica strategy fails inside
    # Keras <= 3.15 itself (the overwrite is a merge_call inside a cond: the
    # same error without keras_comm, docs/batch_normalization.md). Keras 3.16
    # fixed it upstream (the TensorFlow optimizer's new
    # `_backend_maybe_overwrite_model_variables` takes the cond to
    # cross-replica context): there it trains, exact against one process.
    with strategy.scope():
        overwriting = build(overwrite=2)
    if not hasattr(keras.optimizers.Optimizer, "_backend_maybe_overwrite_model_variables"):
        with pytest.raises(RuntimeError, match="merge_call"):
            overwriting.fit(_dataset(x, y, 8), epochs=1, verbose=0)
        return
    single_overwriting = build(overwrite=2)
    single_overwriting.set_weights(overwriting.get_weights())
    overwriting.fit(_dataset(x, y, 8), epochs=1, verbose=0)
    single_overwriting.fit(x, y, batch_size=8, epochs=1, shuffle=False, verbose=0)
    assert _max_spread(overwriting) == 0.0
    for a, b in zip(overwriting.get_weights(), single_overwriting.get_weights()):
        np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-7)
    # The overwrite happened (step 2 of 3): not the weights of the fit without it.
    assert not np.allclose(overwriting.get_weights()[0], single.get_weights()[0])


def test_normalization_adapted_per_replica_is_pooled_once():
    # Each replica "adapted" on its own shard (its components set directly, as
    # separate workers' adapt would); agree_adapted pools them into the
    # statistics of the union (float64 closed form), the layer normalizes with
    # them, and the per-step sync leaves them alone (fit never writes them).
    strategy = make_strategy(2)
    rng = np.random.default_rng(6)
    data = rng.normal(size=(16, 3)) * [1.0, 2.0, 0.5] + [0.0, 3.0, -1.0]
    shards = [data[r::2] for r in range(2)]
    with strategy.scope():
        norm = keras.layers.Normalization()
        model = keras.Sequential([keras.Input((3,)), norm, keras.layers.Dense(1)])
        model.compile(keras.optimizers.SGD(0.1), "mse")
    assert not nontrainable.variables_to_agree(model)
    for var, stat in ((norm.adapt_mean, np.mean), (norm.adapt_variance, np.var)):
        for comp, shard in zip(keras_comm._private.keras_api.tf_variable(var).values, shards):
            comp.assign(stat(shard, axis=0).astype("float32"))
    assert nontrainable.agree_adapted(model) == [norm]
    for var, expected in ((norm.adapt_mean, data.mean(0)), (norm.adapt_variance, data.var(0))):
        for c in _components(var):
            np.testing.assert_allclose(c, expected, rtol=1e-6, atol=1e-7)
    x = data.astype("float32")
    np.testing.assert_allclose(
        keras.ops.convert_to_numpy(norm(x)), (data - data.mean(0)) / np.sqrt(data.var(0)), rtol=1e-5, atol=1e-6
    )
    model.fit(_dataset(x, x[:, :1], 8), epochs=1, verbose=0)
    assert _max_spread(model) == 0.0
    for var, expected in ((norm.adapt_mean, data.mean(0)), (norm.adapt_variance, data.var(0))):
        np.testing.assert_allclose(_components(var)[0], expected, rtol=1e-6, atol=1e-7)
    with pytest.raises(ValueError, match="outside the replicas"):
        strategy.run(nontrainable.agree_adapted, args=(model,))
