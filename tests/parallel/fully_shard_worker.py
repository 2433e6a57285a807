"""Fully sharded (ZeRO-3) scenarios, shared by in-process tests and real workers.

Each scenario trains a `keras_comm.parallel.fully_shard` copy of a model
under a strategy and the unwrapped model in this process alone (no strategy)
on the same global batches, and returns max relative differences of the
losses, final weights, evaluate and predict. tests/parallel/test_fully_shard.py calls
them with logical-device strategies; run as a script (by
tests/parallel/test_fully_shard_multiprocess.py) every worker is one replica of a real
MultiWorkerMirroredStrategy.
"""

import os
import tempfile
import time

import keras
import numpy as np
import tensorflow as tf

import keras_comm
from keras_comm import parallel as P

RTOL = 1e-5
BATCH = 8


def rel(expected, actual):
    """Max over arrays of max|e - a| / max|e|; an array that stays near zero
    (attention's key bias, whose gradient is zero up to rounding) is compared
    absolutely: its denominator is at least 1e-2."""
    worst = 0.0
    for e, a in zip(expected, actual, strict=True):
        e, a = np.asarray(e, np.float64), np.asarray(a, np.float64)
        worst = max(worst, float(np.max(np.abs(e - a)) / max(np.max(np.abs(e)), 1e-2)))
    return worst


# --- Models -----------------------------------------------------------------


def mlp():
    return keras.Sequential(
        [
            keras.Input((5,)),
            keras.layers.Dense(7, activation="tanh", name="d1"),
            keras.layers.LayerNormalization(name="ln"),
            keras.layers.Dense(3, name="d2"),
        ],
        name="mlp",
    )


def cnn():
    return keras.Sequential(
        [
            keras.Input((6, 6, 2)),
            keras.layers.Conv2D(3, 3, activation="relu", name="c1"),
            keras.layers.Flatten(),
            keras.layers.Reshape((16, 3)),
            keras.layers.Conv1D(2, 3, name="c2"),
            keras.layers.Flatten(),
            keras.layers.Dense(3, name="out"),
        ],
        name="cnn",
    )


VOCAB, SEQ, DIM = 11, 4, 6


def attention():
    """Embedding + MultiHeadAttention + LayerNormalization + a nested block."""
    ids = keras.Input((SEQ,), dtype="int32")
    h = keras.layers.Embedding(VOCAB, DIM, name="emb")(ids)
    a = keras.layers.MultiHeadAttention(2, 3, name="mha")(h, h)
    h = keras.layers.LayerNormalization(name="ln")(h + a)
    block = keras.Sequential(
        [keras.Input((SEQ, DIM)), keras.layers.Dense(5, activation="relu", name="ff1"), keras.layers.Dense(DIM, name="ff2")],
        name="ffn",
    )
    h = h + block(h)
    h = keras.layers.GlobalAveragePooling1D()(h)
    out = keras.layers.Dense(3, name="head")(h)
    return keras.Model(ids, out, name="attention")


def three():
    """The MLP, the CNN and the attention block side by side in one model:
    three inputs, three outputs, the loss the sum of the three mse's.

    No weight of one branch sees another branch's loss, and SGD, Adam and
    AdamW update each variable from its own gradient alone, so one fit of
    this model trains the three models exactly as three fits would -- for a
    third of the tracing (the exactness grid's cost)."""
    parts = [mlp(), cnn(), attention()]
    inputs = [keras.Input(p.inputs[0].shape[1:], dtype=p.inputs[0].dtype, name=f"{p.name}_in") for p in parts]
    return keras.Model(inputs, [p(x) for p, x in zip(parts, inputs)], name="three")


MODELS = {"mlp": mlp, "cnn": cnn, "attention": attention, "three": three}


def data(name, n_samples=32):
    if name == "three":
        parts = [data(part, n_samples) for part in ("mlp", "cnn", "attention")]
        return [x for x, _ in parts], [y for _, y in parts]
    rs = np.random.RandomState(0)
    if name == "mlp":
        x = rs.randn(n_samples, 5).astype("float32")
    elif name == "cnn":
        x = rs.randn(n_samples, 6, 6, 2).astype("float32")
    else:
        x = rs.randint(0, VOCAB, size=(n_samples, SEQ)).astype("int32")
    y = rs.randn(n_samples, 3).astype("float32")
    return x, y


