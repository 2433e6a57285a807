"""`fully_shard` on KerasHub models, shared by in-process tests and real workers.

Each scenario builds a KerasHub causal LM (tiny config, random weights,
nothing downloaded; tests/parallel/distribution_worker.py's models) under a
strategy, shards it in place with `keras_comm.parallel.fully_shard`, trains
it on global batches and compares it with the same model trained alone
on the same batches (computed once per run, see `reference`); then
`generate()` (inside `keras_comm.parallel.gathered`) and `.weights.h5`
files from the sharded model to the plain one and back (and, with
`keras_files`, whole-model `.keras` files both ways). tests/parallel/test_fully_shard_kerashub.py
calls it with logical-device strategies; run as a script
(tests/parallel/test_fully_shard_multiprocess.py) every worker is one
replica of a real MultiWorkerMirroredStrategy.
"""

import fcntl
import os
import pickle
import tempfile
import time

import keras
import numpy as np

import keras_comm
from keras_comm import parallel as P
import distribution_worker as W
from fully_shard_worker import rel

MODELS = ("gpt2", "llama", "gemma")


def stored_fraction(model):
    """Elements this replica stores for the model's weights / the full model's."""
    stored = sum(int(np.prod(v.shape)) for v in model.weights)
    full = sum(int(np.prod(np.shape(w))) for w in P.full_weights(model))
    return stored / full


# Llama's untied embedding: sparse gradient alone, dense (reduce-scattered)
# fully sharded; equal under Adam because keras_comm sums a sparse
# gradient's repeated rows first (tests/training/test_sparse_gradients.py).
OPTIMIZERS = {"gpt2": "adam", "llama": "adam", "gemma": "adam"}


def compile_model(model, name, optimizer):
    if optimizer == "adam":
        return W.compile_model(model, name)
    model.compile(
        optimizer=keras.optimizers.SGD(0.05),
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        jit_compile=False,
    )


def train_and_compare(strategy, name, tmp=None, steps=2, deferred=False, optimizer=None,
                      keras_files=False, reference_dir=None):
    """Trains `name` fully sharded and compares it with the model trained alone.

    `deferred`: the sharded model is built inside `deferred_weights()`
    (never whole) instead of built whole and then sharded. `optimizer`:
    "adam" or "sgd" (default: `OPTIMIZERS[name]`). `reference_dir`: where
    the model trained alone is kept (see `reference`); default: `tmp`.
    """
    optimizer = optimizer or OPTIMIZERS[name]
    tmp = tmp or tempfile.mkdtemp()
    ref = reference(name, optimizer, steps, reference_dir or tmp)
    out = _train_and_compare(strategy, name, tmp, steps, deferred, optimizer, keras_files, ref)
    out["optimizer"] = optimizer
    return out


def build_sharded(strategy, name, deferred, optimizer):
    with strategy.scope():
        if deferred:
            with P.deferred_weights():
                model = W.MODELS[name]()
            unallocated = all(
                v._value is None for v in model.weights  # nothing allocated before sharding
            )
        else:
            model = W.MODELS[name]()
            unallocated = None
        sharded = P.fully_shard(model)
        compile_model(model, name, optimizer)
    return model, sharded, unallocated


# --- The model trained alone, once per run ------------------------------------
#
# The reference does not depend on the strategy, the replica count or
# whether the sharded model was built deferred, so it is computed once per
# (model, optimizer, steps) and kept as data in a directory: the in-process
# tests of a pytest run (in any pytest-xdist worker) and the workers of a
# cluster (the test computes it before the launch) read the same one. The
# first caller computes it under a file lock; the others wait and read it.


def reference_dir(tmp_path_factory):
    """A directory shared by every pytest-xdist worker of this pytest run."""
    base = tmp_path_factory.getbasetemp()
    if os.environ.get("PYTEST_XDIST_WORKER"):
        base = base.parent  # the run's directory, above each worker's own
    path = base / "kerashub_references"
    path.mkdir(exist_ok=True)
    return str(path)


