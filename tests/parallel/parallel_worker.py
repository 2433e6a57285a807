"""Model-parallel scenarios, shared by the in-process tests and real workers.

Each scenario trains or runs a keras_comm.parallel model under a strategy and
the equivalent unsplit model in this process alone (no strategy), and
returns max relative differences. In-process tests
(tests/parallel/test_parallel_layers.py) call them with logical-device strategies;
run as a script (by tests/parallel/test_parallel_multiprocess.py through
`run_cluster`) every worker is one replica of a real
MultiWorkerMirroredStrategy and writes its numbers with `write_result`.
"""

import time

import keras
import numpy as np
import tensorflow as tf

import keras_comm
from _shared import rel  # noqa: E402
from keras_comm import parallel as P

RTOL = 1e-4


# --- Tensor parallel MLP with a parallel embedding -------------------------

VOCAB, SEQ = 8, 3


def tp_model(parallel, mesh=None):
    """Embedding -> flatten -> Dense(8, tanh) -> Dense(4) -> Dense(2)."""
    if parallel:
        layers = [
            P.ParallelEmbedding(VOCAB, 4, mesh=mesh, seed=1),
            keras.layers.Flatten(),
            P.ColumnParallelDense(8, activation="tanh", mesh=mesh, seed=2),
            P.RowParallelDense(4, mesh=mesh, seed=3),
        ]
    else:
        layers = [
            keras.layers.Embedding(VOCAB, 4),
            keras.layers.Flatten(),
            keras.layers.Dense(8, activation="tanh"),
            keras.layers.Dense(4),
        ]
    return keras.Sequential([keras.Input((SEQ,), dtype="int32")] + layers + [keras.layers.Dense(2)])


def tp_data(n_samples=16):
    rs = np.random.RandomState(0)
    x = rs.randint(0, VOCAB, size=(n_samples, SEQ)).astype("int32")
    y = rs.randn(n_samples, 2).astype("float32")
    return x, y


def tp_fit(strategy, mesh=None, epochs=2, callbacks=None, optimizer=None):
    """Trains the split and the unsplit model on the same data; compares.

    `callbacks` (e.g. a ParallelOptimizer) go to the split model's fit only:
    the reference is always plain single-process training. `optimizer` is a
    zero-argument factory (default: Adam(0.01)).
    """
    optimizer = optimizer or (lambda: keras.optimizers.Adam(0.01))
    x, y = tp_data()
    keras.utils.set_random_seed(0)
    ref = tp_model(False)
    ref.compile(optimizer(), "mse")
    initial = ref.get_weights()
    h_ref = ref.fit(x, y, batch_size=8, epochs=epochs, shuffle=False, verbose=0).history["loss"]
    with strategy.scope():
        model = tp_model(True, mesh)
        model.compile(optimizer(), "mse")
    P.set_full_weights(model, initial)
    n = strategy.num_replicas_in_sync
    sharded = [w for w in model.weights if P.is_sharded(w)]
    # Bytes each local replica holds of each sharded weight, vs the full weight.
    fractions = sorted(
        {
            round(b / (np.prod(P.shard_spec(w).full_shape) * 4), 6)
            for w in sharded
            for b in P.shard_nbytes(w).values()
        }
    )
    h = model.fit(
        x, y, batch_size=8, epochs=epochs, shuffle=False, verbose=0, callbacks=callbacks
    ).history["loss"]
    ev = model.evaluate(x, y, batch_size=8, verbose=0)
    pred = model.predict(x, batch_size=8, verbose=0)
    return {
        "loss_rel": rel([h_ref], [h]),
        "weights_rel": rel(ref.get_weights(), P.full_weights(model)),
        "evaluate_rel": rel([ref.evaluate(x, y, batch_size=8, verbose=0)], [ev]),
        "predict_rel": rel([ref.predict(x, batch_size=8, verbose=0)], [pred]),
        "shard_fractions": fractions,
        "num_sharded": len(sharded),
        "group_size": mesh.axis_size("model") if mesh is not None else n,
    }


# --- Unseeded weights agree across workers ---------------------------------