def _dense(optimizer_class):
    """`optimizer_class` on dense gradients (for the single-process reference).

    An embedding's gradient is an IndexedSlices, and Keras's Adam squares its
    rows before summing duplicate ids; a sharded embedding's gradient is dense
    (reduce-scattered), so the reference applies Adam to the dense gradient.
    """

    class Dense(optimizer_class):
        def apply(self, grads, trainable_variables=None):
            grads = [g if g is None else tf.convert_to_tensor(g) for g in grads]
            return super().apply(grads, trainable_variables)

    return Dense


REFERENCE_OPTIMIZERS = {
    "sgd": lambda: keras.optimizers.SGD(0.05, momentum=0.9),
    "adam": lambda: _dense(keras.optimizers.Adam)(0.01),
    "adamw": lambda: _dense(keras.optimizers.AdamW)(0.01, weight_decay=0.05),
}

OPTIMIZERS = {
    "sgd": lambda: keras.optimizers.SGD(0.05, momentum=0.9),
    "adam": lambda: keras.optimizers.Adam(0.01),
    "adamw": lambda: keras.optimizers.AdamW(0.01, weight_decay=0.05),
}


# --- Scenarios ----------------------------------------------------------------


def fit_case(
    strategy,
    name="mlp",
    optimizer="adam",
    accumulation_steps=1,
    accumulation="sharded",
    epochs=2,
    mesh=None,
    save_dir=None,
    n_samples=32,
    outputs=True,
):
    """The fully sharded copy vs the unwrapped model trained in one process.

    With `accumulation_steps` > 1 the copy trains under ParallelOptimizer and
    the reference with the same effective batch (BATCH * steps). `outputs`:
    also compare evaluate and predict (two more traced functions).
    """
    x, y = data(name, n_samples)
    ref, initial, h_ref, ref_evaluate, ref_predict = reference(
        name, optimizer, accumulation_steps, epochs, n_samples
    )
    keras.utils.set_random_seed(0)
    unwrapped = MODELS[name]()
    unwrapped.set_weights(initial)
    with strategy.scope():
        model = P.fully_shard(
            unwrapped,
            mesh=mesh,
            accumulation=accumulation,
            accumulation_steps=accumulation_steps if accumulation == "local" else 1,
        )
        model.compile(OPTIMIZERS[optimizer](), "mse")
    callbacks = []
    if accumulation_steps > 1:
        callbacks = [keras_comm.callbacks.ParallelOptimizer(accumulation_steps=accumulation_steps)]
    start_rel = rel(initial, P.full_weights(model))
    h = model.fit(
        x, y, batch_size=BATCH, epochs=epochs, shuffle=False, verbose=0, callbacks=callbacks
    ).history["loss"]
    out = {
        "start_rel": start_rel,
        "loss_rel": rel([h_ref], [h]),
        "weights_rel": rel(*_comparable(ref, P.full_weights(model), optimizer)),
        "num_fully_sharded": sum(isinstance(l, P.FullyShard) for l in _all_layers(model)),
    }
    if outputs:
        out["evaluate_rel"] = rel([ref_evaluate], [model.evaluate(x, y, batch_size=BATCH, verbose=0)])
        out["predict_rel"] = rel(ref_predict, _outputs(model.predict(x, batch_size=BATCH, verbose=0)))
    n = strategy.num_replicas_in_sync
    shards = [w for l in _all_layers(model) if isinstance(l, P.FullyShard) for w in l.shard_variables]
    out["shard_elements"] = sorted({int(np.prod(w.shape)) for w in shards})
    out["full_elements"] = int(sum(np.prod(w.shape) for w in ref.trainable_weights))
    out["replica_shard_elements"] = int(sum(np.prod(w.shape) for w in shards))
    out["n"] = n
    if save_dir is not None:
        out.update(save_case(model, ref, x, y, save_dir))
    return out


