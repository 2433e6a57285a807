"""ParallelOptimizer in one process: 2 replicas on logical CPUs, or none.

Every training test compares against plain single-process `fit` with the
same optimizer on the same samples, batch = accumulation_steps x global
micro-batch.
"""

import logging
import sys

import keras
import numpy as np
import pytest
import tensorflow as tf
from _cluster import REPO_DIR
from conftest import make_strategy

import keras_comm
from keras_comm.callbacks import ParallelOptimizer

sys.path.insert(0, str(REPO_DIR))  # benchmarks/ (as tests/acceptance/test_benchmarks.py)
from benchmarks._graphs import concrete_functions, graph_nodes  # noqa: E402

MICRO = 8  # global micro-batch
RTOL = 1e-4


def _data(n=64, seed=0):
    rng = np.random.default_rng(seed)
    return (
        rng.normal(size=(n, 5)).astype("float32"),
        rng.normal(size=(n, 3)).astype("float32"),
    )


def _optimizer(name, lso=False):
    opt = {
        "sgd": lambda: keras.optimizers.SGD(0.1, momentum=0.9),
        "adam": lambda: keras.optimizers.Adam(0.05),
        "adamw": lambda: keras.optimizers.AdamW(0.05, weight_decay=0.1),
    }[name]()
    return keras.optimizers.LossScaleOptimizer(opt) if lso else opt


def _model(opt, dtype=None):
    keras.utils.set_random_seed(1)
    model = keras.Sequential(
        [
            keras.Input((5,)),
            keras.layers.Dense(4, activation="tanh", dtype=dtype),
            keras.layers.Dense(3, dtype=dtype),
        ]
    )
    model.compile(optimizer=opt, loss="mse")
    return model


def _ds(x, y, batch, unknown_length=False):
    ds = tf.data.Dataset.from_tensor_slices((x, y)).batch(batch)
    if unknown_length:
        ds = ds.filter(lambda a, b: True)
    return ds


def _reference(name, acc, x, y, epochs=2, lso=False, dtype=None, fits=1):
    model = _model(_optimizer(name, lso), dtype)
    for _ in range(fits):
        model.fit(_ds(x, y, MICRO * acc), epochs=epochs, verbose=0)
    return model.get_weights()


def _parallel(name, x, y, epochs=2, strategy=None, lso=False, dtype=None, fits=1,
              unknown_length=False, **kwargs):
    strategy = strategy or make_strategy(2)
    with strategy.scope():
        model = _model(_optimizer(name, lso), dtype)
    callbacks = []
    for _ in range(fits):
        po = ParallelOptimizer(**kwargs)
        callbacks.append(po)
        # Keeps the step functions for inspection; runs before
        # po.on_train_end restores the model's own train function.
        capture = keras.callbacks.LambdaCallback(
            on_train_end=lambda logs, po=po: setattr(po, "captured", dict(po._functions))
        )
        model.fit(_ds(x, y, MICRO, unknown_length), epochs=epochs, verbose=0,
                  callbacks=[capture, po])
    return model, callbacks[-1]


def _max_rel(a, b):
    return max(
        float(np.abs(u - v).max() / max(np.abs(v).max(), 1e-12)) for u, v in zip(a, b)
    )


# Every optimizer meets every accumulation_steps and every zero_stage
# (a Latin square over the 27 combinations); the two real-cluster runs cover
# more combinations.
MATRIX = [
    ("sgd", 1, 0), ("adam", 2, 0), ("adamw", 4, 0),
    ("adam", 1, 1), ("adamw", 2, 1), ("sgd", 4, 1),
    ("adamw", 1, 2), ("sgd", 2, 2), ("adam", 4, 2),
]


# keras_comm collectives each step function issues, per replica: gradients
# are communicated once per window (zero_stage 2: reduce-scattered into the
# sharded buffer every micro-step, by design).
COLLECTIVES = {
    0: ([], ["CollectiveReduceV2"]),
    1: ([], ["CollectiveAllToAllV2", "CollectiveGatherV2"]),  # CPU reduce-scatter = all-to-all
    2: (["CollectiveAllToAllV2"], ["CollectiveAllToAllV2", "CollectiveGatherV2"]),
}


