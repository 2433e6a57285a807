"""`fully_shard` on KerasHub models, shared by in-process tests and real workers.

Each scenario builds a KerasHub causal LM (tiny config, random weights,
nothing downloaded; tests/parallel/distribution_worker.py's models) under a
strategy, shards it in place with `keras_comm.parallel.fully_shard`, trains
it on global batches and compares it with the same model trained in this
process alone on the same batches; then `generate()` (inside
`keras_comm.parallel.gathered`) and `.weights.h5` files from the sharded
model to the plain one and back (and, with `keras_files`, whole-model
`.keras` files both ways). tests/parallel/test_fully_shard_kerashub.py
calls it with logical-device strategies; run as a script
(tests/parallel/test_fully_shard_multiprocess.py) every worker is one
replica of a real MultiWorkerMirroredStrategy.
"""

import os
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
                      keras_files=False):
    """Trains `name` fully sharded and alone; returns the comparisons.

    `deferred`: the sharded model is built inside `deferred_weights()`
    (never whole) instead of built whole and then sharded. `optimizer`:
    "adam" or "sgd" (default: `OPTIMIZERS[name]`).
    """
    optimizer = optimizer or OPTIMIZERS[name]
    out = _train_and_compare(strategy, name, tmp, steps, deferred, optimizer, keras_files)
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


def _train_and_compare(strategy, name, tmp, steps, deferred, optimizer, keras_files):
    x, y = W.data(name, steps)
    ref = W.MODELS[name]()
    ref_initial = ref.get_weights()
    compile_model(ref, name, optimizer)
    model, sharded, unallocated = build_sharded(strategy, name, deferred, optimizer)
    out = {"in_place": sharded is model, "unallocated_before_sharding": unallocated}
    out["initial"] = rel(ref_initial, P.full_weights(model))
    out["num_fully_sharded"] = len(P.fully_sharded.fully_sharded_layers(model))
    out["stored_fraction"] = stored_fraction(model)
    t0 = time.perf_counter()
    ref_hist = ref.fit(x, y, batch_size=W.BATCH, epochs=1, shuffle=False, verbose=0)
    out["ref_fit_seconds"] = time.perf_counter() - t0
    t0 = time.perf_counter()
    hist = model.fit(x, y, batch_size=W.BATCH, epochs=1, shuffle=False, verbose=0)
    out["fit_seconds"] = time.perf_counter() - t0
    out["loss"] = rel([ref_hist.history["loss"]], [hist.history["loss"]])
    out["weights"] = rel(ref.get_weights(), P.full_weights(model))
    out["slot_fraction"] = sum(int(np.prod(v.shape)) for v in model.optimizer.variables) / max(
        1, sum(int(np.prod(v.shape)) for v in ref.optimizer.variables)
    )
    out["predict"] = rel(
        [ref.predict(x, batch_size=W.BATCH, verbose=0)],
        [model.predict(x, batch_size=W.BATCH, verbose=0)],
    )
    prompt = {"token_ids": x["token_ids"][:2], "padding_mask": x["padding_mask"][:2]}
    with P.gathered(model):
        generated = model.generate(prompt, max_length=W.SEQ, stop_token_ids=None)
    expected = ref.generate(prompt, max_length=W.SEQ, stop_token_ids=None)
    out["generate_equal"] = bool(
        np.array_equal(np.asarray(generated["token_ids"]), np.asarray(expected["token_ids"]))
    )
    # Checkpoints: the sharded model's file loads into the plain model and back.
    tmp = tmp or tempfile.mkdtemp()
    chief = keras_comm.topology.is_chief(strategy)
    task = keras_comm.topology.task_id(strategy)
    path = os.path.join(tmp, f"fs_{name}.weights.h5")
    mine = path if chief else os.path.join(tmp, f"fs_{name}.{task}.weights.h5")
    model.save_weights(mine)
    plain = W.MODELS[name](seed=2)
    plain.load_weights(mine)
    out["saved_to_plain"] = rel(P.full_weights(model), plain.get_weights())
    plain_path = mine.replace(".weights.h5", ".plain.weights.h5")
    ref.save_weights(plain_path)
    model.load_weights(plain_path)
    out["plain_to_sharded"] = rel(ref.get_weights(), P.full_weights(model))
    if keras_files:
        # Whole-model `.keras` files: the sharded model's loads as the plain
        # model (`keras.saving.load_model`), and a plain model's file loads
        # into the sharded one.
        model.save(mine.replace(".weights.h5", ".keras"))
        loaded = keras.saving.load_model(mine.replace(".weights.h5", ".keras"))
        out["keras_to_plain"] = rel(P.full_weights(model), loaded.get_weights())
        other = W.MODELS[name](seed=3)
        keras_path = mine.replace(".weights.h5", ".plain.keras")
        other.save(keras_path)
        model.load_weights(keras_path)
        out["keras_to_sharded"] = rel(other.get_weights(), P.full_weights(model))
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

    tmp = sys.argv[1]
    results = {
        name: train_and_compare(strategy, name, tmp=tmp, keras_files=True) for name in MODELS
    }
    results["gpt2-deferred"] = train_and_compare(strategy, "gpt2", tmp=tmp, deferred=True)
    write_result(results)
    finish()