# The exactness grid: every optimizer at every accumulation count, each count
# > 1 in both accumulation modes across the optimizers. Run on the "three"
# model (the MLP, the CNN and the attention block in one fit) for each worker
# count: one fit per case.
GRID = [
    ("sgd", 1, "sharded"), ("sgd", 2, "sharded"), ("sgd", 4, "local"),
    ("adam", 1, "sharded"), ("adam", 2, "sharded"), ("adam", 4, "local"),
    ("adamw", 1, "sharded"), ("adamw", 2, "local"), ("adamw", 4, "sharded"),
]
# On real workers (2 processes; one fit of the three models, ~20 CPU-s per
# process, the suite's slowest test): AdamW (Adam's moments and weight decay
# on shards; the backup phase trains Adam too), two epochs of 4 steps (the
# epoch change on real workers). Accumulation is left to the in-process grid: it adds
# ParallelOptimizer's step and the buffers to every process's trace.
REAL_GRID = [("adamw", 1, "sharded")]
# KERAS_COMM_FULL_GRID=1 (tests/parallel/test_fully_shard_multiprocess.py): one
# launch of 4 workers running these (every optimizer, accumulation count and
# mode once; each fit the three models), and the 2-worker launch running them
# too. Too costly for the suite: ~25 CPU-s per case per process.
REAL_GRID_FULL = [("adamw", 1, "sharded"), ("sgd", 2, "sharded"), ("adam", 4, "local")]
GRID_KEYS = ("start_rel", "loss_rel", "weights_rel", "evaluate_rel", "predict_rel")


def grid_case_name(optimizer, steps, accumulation):
    return f"{optimizer}/acc{steps}" + (f"/{accumulation}" if steps > 1 else "")


def grid(strategy, cases=GRID, name="three", epochs=1, n_samples=64):
    """`fit_case` for each (optimizer, accumulation steps, mode) of `cases`:
    ``{case name: result}``; a case that raises reports ``{"error": ...}``
    so that one run shows every failure.

    Evaluate and predict are compared after the first case only: they run
    the same sharded forward pass whatever trained the weights (which every
    case compares), and each costs two more traced functions per case.
    """
    out = {}
    for i, (optimizer, steps, accumulation) in enumerate(cases):
        case = grid_case_name(optimizer, steps, accumulation)
        try:
            out[case] = fit_case(
                strategy, name, optimizer=optimizer, accumulation_steps=steps,
                accumulation=accumulation, epochs=epochs, n_samples=n_samples, outputs=i == 0,
            )
        except Exception as e:  # reported, not hidden: the test fails on it
            out[case] = {"error": f"{type(e).__name__}: {e}"[:2000]}
    return out


def grid_failures(results, rtol=RTOL):
    """Every (case, key, value) of `grid`'s results over `rtol`, every error,
    and every replica holding more than 1/n (+ padding) of the weights."""
    bad = []
    for case, got in results.items():
        if "error" in got:
            bad.append((case, "error", got["error"]))
            continue
        bad += [(case, k, got[k]) for k in GRID_KEYS if k in got and not got[k] <= rtol]
        n, layers = got["n"], got["num_fully_sharded"]
        if not got["full_elements"] / n <= got["replica_shard_elements"] <= got["full_elements"] / n + layers * 4 * n:
            bad.append((case, "replica_shard_elements", (got["replica_shard_elements"], got["full_elements"], n)))
    if not any("evaluate_rel" in got and "predict_rel" in got for got in results.values()):
        bad.append(("*", "evaluate/predict", "compared in no case"))
    return bad


def _outputs(predicted):
    return list(predicted) if isinstance(predicted, (list, tuple)) else [predicted]


_REFERENCES = {}


def reference(name, optimizer, accumulation_steps=1, epochs=2, n_samples=32):
    """The unwrapped model trained in this process alone (no strategy) on the
    global batches a fit of BATCH per step with `accumulation_steps` updates
    on: ``(model, initial weights, loss history, evaluate, predict)``.

    Cached: it does not depend on the worker count, so the grid trains each
    once for both counts. Callers read it and must not train it further.
    """
    key = (name, optimizer, accumulation_steps, epochs, n_samples)
    if key not in _REFERENCES:
        x, y = data(name, n_samples)
        keras.utils.set_random_seed(0)
        ref = MODELS[name]()
        ref.compile(REFERENCE_OPTIMIZERS[optimizer](), "mse")
        initial = ref.get_weights()
        history = ref.fit(
            x, y, batch_size=BATCH * accumulation_steps, epochs=epochs, shuffle=False, verbose=0
        ).history["loss"]
        _REFERENCES[key] = (
            ref,
            initial,
            history,
            ref.evaluate(x, y, batch_size=BATCH, verbose=0),
            _outputs(ref.predict(x, batch_size=BATCH, verbose=0)),
        )
    return _REFERENCES[key]