def _cached(directory, key, compute):
    os.makedirs(directory, exist_ok=True)
    path = os.path.join(directory, key + ".pkl")
    with open(path + ".lock", "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not os.path.exists(path):
            value = compute(os.path.join(directory, key))
            with open(path + ".tmp", "wb") as f:
                pickle.dump(value, f)
            os.replace(path + ".tmp", path)
    with open(path, "rb") as f:
        return pickle.load(f)


def reference(name, optimizer, steps, directory):
    """`name` trained alone (no strategy) on `steps` global batches, as data:
    its initial and final weights, loss history, predict and generate
    outputs, and the file of its final weights (``"file"``)."""

    def compute(prefix):
        x, y = W.data(name, steps)
        ref = W.MODELS[name]()
        out = {"initial": ref.get_weights()}
        compile_model(ref, name, optimizer)
        t0 = time.perf_counter()
        out["loss"] = ref.fit(x, y, batch_size=W.BATCH, epochs=1, shuffle=False, verbose=0).history["loss"]
        out["fit_seconds"] = time.perf_counter() - t0
        out["weights"] = ref.get_weights()
        out["optimizer_elements"] = sum(int(np.prod(v.shape)) for v in ref.optimizer.variables)
        out["predict"] = ref.predict(x, batch_size=W.BATCH, verbose=0)
        out["generate"] = np.asarray(
            ref.generate(_prompt(x), max_length=W.SEQ, stop_token_ids=None)["token_ids"]
        )
        out["file"] = prefix + ".weights.h5"
        ref.save_weights(out["file"])
        return out

    return _cached(directory, f"{name}-{optimizer}-{steps}", compute)


def other_model_file(name, directory):
    """A freshly built `name` (seed 3) as a `.keras` file: ``(weights, path)``."""

    def compute(prefix):
        other = W.MODELS[name](seed=3)
        other.save(prefix + ".keras")
        return other.get_weights(), prefix + ".keras"

    return _cached(directory, f"{name}-other", compute)


def _prompt(x):
    return {"token_ids": x["token_ids"][:2], "padding_mask": x["padding_mask"][:2]}


def _train_and_compare(strategy, name, tmp, steps, deferred, optimizer, keras_files, ref):
    x, y = W.data(name, steps)
    model, sharded, unallocated = build_sharded(strategy, name, deferred, optimizer)
    out = {"in_place": sharded is model, "unallocated_before_sharding": unallocated}
    out["initial"] = rel(ref["initial"], P.full_weights(model))
    out["num_fully_sharded"] = len(P.fully_sharded.fully_sharded_layers(model))
    out["stored_fraction"] = stored_fraction(model)
    out["ref_fit_seconds"] = ref["fit_seconds"]
    t0 = time.perf_counter()
    hist = model.fit(x, y, batch_size=W.BATCH, epochs=1, shuffle=False, verbose=0)
    out["fit_seconds"] = time.perf_counter() - t0
    out["loss"] = rel([ref["loss"]], [hist.history["loss"]])
    out["weights"] = rel(ref["weights"], P.full_weights(model))
    out["slot_fraction"] = sum(int(np.prod(v.shape)) for v in model.optimizer.variables) / max(
        1, ref["optimizer_elements"]
    )
    out["predict"] = rel([ref["predict"]], [model.predict(x, batch_size=W.BATCH, verbose=0)])
    with P.gathered(model):
        generated = model.generate(_prompt(x), max_length=W.SEQ, stop_token_ids=None)
    out["generate_equal"] = bool(np.array_equal(np.asarray(generated["token_ids"]), ref["generate"]))
    # Checkpoints: the sharded model's file loads into the plain model and back.
    chief = keras_comm.topology.is_chief(strategy)
    task = keras_comm.topology.task_id(strategy)
    path = os.path.join(tmp, f"fs_{name}.weights.h5")
    mine = path if chief else os.path.join(tmp, f"fs_{name}.{task}.weights.h5")
    model.save_weights(mine)
    plain = W.MODELS[name](seed=2)
    plain.load_weights(mine)
    out["saved_to_plain"] = rel(P.full_weights(model), plain.get_weights())
    model.load_weights(ref["file"])
    out["plain_to_sharded"] = rel(ref["weights"], P.full_weights(model))
    if keras_files:
        # Whole-model `.keras` files: the sharded model's loads as the plain
        # model (`keras.saving.load_model`), and a plain model's file loads
        # into the sharded one.
        model.save(mine.replace(".weights.h5", ".keras"))
        loaded = keras.saving.load_model(mine.replace(".weights.h5", ".keras"))
        out["keras_to_plain"] = rel(P.full_weights(model), loaded.get_weights())
        other_weights, keras_path = other_model_file(name, os.path.dirname(ref["file"]))
        model.load_weights(keras_path)
        out["keras_to_sharded"] = rel(other_weights, P.full_weights(model))
    return out


def check(out, rtol, num_replicas):
    """The failed checks of one scenario's result (empty: all hold)."""
    bad = {}
    for key in ("initial", "loss", "weights", "predict", "saved_to_plain", "plain_to_sharded",
                "keras_to_plain", "keras_to_sharded"):
        if key in out and not out[key] <= rtol:
            bad[key] = out[key]
    if not out["in_place"]:
        bad["in_place"] = False
    if out["unallocated_before_sharding"] is False:
        bad["unallocated_before_sharding"] = False
    if not out["generate_equal"]:
        bad["generate_equal"] = False
    if out["num_fully_sharded"] < 8:
        bad["num_fully_sharded"] = out["num_fully_sharded"]
    # 1/n of every weight plus < n elements of padding each.
    if not out["stored_fraction"] < 1.0 / num_replicas + 0.05:
        bad["stored_fraction"] = out["stored_fraction"]
    if out["optimizer"] == "adam" and not out["slot_fraction"] < 1.0 / num_replicas + 0.05:
        bad["slot_fraction"] = out["slot_fraction"]
    return bad


if __name__ == "__main__":
    import sys

    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    from _cluster import finish
    from _cluster import write_result

    from _strategy import strategy

    # ``fully_shard_kerashub_worker.py TMP [REFERENCE_DIR]``: the models
    # trained alone are read from REFERENCE_DIR (default TMP), computed there
    # by the first worker that needs one if the test did not.
    tmp = sys.argv[1]
    refs = sys.argv[2] if len(sys.argv) > 2 else tmp
    results = {
        name: train_and_compare(strategy, name, tmp=tmp, keras_files=True, reference_dir=refs)
        for name in MODELS
    }
    results["gpt2-deferred"] = train_and_compare(
        strategy, "gpt2", tmp=tmp, deferred=True, reference_dir=refs
    )
    write_result(results)
    finish()
