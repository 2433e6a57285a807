"""keras_comm.parallel.FullyShard (ZeRO-3) on in-process replicas.

model.fit of fully sharded copies vs the unwrapped model trained in one
process on the same global batches (tests/parallel/fully_shard_worker.py,
which also runs across real processes), the flat-shard maths, per-replica
memory, checkpoints in the unwrapped layout, and the build-time errors.
"""

import os
import re

import keras
import numpy as np
import pytest
import tensorflow as tf

import keras_comm
from keras_comm import parallel as P
from keras_comm.parallel import flat_shard
from conftest import make_strategy
import fully_shard_worker as cases



def _check_fit(got):
    for key in ("start_rel", "loss_rel", "weights_rel", "evaluate_rel", "predict_rel"):
        assert got[key] <= cases.RTOL, (key, got)


# --- Pure maths ----------------------------------------------------------------


@pytest.mark.parametrize("shape, n", [((3, 4), 2), ((3, 4), 5), ((7,), 4), ((1,), 3), ((2, 3, 5), 4)])
def test_flat_slices_cover_the_weight_once(shape, n):
    full = np.arange(np.prod(shape), dtype=np.float32).reshape(shape) + 1
    pieces = [flat_shard.slice_flat(full, n, i) for i in range(n)]
    k = flat_shard.shard_size(full.size, n)
    assert all(p.shape == (k,) for p in pieces)
    gathered = np.concatenate(pieces)
    assert np.count_nonzero(gathered[full.size :]) == 0  # padding is zeros
    np.testing.assert_array_equal(flat_shard.unflatten(gathered, shape), full)
    assert flat_shard.padded_size(full.size, n) - full.size < n