def _comparable(ref, got, optimizer):
    """(expected, actual) weights, without attention's key bias under Adam.

    The key bias's gradient is zero in exact arithmetic (softmax ignores a
    constant added to every score); Adam normalises the rounding noise left
    in it into learning-rate-sized steps, so no two summation orders agree
    on it. SGD keeps it (the noise stays noise-sized).
    """
    keep = [
        i
        for i, w in enumerate(ref.weights)
        if optimizer == "sgd" or not w.path.endswith("key/bias")
    ]
    weights = ref.get_weights()
    return [weights[i] for i in keep], [got[i] for i in keep]


def _all_layers(model):
    out = []
    for layer in getattr(model, "layers", []):
        out.append(layer)
        out += _all_layers(layer)
    return out


def save_case(model, ref, x, y, save_dir):
    """Files written by the sharded model load into the unwrapped one."""
    is_chief = keras_comm.rank() == 0
    path = save_dir if is_chief else tempfile.mkdtemp()
    weights_file = os.path.join(path, "fs.weights.h5")
    keras_file = os.path.join(path, "fs.keras")
    model.save_weights(weights_file)
    model.save(keras_file)
    out = {}
    if is_chief:
        plain = keras.models.clone_model(ref)
        plain.compile(keras.optimizers.Adam(0.01), "mse")
        plain.load_weights(weights_file)
        out["load_weights_rel"] = rel(P.full_weights(model), plain.get_weights())
        plain2 = keras.models.clone_model(ref)
        plain2.load_weights(keras_file)
        out["load_keras_rel"] = rel(P.full_weights(model), plain2.get_weights())
    return out


def main():
    """``fully_shard_worker.py STATE_DIR [full|grid-only]``: REAL_GRID's
    cases of the grid (each fit trains the three models), the checkpoint
    worker's backup phase, then its resume phase (of the backup the test
    wrote on another replica count). "full": REAL_GRID_FULL's cases instead
    of REAL_GRID's; "grid-only": REAL_GRID_FULL's cases and nothing else."""
    import sys

    from _cluster import write_result

    import fully_shard_checkpoint_worker as checkpoints

    state_dir = sys.argv[1]
    mode = sys.argv[2] if len(sys.argv) > 2 else "suite"
    if mode not in ("suite", "full", "grid-only"):
        raise ValueError(f"mode must be 'full' or 'grid-only'. Received: mode={mode!r}")
    from _shared import without_tf_data_autotune

    without_tf_data_autotune()  # as tests/_strategy.py does, and why
    strategy = tf.distribute.MultiWorkerMirroredStrategy()
    n = strategy.num_replicas_in_sync
    result = {"n": n, "rank": int(strategy.cluster_resolver.task_id)}
    start = time.time()
    cpu = {"import": time.process_time()}  # the suite's cost, per phase
    cases = REAL_GRID if mode == "suite" else REAL_GRID_FULL
    result["grid"] = grid(strategy, cases, epochs=2, n_samples=32)
    cpu["grid"] = time.process_time() - sum(cpu.values())
    if mode == "grid-only":
        result["cpu_seconds"] = cpu
        result["seconds"] = time.time() - start
        write_result(result)
        return
    result["backup"] = checkpoints.backup_phase(strategy, state_dir)
    cpu["backup"] = time.process_time() - sum(cpu.values())
    result["resume"] = checkpoints.resume_phase(strategy, state_dir)
    cpu["resume"] = time.process_time() - sum(cpu.values())
    result["cpu_seconds"] = cpu
    result["seconds"] = time.time() - start
    write_result(result)


if __name__ == "__main__":
    main()