@pytest.mark.parametrize("name,acc,zero", MATRIX, ids=lambda v: str(v))
def test_matches_single_process(name, acc, zero):
    x, y = _data()
    model, po = _parallel(name, x, y, accumulation_steps=acc, zero_stage=zero)
    assert _max_rel(model.get_weights(), _reference(name, acc, x, y)) <= RTOL
    assert po.counts == {"micro_steps": 16, "updates": 16 // acc}
    micro_ops, apply_ops = COLLECTIVES[zero]
    per_replica = lambda ops: sorted(ops)[::2]  # 2 replicas in one graph
    if acc > 1:
        assert per_replica(_collective_ops(po.captured["micro"])) == sorted(micro_ops)
    assert per_replica(_collective_ops(po.captured["apply"])) == sorted(apply_ops)
    if zero == 0:
        assert po.state_bytes(breakdown=True) == po.unsharded_state_bytes()


@pytest.mark.parametrize("acc,zero", [(1, 0), (2, 0), (1, 1), (2, 1), (2, 2)])
def test_buckets_match_single_process(acc, zero, monkeypatch):
    # Collectives per bucket of at most 16 elements: the variables (20, 4,
    # 12, 3 elements) travel as [20], [4, 12], [3]; the result is unchanged.
    from keras_comm.training import sharding

    monkeypatch.setattr(sharding, "BUCKET_ELEMENTS", 16)
    x, y = _data(32)
    model, po = _parallel("adam", x, y, accumulation_steps=acc, zero_stage=zero)
    state = po._engine.state
    assert len(state.buckets) == 3
    assert _max_rel(model.get_weights(), _reference("adam", acc, x, y)) <= RTOL
    # The gradient collectives are issued last bucket first, the order in
    # which backward makes the gradients (so each bucket is reduced, and its
    # full-size gradients freed, while backward goes on); the all-gathers
    # of the updated weights follow in variable order.
    packed = [state.layout.sub(*b).packed_size for b in state.buckets]
    fn = po.captured["micro" if zero == 2 and acc > 1 else "apply"]
    sizes = _gradient_collective_sizes(fn)
    assert sizes == packed[::-1], (sizes, packed)


@pytest.mark.parametrize("unknown_length", [False, True], ids=["known", "unknown"])
def test_partial_window_at_epoch_end(unknown_length):
    # 7 micro-batches per epoch, windows of 4: updates on 4 then 3 micro-batches,
    # i.e. plain batches of 32 then 24.
    x, y = _data(56)
    model, po = _parallel("adam", x, y, accumulation_steps=4, zero_stage=1,
                          unknown_length=unknown_length)
    assert po.counts == {"micro_steps": 14, "updates": 4}
    assert _max_rel(model.get_weights(), _reference("adam", 4, x, y)) <= RTOL


def test_sum_instead_of_mean():
    x, y = _data(32)
    model, _ = _parallel("sgd", x, y, epochs=1, accumulation_steps=2, mean=False)
    ref = _model(keras.optimizers.SGD(0.2, momentum=0.9))  # sum of 2 = 2 x mean
    ref.fit(_ds(x, y, 2 * MICRO), epochs=1, verbose=0)
    assert _max_rel(model.get_weights(), ref.get_weights()) <= RTOL


def test_second_fit_continues_the_sharded_state():
    x, y = _data(32)
    model, _ = _parallel("adam", x, y, epochs=1, fits=2, accumulation_steps=2, zero_stage=2)
    assert _max_rel(model.get_weights(), _reference("adam", 2, x, y, epochs=1, fits=2)) <= RTOL
    assert int(model.optimizer.iterations.numpy()) == 4
    # The model's own train function is back after fit.
    assert model.train_function.__name__ != "_train_function"


def test_a_new_stage_takes_over_the_state():
    # zero_stage 1, then 2, then 0 on the same model: each new state cuts
    # its shards from the previous one's (handed back full size).
    x, y = _data(32)
    strategy = make_strategy(2)
    with strategy.scope():
        model = _model(_optimizer("adam"))
    for zero in (1, 2, 0):
        model.fit(_ds(x, y, MICRO), epochs=1, verbose=0,
                  callbacks=[ParallelOptimizer(accumulation_steps=2, zero_stage=zero)])
    assert _max_rel(model.get_weights(), _reference("adam", 2, x, y, epochs=1, fits=3)) <= RTOL


@pytest.mark.parametrize("zero", [0, 1, 2])
def test_no_full_size_optimizer_state_between_steps(zero):
    # The optimizer's own slots and the masters hold no memory once the
    # callback's (sharded) slots are the state; state_bytes() counts what is held.
    x, y = _data(32)
    model, po = _parallel("adam", x, y, epochs=1, accumulation_steps=2, zero_stage=zero)
    slots = [v for v in model.optimizer.variables if len(v.shape)]
    assert slots and all(v.numpy().size == 0 for v in slots)
    state = po._engine.state
    for replica in state.replicas:
        assert all(m.numpy().size == 0 for m in replica.masters)
        held = sum(v.numpy().nbytes for v in replica.slot_variables())
        assert held == po.state_bytes(breakdown=True)["optimizer"]


def test_loss_scale_optimizer():
    x, y = _data(32)
    model, _ = _parallel("adam", x, y, lso=True, accumulation_steps=2, zero_stage=1)
    ref = _reference("adam", 2, x, y, lso=True)
    assert _max_rel(model.get_weights(), ref) <= RTOL


def test_mixed_precision():
    x, y = _data(32)
    model, po = _parallel("adamw", x, y, lso=True, dtype="mixed_float16",
                          accumulation_steps=2, zero_stage=1)
    ref = _reference("adamw", 2, x, y, lso=True, dtype="mixed_float16")
    # float16 forward passes over halves vs the whole batch: float16 round-off.
    assert _max_rel(model.get_weights(), ref) <= 2e-3
    assert all(v.dtype == "float32" for v in po._engine.state.replicas[0].masters)


def test_without_strategy_trains_as_one_replica():
    x, y = _data(32)
    model = _model(_optimizer("adam"))
    po = ParallelOptimizer(accumulation_steps=2, zero_stage=1)
    model.fit(_ds(x, y, MICRO), epochs=2, verbose=0, callbacks=[po])
    assert _max_rel(model.get_weights(), _reference("adam", 2, x, y)) <= RTOL
    assert po._engine.state.num_shards == 1


def _collective_ops(function):
    """Op types of keras_comm ParallelOptimizer collectives in `function`'s graphs."""
    return [
        node.op
        for concrete in concrete_functions(function)
        for node in graph_nodes(concrete)
        if node.op.startswith("Collective") and "parallel_optimizer" in node.name
    ]


def _gradient_collective_sizes(function):
    """Elements of each gradient collective (all-reduce, or the all-to-all of
    a CPU reduce-scatter) of the first replica, in the order `function`'s
    graph issues them."""
    sizes = []
    for concrete in concrete_functions(function):
        for op in concrete.graph.get_operations():
            if "parallel_optimizer" in op.name and op.type in (
                "CollectiveReduceV2", "CollectiveAllToAllV2"
            ) and op.inputs[0].dtype == tf.float32 and op.inputs[0].shape.rank:
                sizes.append(op.inputs[0].shape.num_elements())
    return sizes[: len(sizes) // 2]  # 2 replicas in one graph, the first traced first


@pytest.mark.parametrize("zero", [1, 2])
def test_state_bytes_are_one_nth(zero, caplog):
    x, y = _data(16)
    with caplog.at_level(logging.INFO, logger="keras_comm"):
        model, po = _parallel("adam", x, y, epochs=1, accumulation_steps=2, zero_stage=zero)
    n, num_vars = 2, len(model.trainable_variables)
    # unsharded_state_bytes() equals zero_stage 0's state_bytes(): checked
    # in test_matches_single_process.
    sharded, unsharded = po.state_bytes(breakdown=True), po.unsharded_state_bytes()
    sizes = [int(np.prod(v.shape)) for v in model.trainable_variables]
    assert unsharded["master"] == 4 * sum(sizes)
    kinds = ["optimizer", "master"] + (["accumulation"] if zero == 2 else [])
    for kind, tensors in zip(kinds, [2, 1, 1]):  # Adam: 2 slots per variable
        assert unsharded[kind] / n <= sharded[kind] <= unsharded[kind] / n + 4 * tensors * num_vars
    assert po.state_bytes() == sum(sharded.values())
    assert "optimizer state per replica:" in caplog.text and "(1/2 of" in caplog.text


def test_dump_local_norm():
    x, y = _data(16)
    seen = []

    class Record(keras.callbacks.Callback):
        def on_train_batch_end(self, batch, logs=None):
            seen.append(dict(logs))

    strategy = make_strategy(2)
    with strategy.scope():
        model = _model(_optimizer("sgd"))
    model.fit(_ds(x, y, MICRO), epochs=1, verbose=0,
              callbacks=[ParallelOptimizer(dump_local_norm=True), Record()])
    keys = {f"local_grad_norm/{v.path}" for v in model.trainable_variables}
    assert keys <= set(seen[-1])
    assert all(np.isfinite(seen[-1][k]) and seen[-1][k] > 0 for k in keys)


@pytest.mark.parametrize("kwargs,arg", [
    (dict(accumulation_steps=0), "accumulation_steps"),
    (dict(accumulation_steps=1.5), "accumulation_steps"),
    (dict(accumulation_steps=True), "accumulation_steps"),
    (dict(zero_stage=3), "zero_stage"),
    (dict(zero_stage="1"), "zero_stage"),
    (dict(mean="yes"), "mean"),
])
def test_invalid_arguments(kwargs, arg):
    with pytest.raises(ValueError, match=f"Received: {arg}="):
        ParallelOptimizer(**kwargs)


def test_unsupported_strategy():
    strategy = tf.distribute.MirroredStrategy(["/cpu:0", "/cpu:1"])
    with strategy.scope():
        model = _model(_optimizer("sgd"))
    x, y = _data(16)
    with pytest.raises(ValueError, match="Received: strategy=MirroredStrategy"):
        model.fit(_ds(x, y, MICRO), verbose=0, callbacks=[ParallelOptimizer()])


def test_unsupported_optimizer_options():
    x, y = _data(16)
    with make_strategy(2).scope():
        model = _model(keras.optimizers.Adam(global_clipnorm=1.0))
    with pytest.raises(ValueError, match="Received: global_clipnorm="):
        model.fit(_ds(x, y, MICRO), verbose=0, callbacks=[ParallelOptimizer(zero_stage=1)])


def test_exported():
    assert keras_comm.callbacks.ParallelOptimizer is ParallelOptimizer