def same_shard_values(strategy, mesh, epochs=1):
    """Unseeded tensor-parallel and FullyShard weights on a data x model mesh,
    the chief having made layers of the same classes first.

    Automatic layer names count the layers a process made before, so the
    chief's weight paths (and the seeds once derived from them) differ from
    the other workers'. Returns this worker's shards of every per-replica
    weight, after build and after `fit`, with its model coordinate: the
    replicas with the same coordinate hold the same shard and must hold
    the same values.
    """
    if _task(strategy) == 0:  # a chief's evaluation copy, say: never built
        P.ParallelEmbedding(VOCAB, 4, mesh=mesh)
        P.ColumnParallelDense(8, mesh=mesh)
        P.RowParallelDense(4, mesh=mesh)
        keras.layers.Dense(2)
    x, y = tp_data()
    with strategy.scope():
        model = keras.Sequential(
            [
                keras.Input((SEQ,), dtype="int32"),
                P.ParallelEmbedding(VOCAB, 4, mesh=mesh),
                keras.layers.Flatten(),
                P.ColumnParallelDense(8, activation="tanh", mesh=mesh),
                P.RowParallelDense(4, mesh=mesh),
                P.FullyShard(keras.layers.Dense(2), mesh=mesh, axis="model"),
            ]
        )
        model.compile(keras.optimizers.Adam(0.01), "mse")
    weights = [w for w in model.weights if P.is_sharded(w)]

    def shards():
        out = {}
        for w in weights:
            (rank, value), = P.process_shards(w).items()  # one replica per worker
            out[w.path] = np.asarray(value).tolist()
        return rank, out

    rank, built = shards()
    model.fit(x, y, batch_size=8, epochs=epochs, shuffle=False, verbose=0)
    _, trained = shards()
    coordinates = [int(c) for c in mesh.coordinates(rank)]
    return {
        "model_coordinate": coordinates[mesh.axes.index("model")],
        "coordinates": coordinates,
        "paths": [w.path for w in weights],
        "built": list(built.values()),
        "trained": list(trained.values()),
    }


def _task(strategy):
    return keras_comm.topology.task_id(strategy)


# --- Mixture of experts vs a dense simulation ------------------------------

D, UNITS, TOKENS, EXPERTS_PER_REPLICA = 3, 2, 6, 2


def moe_tokens(rank):
    rs = np.random.RandomState(100 + rank)
    return rs.randn(TOKENS, D)


def reference_keep(probs, top_k, cap):
    """Plain-Python routing: which (token, expert) choices fit (GShard order)."""
    t_count, e_count = probs.shape
    order = np.argsort(-probs, axis=1, kind="stable")[:, :top_k]
    used = np.zeros(e_count, int)
    keep = np.zeros((t_count, e_count))
    for k in range(top_k):
        for t in range(t_count):
            e = order[t, k]
            if used[e] < cap:
                keep[t, e] = 1.0
            used[e] += 1
    return keep


def moe_layer(num_experts, top_k, capacity_factor):
    return P.MixtureOfExperts(
        num_experts, UNITS, top_k=top_k, capacity_factor=capacity_factor,
        activation="tanh", dtype="float64", seed=5,
    )