def test_memory_accounting_is_one_over_n_plus_padding():
    shapes = [(784, 1024), (1024,), (1024, 10), (10,)]
    full = sum(np.prod(s) for s in shapes)
    acc = flat_shard.memory_accounting(shapes, 4, slots=2)  # Adam
    assert acc["unsharded"] == 4 * full * 4
    assert acc["sharded"] == 4 * sum(-(-int(np.prod(s)) // 4) for s in shapes) * 4
    assert acc["unsharded"] / 4 <= acc["sharded"] <= acc["unsharded"] / 4 + acc["padding"] + 16 * 4


# --- Training vs the unwrapped model -------------------------------------------


# The exactness grid (tests/parallel/fully_shard_worker.py's GRID: SGD /
# Adam / AdamW x accumulation 1 / 2 / 4, each count > 1 in both modes
# across the optimizers) x 2 and 4 replicas, each case one fit of the MLP,
# the CNN and the Embedding + MultiHeadAttention + LayerNormalization block
# side by side (the "three" model), vs the unwrapped model in one process.
# A case takes ~15 s on 2 replicas and ~50 s on 4 (a fit traces its step
# once per replica: 41 of a 4-replica fit's 42 s are tracing; the same fit
# run again takes 1 s): the 18 cases, over 10 minutes, do not fit the
# suite. It runs SUITE_GRID -- every optimizer, accumulation count and mode
# once, on both replica counts (what the five single-model fits it replaced
# covered, and more); the real workers run AdamW.
# KERAS_COMM_FULL_GRID=1 runs all 18.
SUITE_GRID = {
    2: [("sgd", 2, "sharded"), ("adam", 4, "local")],
    4: [("adamw", 1, "sharded")],
}


def _grid_cases():
    if os.environ.get("KERAS_COMM_FULL_GRID") == "1":
        return {n: list(cases.GRID) for n in (2, 4)}
    return SUITE_GRID


def test_suite_grid_covers_every_value():
    """Each optimizer, accumulation count and accumulation mode (of a count
    > 1) runs at least once, on both replica counts; every case is GRID's."""
    run = [c for cs in SUITE_GRID.values() for c in cs]
    assert set(SUITE_GRID) == {2, 4} and set(run) <= set(cases.GRID)
    assert {c[0] for c in run} == {c[0] for c in cases.GRID}
    assert {c[1] for c in run} == {1, 2, 4}
    assert {c[2] for c in run if c[1] > 1} == {"sharded", "local"}


@pytest.mark.inprocess
def test_exactness_grid_matches_unwrapped():
    """Every case's start, losses, final weights (<= RTOL relative), and
    evaluate and predict (after each replica count's first case) equal the
    unwrapped model's; every replica holds 1/n of every trainable weight
    (plus < n padding each). One test reports every failing case."""
    failures = {}
    for n, grid_cases in _grid_cases().items():
        results = cases.grid(make_strategy(n), grid_cases)
        # The per-case figures (pytest -s), e.g. for docs/fully_sharded.md.
        keys = cases.GRID_KEYS + ("error",)
        print(f"{n} replicas:", {c: {k: r[k] for k in keys if k in r} for c, r in results.items()})
        assert list(results) == [cases.grid_case_name(*c) for c in grid_cases]
        assert all(r.get("num_fully_sharded") == 12 for r in results.values() if "error" not in r)
        bad = cases.grid_failures(results)
        if bad:
            failures[n] = bad
    assert not failures, failures


@pytest.mark.inprocess
def test_local_accumulation_refuses_windows_out_of_step():
    """"local" reduce-scatters on every k-th backward: a fit whose updates
    fall elsewhere would train on wrong gradients, so it is refused."""
    strategy = make_strategy(2)
    x, y = cases.data("mlp", 40)  # 5 batches of 8
    keras.utils.set_random_seed(0)
    with strategy.scope():
        model = P.fully_shard(cases.mlp(), accumulation="local", accumulation_steps=2)
        model.compile(keras.optimizers.SGD(0.1), "mse")
    po = keras_comm.callbacks.ParallelOptimizer
    cases_ = [  # (a failed fit leaves its ParallelOptimizer registered: no-callback first)
        ([], r"ParallelOptimizer\(accumulation_steps=2\).*Received: no ParallelOptimizer"),
        ([po(accumulation_steps=2)], r"known multiple of 2.*Received: batches per epoch=5"),
        ([po(accumulation_steps=3)], r"must equal ParallelOptimizer's.*Received: accumulation_steps=2"),
    ]
    for callbacks, match in cases_:
        with pytest.raises(ValueError, match=match):
            model.fit(x, y, batch_size=8, epochs=1, shuffle=False, verbose=0, callbacks=callbacks)


@pytest.mark.inprocess
def test_float16_loss_scaling_unscales_once_and_skips_on_every_replica():
    """Mixed precision: float32 shards gathered in the compute dtype (the
    bfloat16 policy takes the same branch, so it has no test of its own)."""
    from keras_comm._private import keras_api

    strategy = make_strategy(2)
    keras.mixed_precision.set_global_policy("mixed_float16")
    try:
        # (a) No overflow (scale 2**8): the shards' gradients are unscaled
        # exactly once -- vs the unwrapped model in one process.
        def lso(scale, lr):
            return keras.optimizers.LossScaleOptimizer(keras.optimizers.SGD(lr), initial_scale=scale)

        x, y = cases.data("mlp")
        keras.utils.set_random_seed(0)
        ref = cases.mlp()
        ref.compile(lso(256.0, 0.05), "mse")
        initial = ref.get_weights()
        ref.fit(x, y, batch_size=8, epochs=1, shuffle=False, verbose=0)
        unwrapped = cases.mlp()
        unwrapped.set_weights(initial)
        with strategy.scope():
            model = P.fully_shard(unwrapped)
            model.compile(lso(256.0, 0.05), "mse")
        model.fit(x, y, batch_size=8, epochs=1, shuffle=False, verbose=0)
        assert int(model.optimizer.iterations.numpy()) == int(ref.optimizer.iterations.numpy()) == 4
        assert cases.rel(ref.get_weights(), P.full_weights(model)) <= 2e-3  # float16 compute

        # (b) Overflows in one replica's shard only (feature 3 feeds kernel
        # row 3, the second replica's half): every replica skips those steps,
        # as the unwrapped model does under the same strategy (whose
        # all-reduced gradient overflows alike), and halves its scale.
        rs = np.random.RandomState(0)
        x = rs.randn(32, 4).astype("float32")
        x[:, 3] *= 30.0
        y = rs.randn(32, 1).astype("float32")

        def dense():
            return keras.Sequential([keras.Input((4,)), keras.layers.Dense(1, kernel_initializer="ones")])

        def scales(m):
            return [float(v.numpy()) for v in strategy.experimental_local_results(
                keras_api.tf_variable(m.optimizer.dynamic_scale))]

        with strategy.scope():
            plain = dense()
            plain.compile(lso(256.0, 1e-3), "mse")
            model = P.fully_shard(dense())
            model.compile(lso(256.0, 1e-3), "mse")
        for m in (plain, model):
            m.fit(x, y, batch_size=8, epochs=2, shuffle=False, verbose=0)
        applied = int(model.optimizer.iterations.numpy())
        assert 0 < applied < 8 and applied == int(plain.optimizer.iterations.numpy())
        assert scales(model) == scales(plain) and len(set(scales(model))) == 1
        weights = P.full_weights(model)
        assert all(np.isfinite(w).all() for w in weights)
        # Summation order only, in float16 compute (unit roundoff 4.9e-4): the
        # order follows the CPU's matmul blocking, so it differs by machine
        # (1.95e-4 on the bias on an AMD EPYC machine, exactly 0 on earlier ones).
        # The skips themselves are checked exactly above.
        assert cases.rel(plain.get_weights(), weights) <= 1e-3
    finally:
        keras.mixed_precision.set_global_policy("float32")


@pytest.mark.inprocess
def test_batchnorm_statistics_as_plain_data_parallel():
    """Moving statistics stay whole per replica, updated as without sharding."""
    strategy = make_strategy(2)
    rs = np.random.RandomState(0)
    x, y = rs.randn(16, 4).astype("float32"), rs.randn(16, 2).astype("float32")

    def model():
        return keras.Sequential(
            [keras.Input((4,)), keras.layers.Dense(3), keras.layers.BatchNormalization(), keras.layers.Dense(2)]
        )

    keras.utils.set_random_seed(0)
    base = model()
    initial = base.get_weights()
    with strategy.scope():
        plain = model()
        plain.set_weights(initial)
        plain.compile(keras.optimizers.SGD(0.1), "mse")
        fs = P.fully_shard(base)
        fs.compile(keras.optimizers.SGD(0.1), "mse")
    plain.fit(x, y, batch_size=8, epochs=2, shuffle=False, verbose=0)
    fs.fit(x, y, batch_size=8, epochs=2, shuffle=False, verbose=0)
    assert cases.rel(plain.get_weights(), P.full_weights(fs)) <= cases.RTOL


@pytest.mark.inprocess
def test_hybrid_mesh_shards_over_one_axis():
    """FSDP over "data" (groups of 2) of a 2 x 2 mesh; gradients also summed over "model"."""
    mesh = P.Mesh((2, 2), ("data", "model"))
    got = cases.fit_case(make_strategy(4), "mlp", optimizer="adam", mesh=mesh, epochs=1)
    _check_fit(got)
    assert got["replica_shard_elements"] >= got["full_elements"] / 2


# --- Memory, gradients, checkpoints ----------------------------------------------


@pytest.mark.inprocess
def test_state_is_one_over_n_and_gradients_leave_reduce_scattered():
    strategy = make_strategy(4)
    with strategy.scope():
        layer = P.FullyShard(keras.layers.Dense(6, name="dense"))
        model = keras.Sequential([keras.Input((5,)), layer])
        model.compile(keras.optimizers.Adam(0.01), "mse")
    assert [tuple(w.shape) for w in model.trainable_weights] == [(8,), (2,)]  # 30/4 -> 8, 6/4 -> 2
    full = P.full_weights(model)
    x = np.arange(20, dtype=np.float32).reshape(4, 5) / 10

    def step():
        r = keras_comm.rank()
        xr = tf.constant(x)[r : r + 1]
        with tf.GradientTape() as tape:
            loss = tf.reduce_sum(model(xr) ** 2)
        return tape.gradient(loss, model.trainable_weights)

    grads = tf.function(lambda: strategy.run(step))()
    # Reference: the gradient of the summed loss, flattened and cut in 4.
    kernel, bias = (tf.Variable(w.astype(np.float64)) for w in full)
    with tf.GradientTape() as tape:
        loss = tf.reduce_sum((tf.constant(x, tf.float64) @ kernel + bias) ** 2)
    expected = tape.gradient(loss, [kernel, bias])
    for g, e in zip(grads, expected):
        pieces = [np.asarray(p) for p in strategy.experimental_local_results(g)]
        for i, p in enumerate(pieces):
            np.testing.assert_allclose(p, flat_shard.slice_flat(e.numpy(), 4, i), rtol=1e-5, atol=1e-6)
    # The shards carry their own (here: no) reduction, so nothing is summed twice.
    hook = keras_comm.training.reduction.gradient_hook(model.trainable_weights[0])
    assert hook is not None and hook(tf.constant(1.0)) == 1.0
    # 1/4 of the weights and of Adam's slots on every replica.
    with strategy.scope():
        model.optimizer.build(model.trainable_weights)
    state = P.replica_state_bytes(model)
    assert len(set(state.values())) == 1


def _ancestors(op):
    """The ids of the ops `op` depends on (data or control edges), itself included."""
    seen, stack = set(), [op]
    while stack:
        cur = stack.pop()
        if id(cur) in seen:
            continue
        seen.add(id(cur))
        stack += [t.op for t in cur.inputs] + list(cur.control_inputs)
    return seen


@pytest.mark.inprocess
@pytest.mark.parametrize("prefetch", [True, False])
def test_prefetch_gathers_one_layer_early_and_no_further(prefetch):
    """In the traced step of three wrapped Dense layers (trace only, nothing
    runs): with prefetch a layer's all-gather does not wait for the previous
    wrapped layer's compute (its MatMuls) -- it may run while that layer
    computes -- but waits for the compute before it (at most about two
    layers' weights live), forward and backward; without prefetch each
    gather waits for its predecessor's compute. (keras_comm's collectives on
    one device run in program order either way: its ordering token.)"""
    strategy = make_strategy(2)
    with strategy.scope():
        plain = keras.Sequential([keras.Input((5,))] + [keras.layers.Dense(k) for k in (7, 6, 3)])
        model = P.fully_shard(plain, prefetch=prefetch)
    x = tf.constant(cases.data("mlp", 4)[0])

    def step():
        with tf.GradientTape() as tape:
            loss = tf.reduce_sum(model(x) ** 2)
        return tape.gradient(loss, model.trainable_weights)

    graph = tf.function(lambda: strategy.run(step)).get_concrete_function().graph
    ops = [op for op in graph.get_operations() if op.device.endswith("CPU:0")]
    per_layer = []  # [forward gather, backward gather] per layer, forward order
    for layer in model.layers:
        pattern = re.compile(rf"(.*/)?{layer.name}_gather_all_gather(_[0-9]+)?")
        per_layer.append([op for op in ops if op.type == "CollectiveGatherV2" and pattern.fullmatch(op.name)])
    assert [len(g) for g in per_layer] == [2, 2, 2], per_layer
    chains = ([g[0] for g in per_layer], [g[1] for g in per_layer][::-1])
    up = {id(op): _ancestors(op) for chain in chains for op in chain}
    matmuls = [(op, _ancestors(op)) for op in ops if op.type == "MatMul"]

    def compute(chain, p, exclude=()):
        """The MatMuls that use gather p's weights: they wait for it, and
        not for a later gather of the chain (whose layers' compute that is)."""
        later = [id(op) for op in list(chain[p + 1 :]) + list(exclude)]
        return [op for op, anc in matmuls if id(chain[p]) in anc and not any(q in anc for q in later)]

    for chain, exclude in ((chains[0], chains[1]), (chains[1], ())):
        c = [compute(chain, p, exclude) for p in range(3)]
        assert all(c), c

        def waits(gather, ops_):
            return any(id(op) in up[id(gather)] for op in ops_)

        assert waits(chain[1], c[0]) is not prefetch
        assert waits(chain[2], c[1]) is not prefetch
        assert waits(chain[2], c[0])  # never more than one layer early
    with pytest.raises(TypeError, match="Received: prefetch="):
        P.FullyShard(keras.layers.Dense(2), prefetch="yes")


def _check_traced_bytes(capture):
    """The collectives in fit's traced step of the 2-replica mlp, counted
    from its graph (benchmarks/collective_bytes.py): per replica, two
    all-gathers of its shards (forward, backward recompute) and one
    reduce-scatter of the padded full gradient per layer, and no all-reduce
    of a gradient (only the loss and metric scalars): 3 (N-1)/N S sent by
    a ring, S padded."""
    from benchmarks import collective_bytes

    counts = collective_bytes.count(capture.functions, 2)
    # Shards per replica: d1 18 + 4, ln 4 + 4, d2 11 + 2 elements (float32).
    shard_bytes = [22 * 4, 8 * 4, 13 * 4]
    assert sorted(counts["all_gather"]["sizes"]) == sorted(shard_bytes * 2), counts
    assert sorted(counts["reduce_scatter"]["sizes"]) == sorted(2 * b for b in shard_bytes), counts
    assert max(counts["all_reduce"]["sizes"]) <= 16, counts  # scalars: no gradient all-reduce
    padded = 2 * sum(shard_bytes)
    sent = counts["all_gather"]["sent"] + counts["reduce_scatter"]["sent"]
    assert sent == 3 * (2 - 1) / 2 * padded


@pytest.mark.inprocess
def test_checkpoints_are_full_size_and_load_on_another_size(tmp_path):
    """Files hold every weight and Adam slot full-size in the unwrapped
    layer's structure (below the wrapper's entry); any group size loads them.
    The fit's traced step also has its collectives counted
    (`_check_traced_bytes`): one fit pays for both.

    fully_shard's wrappers write the unwrapped model's entry names ("dense",
    not Keras's "fully_shard"), so the unwrapped model loads the file: see
    test_fully_shard_multiprocess for real workers, and below in one process.
    """
    strategy = make_strategy(2)
    x, y = cases.data("mlp", 16)
    keras.utils.set_random_seed(1)
    ref = cases.mlp()
    with strategy.scope():
        model = P.fully_shard(ref)
        model.compile(keras.optimizers.Adam(0.01), "mse")
    from benchmarks import collective_bytes

    capture = collective_bytes.CaptureStep()
    model.fit(x, y, batch_size=8, epochs=1, verbose=0, callbacks=[capture])
    _check_traced_bytes(capture)
    trained = P.full_weights(model)
    model.save_weights(str(tmp_path / "fs.weights.h5"))
    model.save(str(tmp_path / "fs.keras"))
    import h5py

    with h5py.File(str(tmp_path / "fs.weights.h5")) as f:
        kernel = np.asarray(f["layers/dense/vars/0"])  # the unwrapped entry name
        slots = [np.asarray(f["optimizer/vars"][k]) for k in f["optimizer/vars"]]
    np.testing.assert_array_equal(kernel, trained[0])  # full-size, unwrapped shape
    assert (5, 7) in [s.shape for s in slots]  # Adam's kernel moments, full-size
    # The .keras file reloads as a fully sharded model (one process).
    again = keras.models.load_model(str(tmp_path / "fs.keras"))
    assert any(isinstance(l, P.FullyShard) for l in again.layers)
    assert cases.rel(trained, P.full_weights(again)) == 0.0
    # 2 -> 4 replicas: weights and optimizer slots.
    with make_strategy(4).scope():
        four = P.fully_shard(cases.mlp())
        four.compile(keras.optimizers.Adam(0.01), "mse")
        four.optimizer.build(four.trainable_weights)
    four.load_weights(str(tmp_path / "fs.weights.h5"))
    assert cases.rel(trained, P.full_weights(four)) == 0.0
    four.save_weights(str(tmp_path / "four.weights.h5"))
    with h5py.File(str(tmp_path / "four.weights.h5")) as f:
        slots4 = [np.asarray(f["optimizer/vars"][k]) for k in f["optimizer/vars"]]
    assert len(slots4) == len(slots)
    for a, b in zip(slots, slots4):  # Adam's moments survive 2 -> 4 exactly
        np.testing.assert_array_equal(a, b)


def _hand_placed(wrap):
    """Sequential(Dense, LayerNormalization, Functional(Dense, Dense)) with
    `wrap` applied to the Dense layers and the LayerNormalization."""
    inner_in = keras.Input((7,))
    h = wrap(keras.layers.Dense(4, name="fa"))(inner_in)
    block = keras.Model(inner_in, wrap(keras.layers.Dense(3, name="fb"))(h))
    return keras.Sequential(
        [keras.Input((5,)), wrap(keras.layers.Dense(7)), wrap(keras.layers.LayerNormalization()), block]
    )


def test_hand_placed_wrappers_share_files_with_the_unwrapped_model(tmp_path):
    """Keras names a layer list's entries by class ("fully_shard_1"), so a
    hand-built wrapped model's files do not fit the unwrapped model (Keras
    refuses them) until `set_checkpoint_names` gives each wrapper its inner
    layer's entry; then each loads the other's files, nested Functional
    blocks included. One process: the naming is the same on any cluster."""
    keras.utils.set_random_seed(2)
    plain = _hand_placed(lambda layer: layer)
    expected = [w + 0.5 for w in plain.get_weights()]  # not the initial values
    plain.set_weights(expected)
    wrapped = _hand_placed(P.FullyShard)
    P.set_full_weights(wrapped, expected)
    wrapped.save_weights(str(tmp_path / "default.weights.h5"))
    with pytest.raises(ValueError, match="could not be loaded"):
        _hand_placed(lambda layer: layer).load_weights(str(tmp_path / "default.weights.h5"))

    assert P.set_checkpoint_names(wrapped) is wrapped
    wrapped.save_weights(str(tmp_path / "named.weights.h5"))
    wrapped.save(str(tmp_path / "named.keras"))
    for name in ("named.weights.h5", "named.keras"):
        other = _hand_placed(lambda layer: layer)
        other.load_weights(str(tmp_path / name))
        for got, want in zip(other.get_weights(), expected):
            np.testing.assert_array_equal(got, want)
    # And back: a named wrapped model loads the unwrapped model's file.
    plain.save_weights(str(tmp_path / "plain.weights.h5"))
    back = P.set_checkpoint_names(_hand_placed(P.FullyShard))
    back.load_weights(str(tmp_path / "plain.weights.h5"))
    for got, want in zip(P.full_weights(back), expected):
        np.testing.assert_array_equal(got, want)
    with pytest.raises(TypeError, match="Received: model="):
        P.set_checkpoint_names(keras.layers.Dense(2))


class _Attributes(keras.Model):
    def __init__(self, wrap, **kwargs):
        super().__init__(**kwargs)
        self.first = wrap(keras.layers.Dense(3), "dense")
        self.second = wrap(keras.layers.Dense(2), "dense_1")

    def call(self, x):
        return self.second(self.first(x))


def test_subclassed_model_entries_follow_keras_walk(tmp_path):
    """Keras saves a subclassed model's layer under its attribute when the
    name sorts before "layers" ("first"), else in the `layers` list by
    class ("layers/dense_1"). A hand-given checkpoint_name applies to list
    entries only, so giving both wrappers their unwrapped list names is
    right whichever way Keras walks; set_checkpoint_names leaves a
    subclassed model's names alone (it cannot see the attribute order)."""
    keras.utils.set_random_seed(3)
    plain = _Attributes(lambda layer, name: layer)
    plain(np.zeros((1, 4), "float32"))
    wrapped = _Attributes(lambda layer, name: P.FullyShard(layer, checkpoint_name=name))
    wrapped(np.zeros((1, 4), "float32"))
    P.set_full_weights(wrapped, plain.get_weights())
    P.set_checkpoint_names(wrapped)
    assert [w.checkpoint_name for w in (wrapped.first, wrapped.second)] == ["dense", "dense_1"]
    wrapped.save_weights(str(tmp_path / "w.weights.h5"))
    other = _Attributes(lambda layer, name: layer)
    other(np.zeros((1, 4), "float32"))
    other.load_weights(str(tmp_path / "w.weights.h5"))
    for got, want in zip(other.get_weights(), plain.get_weights()):
        np.testing.assert_array_equal(got, want)


def test_config_round_trips():
    layer = P.FullyShard(keras.layers.Dense(3, name="d"), accumulation="local", accumulation_steps=2)
    config = layer.get_config()
    again = P.FullyShard.from_config(config)
    assert again.get_config() == config
    assert again.name == "d" and again.accumulation is P.Accumulation.LOCAL


# --- Errors ----------------------------------------------------------------------


class _NoBuild(keras.layers.Layer):
    def call(self, x):
        return x * 2.0


class _IntWeight(keras.layers.Layer):
    def build(self, shape):
        self.w = self.add_weight(shape=(2,), dtype="int32", initializer="zeros")

    def call(self, x):
        return x


class _WeightInInit(keras.layers.Layer):
    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.w = self.add_weight(shape=(2,), initializer="ones")

    def call(self, x):
        return x * self.w


def test_errors_name_the_layer():
    with pytest.raises(TypeError, match="Received: layer="):
        P.FullyShard("dense")
    with pytest.raises(ValueError, match="already fully sharded"):
        P.FullyShard(P.FullyShard(keras.layers.Dense(2)))
    with pytest.raises(ValueError, match="parallel layer"):
        P.FullyShard(P.ColumnParallelDense(2))
    with pytest.raises(ValueError, match="accumulation"):
        P.FullyShard(keras.layers.Dense(2), accumulation="sometimes")
    with pytest.raises(ValueError, match="no weights"):
        P.FullyShard(_NoBuild(name="nob"))(keras.Input((2,)))
    with pytest.raises(ValueError, match="'intw'.*cannot be sharded.*Received: dtype=int32"):
        P.FullyShard(_IntWeight(name="intw"))(keras.Input((2,)))
    with pytest.raises(ValueError, match="'winit'.*outside `build`"):
        P.FullyShard(_WeightInInit(name="winit"))(keras.Input((2,)))
    with pytest.raises(ValueError, match="regularizer"):
        P.FullyShard(keras.layers.Dense(2, kernel_regularizer="l2"))(keras.Input((2,)))
    with pytest.raises(ValueError, match="not a weight"):
        P.FullyShard(keras.layers.Dropout(0.5, seed=1))(keras.Input((2,)))
    with pytest.raises(ValueError, match=r"takes a built Keras model.*Received: model=<Sequential"):
        P.fully_shard(keras.Sequential([keras.layers.Dense(2)]))


@pytest.mark.inprocess
def test_a_mesh_that_does_not_fit_the_world_is_refused():
    with make_strategy(2).scope():
        with pytest.raises(ValueError, match="world size"):
            P.FullyShard(keras.layers.Dense(2), mesh=P.Mesh((3,), ("data",)))(keras.Input((2,)))


@pytest.mark.inprocess
def test_a_model_built_on_its_first_batch_is_refused_with_the_remedy():
    # Without keras.Input the layer would build inside the traced step (fit's
    # symbolic build, predict's first call), where its full initial value is
    # symbolic: a clear error naming the remedy, then the remedy works.
    x = np.ones((8, 3), "float32")
    with make_strategy(2).scope():
        model = keras.Sequential([P.FullyShard(keras.layers.Dense(4)), keras.layers.Dense(1)])
        model.compile("sgd", "mse")
    with pytest.raises(ValueError, match="must be built before.*keras.Input.*Received: input_shape"):
        model.predict(x, verbose=0)
    with make_strategy(2).scope():
        model = keras.Sequential([P.FullyShard(keras.layers.Dense(4)), keras.layers.Dense(1)])
        model.build((None, 3))
        model.compile("sgd", "mse")
    assert model.predict(x, verbose=0).shape == (8, 1)