def moe_check(strategy, top_k=2, capacity_factor=0.75, mode="function"):
    """Distributed MoE forward and gradients vs a float64 dense simulation."""
    n = strategy.num_replicas_in_sync
    E = EXPERTS_PER_REPLICA * n
    with strategy.scope():
        layer = moe_layer(E, top_k, capacity_factor)
        layer.build((None, D))
    router, kernel, bias = P.full_weights(layer)

    def replica_fn():
        r = keras_comm.rank()
        x = tf.constant(moe_tokens(r))
        with tf.GradientTape() as tape:
            tape.watch(x)
            y = layer(x)
            loss = tf.reduce_sum(y * weights_for(r, y.shape))
        gx, gr, gk, gb = tape.gradient(loss, [x, layer.router, layer.kernel, layer.bias])
        return y, gx, gr, gk, gb

    fn = lambda: strategy.run(replica_fn)  # noqa: E731
    out = tf.function(fn)() if mode == "function" else fn()
    local = [strategy.experimental_local_results(o) for o in out]

    # Dense simulation: every expert on every token, masked by the routing.
    cap = int(np.ceil(capacity_factor * TOKENS * top_k / E))
    router_v, kernel_v, bias_v = (tf.Variable(v) for v in (router, kernel, bias))
    xs = [tf.constant(moe_tokens(r)) for r in range(n)]
    dropped = 0
    with tf.GradientTape(persistent=True) as tape:
        tape.watch(xs)
        ys, losses = [], []
        for r, x in enumerate(xs):
            probs = tf.nn.softmax(x @ router_v)
            keep = reference_keep(probs.numpy(), top_k, cap)
            dropped += top_k * TOKENS - int(keep.sum())
            experts = tf.tanh(tf.einsum("td,edu->teu", x, kernel_v) + bias_v[None])
            y = tf.einsum("te,teu->tu", probs * keep, experts)
            ys.append(y)
            losses.append(tf.reduce_sum(y * weights_for(r, y.shape)))
        total = tf.add_n(losses)
    gxs, gr, gk, gb = tape.gradient(total, [xs, router_v, kernel_v, bias_v])

    ranks = _local_ranks(strategy, len(local[0]))
    errs = {"forward": 0.0, "grad_x": 0.0, "grad_router": 0.0, "grad_experts": 0.0}
    local_router = []
    for i, r in enumerate(ranks):
        # The router acts on replica r's tokens only: its local gradient is
        # that of replica r's own loss (the optimizer then sums replicas).
        y, gx, g_router, g_kernel, g_bias = (np.asarray(o[i]) for o in local)
        errs["forward"] = max(errs["forward"], rel([ys[r]], [y]))
        errs["grad_x"] = max(errs["grad_x"], rel([gxs[r]], [gx]))
        sl = slice(r * EXPERTS_PER_REPLICA, (r + 1) * EXPERTS_PER_REPLICA)
        errs["grad_experts"] = max(
            errs["grad_experts"], rel([gk[sl], gb[sl]], [g_kernel, g_bias])
        )
        local_router.append(g_router)
        errs["grad_router"] = max(
            errs["grad_router"], rel([tape.gradient(losses[r], router_v)], [g_router])
        )
    if len(ranks) == n:  # all replicas here: their sum is the total gradient
        errs["grad_router"] = max(errs["grad_router"], rel([gr], [np.sum(local_router, 0)]))
    return {"errors": errs, "dropped": dropped, "num_experts": E}


def weights_for(rank, shape):
    return tf.random.stateless_uniform(shape, seed=[rank, 11], minval=0.5, maxval=1.5, dtype=tf.float64)


def _local_ranks(strategy, count):
    task = _task(strategy)
    return [task * count + i for i in range(count)]


# --- Two-stage pipeline -----------------------------------------------------


def pipeline_model(parallel, micro_batches=2):
    first = keras.Sequential([keras.layers.Dense(6, activation="tanh")], name="first")
    second = keras.Sequential([keras.layers.Dense(2)], name="second")
    if parallel:
        body = [P.PipelineStage(first, second, num_micro_batches=micro_batches)]
    else:
        body = [first, second]
    return keras.Sequential([keras.Input((4,))] + body)


def pipeline_fit(strategy, epochs=2):
    rs = np.random.RandomState(3)
    x = rs.randn(16, 4).astype("float32")
    y = rs.randn(16, 2).astype("float32")
    keras.utils.set_random_seed(0)
    ref = pipeline_model(False)
    ref.compile(keras.optimizers.SGD(0.1), "mse")
    initial = ref.get_weights()
    h_ref = ref.fit(x, y, batch_size=8, epochs=epochs, shuffle=False, verbose=0).history["loss"]
    with strategy.scope():
        model = pipeline_model(True)
        model.compile(keras.optimizers.SGD(0.1), "mse")
    model.set_weights(initial)
    h = model.fit(x, y, batch_size=8, epochs=epochs, shuffle=False, verbose=0).history["loss"]
    return {
        "loss_rel": rel([h_ref], [h]),
        "weights_rel": rel(ref.get_weights(), model.get_weights()),
    }


def results(strategy):
    """This worker's numbers of every scenario for its worker count (2 or 4)."""
    n = strategy.num_replicas_in_sync
    result = {"n": n}
    start = time.time()
    if n == 4:
        mesh = P.Mesh(shape=(2, 2), axes=("data", "model"))
        result["tp"] = tp_fit(strategy, mesh)
        result["same_shard"] = same_shard_values(strategy, mesh)
    else:
        result["tp"] = tp_fit(strategy)
    result["moe"] = moe_check(strategy)
    if n == 2:
        result["pipeline"] = pipeline_fit(strategy)
    result["seconds"] = time.time() - start
    return result


if __name__ == "__main__":
    # One group alone (the suite runs it in a shared launch:
    # tests/acceptance/shared_launch_worker.py, tests/parallel/pipeline_worker.py).
    from _cluster import finish, write_result
    from _strategy import strategy

    write_result(results(strategy))
    finish()  # skip the slow teardown
