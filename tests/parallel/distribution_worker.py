"""keras.distribution scenarios, shared by in-process tests and real workers.

Each scenario builds a model under a strategy and a `keras.distribution`
distribution, trains it on global batches, and compares it with the same
model built without either and trained in this process alone on the same
batches. tests/test_distribution.py calls them with logical-device
strategies; run as a script (tests/test_distribution_multiprocess.py) every
worker is one replica of a real MultiWorkerMirroredStrategy.
"""

import contextlib
import os
import tempfile
import time

import keras
import numpy as np
import tensorflow as tf

import keras_comm
from fully_shard_worker import rel

BATCH = 8
SEQ = 8
VOCAB = 64


# --- Models ---------------------------------------------------------------------


def mlp(seed=1):
    keras.utils.set_random_seed(seed)
    return keras.Sequential(
        [
            keras.Input((6,)),
            keras.layers.Dense(8, activation="tanh", name="d1"),
            keras.layers.LayerNormalization(name="ln"),
            keras.layers.Dense(4, name="d2"),
        ],
        name="mlp",
    )


def mlp_layout_map(mesh):
    layout_map = keras.distribution.LayoutMap(mesh)
    layout_map["mlp/d1/kernel"] = (None, "model")
    layout_map["mlp/d1/bias"] = ("model",)
    layout_map["mlp/d2/kernel"] = ("model", "batch")
    layout_map["mlp/d1/output"] = ("batch", None)  # an output layout: accepted, no effect
    return layout_map


def llama(seed=1):
    import keras_hub

    keras.utils.set_random_seed(seed)
    backbone = keras_hub.models.LlamaBackbone(
        vocabulary_size=VOCAB, num_layers=2, num_query_heads=4, num_key_value_heads=4,
        hidden_dim=16, intermediate_dim=32, dropout=0.0,
    )
    return keras_hub.models.LlamaCausalLM(backbone=backbone, preprocessor=None)


def gemma(seed=1):
    import keras_hub

    keras.utils.set_random_seed(seed)
    backbone = keras_hub.models.GemmaBackbone(
        vocabulary_size=VOCAB, num_layers=2, num_query_heads=4, num_key_value_heads=4,
        hidden_dim=16, intermediate_dim=64, head_dim=4, dropout=0,
    )
    return keras_hub.models.GemmaCausalLM(backbone=backbone, preprocessor=None)


def gpt2(seed=1):
    import keras_hub

    keras.utils.set_random_seed(seed)
    backbone = keras_hub.models.GPT2Backbone(
        vocabulary_size=VOCAB, num_layers=2, num_heads=2, hidden_dim=16,
        intermediate_dim=32, max_sequence_length=SEQ, dropout=0.0,
    )
    return keras_hub.models.GPT2CausalLM(backbone=backbone, preprocessor=None)


# Bounds against one process. Initial values, losses, predictions and file
# round trips agree to float32 round-off (predictions of the trained Llama
# measured up to 7.8e-6). Weights trained by Adam in
# float32 carry the round-off of every step's gradient, and Adam divides
# each element by its own gradient scale, so an element whose gradient is
# a sum with cancellation moves by lr x its relative rounding error. How
# large that is depends on the CPU: oneDNN picks its matmul kernels by CPU
# and shape, and a split matmul has other shapes than the whole one.
# Measured on Llama (1, 2) and (2, 2): 5.3e-6 on AMD Zen 4, 2.5e-5 on Intel
# Sapphire Rapids (AMX). Exactness itself is held in float64 (FLOAT64_RTOL,
# test_kerashub_float64_resume_on_four_workers: 1.3e-14).
RTOL = 1e-5
TRAINED32_RTOL = 1e-4


def bound(key):
    """The relative bound for a comparison key of `train_and_compare`."""
    return TRAINED32_RTOL if key == "weights" else RTOL


MODELS = {"mlp": mlp, "llama": llama, "gemma": gemma, "gpt2": gpt2}

# The split weights a training step gathers whole under the model's own
# layout map: every kernel and Llama's (untied) table compute split;
# Gemma's table is tied to its output projection, which reads it whole.
EXPECTED_WHOLE = {"llama": [], "gemma": ["token_embedding/embeddings"]}


def layout_map_of(name, mesh):
    import keras_hub

    if name == "mlp":
        return mlp_layout_map(mesh)
    if name == "llama":
        return keras_hub.models.LlamaBackbone.get_layout_map(mesh)
    if name == "gemma":
        return keras_hub.models.GemmaBackbone.get_layout_map(mesh)
    raise ValueError(f"no layout map for {name!r}")


def data(name, steps=2):
    """Global batches (numpy), the same on every worker."""
    rng = np.random.RandomState(7)
    n = BATCH * steps
    if name == "mlp":
        return rng.randn(n, 6).astype("float32"), rng.randn(n, 4).astype("float32")
    tokens = rng.randint(1, VOCAB, size=(n, SEQ + 1)).astype("int32")
    x = {"token_ids": tokens[:, :-1], "padding_mask": np.ones((n, SEQ), "bool")}
    return x, tokens[:, 1:]


def compile_model(model, name):
    loss = "mse" if name == "mlp" else keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    model.compile(optimizer=keras.optimizers.Adam(0.01), loss=loss, jit_compile=False)


def distribution_for(name, mesh_shape, mode, strategy):
    devices = keras_comm.distribution.list_devices(strategy)
    if mode == "data":
        mesh = keras.distribution.DeviceMesh((len(devices),), ("batch",), devices=devices)
        return keras.distribution.DataParallel(device_mesh=mesh)
    mesh = keras.distribution.DeviceMesh(mesh_shape, ("batch", "model"), devices=devices)
    return keras.distribution.ModelParallel(
        layout_map=layout_map_of(name, mesh), batch_dim_name="batch"
    )


def split_weights(model):
    return [v for v in model.weights if keras_comm.distribution.is_sharded(v)]


# --- What a traced step gathers ----------------------------------------------------


@contextlib.contextmanager
def recording_weight_gathers():
    """Records every weight all-gather traced inside: ``[(op name, elements out)]``.

    A split weight's gathers are named after its path (``<path>_gather``);
    the elements are the gathered output's (input elements x group size).
    """
    from keras_comm._private import tf_api

    records = []
    original = tf_api.all_gather_v2

    def recording(**kwargs):
        name = kwargs.get("name") or ""
        if name.endswith("_gather_all_gather"):
            records.append((name, kwargs["t"].shape.num_elements() * kwargs["group_size"]))
        return original(**kwargs)

    tf_api.all_gather_v2 = recording
    try:
        yield records
    finally:
        tf_api.all_gather_v2 = original


def _op_base(path):
    return "".join(c if c.isalnum() or c in "_.-" else "_" for c in path)


def gathered_whole(model, records):
    """The paths of split weights some recorded gather rebuilt whole."""
    out = set()
    for v in split_weights(model):
        full = int(np.prod(v.shape))
        name = _op_base(v.path) + "_gather_all_gather"
        if any(n == name and e == full for n, e in records):
            out.add(v.path)
    return sorted(out)


def gathered_bytes(model, records):
    """Bytes of split weights all-gathered by one traced step's forward."""
    size = {_op_base(v.path) + "_gather_all_gather": v.dtype for v in split_weights(model)}
    return sum(e * np.dtype(size[n]).itemsize for n, e in records if n in size)


# --- The scenario -----------------------------------------------------------------


def trained_alone(name, directory):
    """`name` trained alone (no strategy) on `data(name)`, as data: its initial
    and final weights, loss history, predictions, generated tokens (KerasHub
    models) and the file of its final weights (``"file"``, in `directory`).
    fully_shard_kerashub_worker.reference computes the same for the KerasHub
    models, kept once per pytest run."""
    x, y = data(name)
    ref = MODELS[name]()
    out = {"initial": ref.get_weights()}
    compile_model(ref, name)
    t0 = time.perf_counter()
    out["loss"] = ref.fit(x, y, batch_size=BATCH, epochs=1, shuffle=False, verbose=0).history["loss"]
    out["fit_seconds"] = time.perf_counter() - t0
    out["weights"] = ref.get_weights()
    out["predict"] = ref.predict(x, batch_size=BATCH, verbose=0)
    if name != "mlp":
        out["generate"] = np.asarray(
            ref.generate(_prompt(x), max_length=SEQ, stop_token_ids=None)["token_ids"]
        )
    out["file"] = os.path.join(directory, f"{name}.plain.weights.h5")
    ref.save_weights(out["file"])
    return out


def _prompt(x):
    return {"token_ids": x["token_ids"][:2], "padding_mask": x["padding_mask"][:2]}


def train_and_compare(strategy, name, mesh_shape=(2, 2), mode="model", tmp=None, reference_dir=None,
                      uninterrupted=None):
    """Trains `name` under the distribution and compares it with the model
    trained alone: computed here (`trained_alone`), or with `reference_dir`
    (KerasHub models) read from the run's cache there
    (fully_shard_kerashub_worker.reference: the same computation, once per
    run instead of in every worker).

    `uninterrupted`: a dict; when given, the model then trains on (the last
    of) the RESUME_STEPS batches, which makes it the run uninterrupted of
    `stop_with_backups` (the same model, distribution and steps, without
    building and tracing another), and its full weights are stored there
    under ``"<name>-<mode>"``.
    """
    x, y = data(name)
    tmp = tmp or tempfile.mkdtemp()
    if reference_dir is None:
        ref = trained_alone(name, tempfile.mkdtemp(dir=tmp))
    else:
        import fully_shard_kerashub_worker as hub

        ref = hub.reference(name, "adam", 2, reference_dir)
    dist = distribution_for(name, mesh_shape, mode, strategy)
    with strategy.scope(), dist.scope():
        model = MODELS[name]()
        compile_model(model, name)
    out = {"initial": rel(ref["initial"], model.get_weights())}
    split = split_weights(model)
    out["split"] = len(split)
    out["stored_fraction"] = sum(int(np.prod(v.value.shape)) for v in model.weights) / sum(
        int(np.prod(v.shape)) for v in model.weights
    )
    out["blocks_stored"] = all(tuple(v.value.shape) == v.blocks.block_shape for v in split)
    t0 = time.perf_counter()
    with recording_weight_gathers() as records:
        hist = model.fit(x, y, batch_size=BATCH, epochs=1, shuffle=False, verbose=0)
    out["fit_seconds"] = time.perf_counter() - t0
    out["gathered_whole"] = gathered_whole(model, records)
    out["gathered_bytes"] = gathered_bytes(model, records)
    out["ref_fit_seconds"] = ref["fit_seconds"]
    out["loss"] = rel([ref["loss"]], [hist.history["loss"]])
    out["weights"] = rel(ref["weights"], model.get_weights())
    slots = [v for v in model.optimizer.variables if keras_comm.distribution.is_sharded(v)]
    out["slots_split"] = len(slots)
    out["predict"] = rel([ref["predict"]], [model.predict(x, batch_size=BATCH, verbose=0)])
    if name != "mlp":
        with keras_comm.distribution.gathered(model):
            generated = model.generate(_prompt(x), max_length=SEQ, stop_token_ids=None)
        out["generate_equal"] = bool(np.array_equal(np.asarray(generated["token_ids"]), ref["generate"]))
    # Checkpoints: the distributed model's file loads into the plain model and back.
    chief = keras_comm.topology.is_chief(strategy)
    path = os.path.join(tmp, f"{name}.weights.h5")
    mine = path if chief else os.path.join(tmp, f"{name}.{keras_comm.topology.task_id(strategy)}.weights.h5")
    model.save_weights(mine)
    plain = MODELS[name](seed=2)
    plain.load_weights(mine)
    out["saved_to_plain"] = rel(model.get_weights(), plain.get_weights())
    if uninterrupted is not None:
        # Predict, generate and the files changed nothing the steps use; the
        # optimizer's step count goes on, so this fit's step is step 3 of
        # one fit over every batch.
        xs, ys = data(name, RESUME_STEPS)
        done = len(y)
        same = tf.nest.map_structure(lambda a, b: bool(np.array_equal(a, b[:done])), (x, y), (xs, ys))
        assert all(tf.nest.flatten(same)), "data(name) is not the start of data(name, RESUME_STEPS)"
        rest = tf.nest.map_structure(lambda a: a[done:], (xs, ys))
        model.fit(*rest, batch_size=BATCH, epochs=1, shuffle=False, verbose=0)
        uninterrupted[f"{name}-{mode}"] = full_weights(model)
    model.load_weights(ref["file"])
    out["plain_to_split"] = rel(ref["weights"], model.get_weights())
    return out


# --- Resume and float64 -------------------------------------------------------------

# A resume's data: 3 steps of one epoch, a backup after step 2 (Adam's
# moments carry two steps' state), the first run stopped as step 3 begins;
# the resumed run trains step 3 from the backup.
RESUME_STEPS = 3
SAVE_FREQ = 2
INTERRUPT_AT = 2


@contextlib.contextmanager
def float64():
    """floatx and the global dtype policy set to float64, both restored on exit.

    Both: once any layer exists, Keras takes a new layer's dtype from the
    global policy, and losses compute in floatx.
    """
    floatx, policy = keras.config.floatx(), keras.config.dtype_policy()
    keras.config.set_floatx("float64")
    keras.config.set_dtype_policy("float64")
    try:
        yield
    finally:
        keras.config.set_floatx(floatx)
        keras.config.set_dtype_policy(policy)


def build(strategy, name, mode, mesh_shape=None, seed=1):
    """`name` compiled under the strategy: `mode` "model" (its own layout map
    on a `mesh_shape` mesh), "data" (`DataParallel`) or "fully_shard"."""
    if mode == "fully_shard":
        from keras_comm import parallel

        with strategy.scope():
            model = MODELS[name](seed)
            parallel.fully_shard(model)
            compile_model(model, name)
        return model
    dist = distribution_for(name, mesh_shape, mode, strategy)
    with strategy.scope(), dist.scope():
        model = MODELS[name](seed)
        compile_model(model, name)
    return model


def full_weights(model):
    """Full values in the unsplit model's order (split and sharded weights gathered)."""
    from keras_comm import parallel

    return parallel.full_weights(model)


class Interrupt(keras.callbacks.Callback):
    """Stops `fit` as global step `at + 1` begins (every worker: same batch)."""

    def __init__(self, at=INTERRUPT_AT):
        super().__init__()
        self.at = at

    def on_train_batch_begin(self, batch, logs=None):
        if batch == self.at:
            raise RuntimeError("interrupted")


def _fit(model, name, callbacks=()):
    x, y = data(name, RESUME_STEPS)
    model.fit(x, y, batch_size=BATCH, epochs=1, shuffle=False, verbose=0, callbacks=list(callbacks))


def interrupted_fit(strategy, name, mode, mesh_shape, backup_dir):
    """`fit` with `BackupAndRestore(save_freq=SAVE_FREQ)`, stopped at step INTERRUPT_AT + 1."""
    model = build(strategy, name, mode, mesh_shape)
    try:
        _fit(model, name, [Interrupt(), keras_comm.callbacks.BackupAndRestore(backup_dir, save_freq=SAVE_FREQ)])
    except RuntimeError as e:
        if "interrupted" not in str(e):
            raise
    else:
        raise RuntimeError("fit was not interrupted")


def resumed_fit(strategy, name, mode, mesh_shape, backup_dir):
    """A model with other initial values, resumed from the backup."""
    model = build(strategy, name, mode, mesh_shape, seed=2)
    _fit(model, name, [keras_comm.callbacks.BackupAndRestore(backup_dir, save_freq=SAVE_FREQ)])
    return model


def straight_fit(strategy, name, mode, mesh_shape):
    """The uninterrupted run's full weights."""
    model = build(strategy, name, mode, mesh_shape)
    _fit(model, name)
    return full_weights(model)


def one_process_fit(name):
    """The unsplit model trained in this process alone (no strategy)."""
    ref = MODELS[name]()
    compile_model(ref, name)
    _fit(ref, name)
    return ref


# Two launches of 2 workers: the first trains straight and stops a run
# after a backup; the second (fresh processes) resumes it.
RESUME_CASES = {
    "llama-model": ("llama", "model"),
    "gemma-model": ("gemma", "model"),
    "gpt2-fully_shard": ("gpt2", "fully_shard"),
}


def stop_with_backups(strategy, state_dir, uninterrupted=None):
    """The first launch: each case's uninterrupted weights, and a backup left.

    `uninterrupted`: the cases' weights train_and_compare already trained
    uninterrupted (the layout-map cases), not trained again.
    """
    workers = keras_comm.topology.worker_count(strategy)
    out = {}
    for case, (name, mode) in RESUME_CASES.items():
        mesh_shape = (1, workers)
        if uninterrupted and case in uninterrupted:
            out[case] = uninterrupted[case]
        else:
            out[case] = straight_fit(strategy, name, mode, mesh_shape)
        interrupted_fit(strategy, name, mode, mesh_shape, os.path.join(state_dir, f"backup-{case}"))
    return out


def resume_from_backups(strategy, state_dir):
    """The second launch: each case resumed from the first launch's backup."""
    workers = keras_comm.topology.worker_count(strategy)
    return {
        case: full_weights(
            resumed_fit(strategy, name, mode, (1, workers), os.path.join(state_dir, f"backup-{case}"))
        )
        for case, (name, mode) in RESUME_CASES.items()
    }


# On 4 workers, in float64: each model and mode is stopped after a backup,
# resumed by a model built anew, and compared with the unsplit model
# trained uninterrupted in one process (the chief's, in the results); the
# chief saves the resumed model's `.weights.h5` for the test to load into
# the unsplit model. Gemma's layout map and the files in both directions
# run on 2 workers (the launch above): every case here costs the shared
# 4-worker launch about a minute.
FOUR_WORKER_CASES = {
    "llama-model-2x2": ("llama", "model", (2, 2)),
    "gpt2-fully_shard": ("gpt2", "fully_shard", None),
}
# Relative bound against one process in float64. Gemma computes its
# RMSNormalization and attention softmax in float32 whatever the dtype
# (KerasHub's choice), so it agrees to float32 round-off only.
FLOAT64_RTOL = {"llama": 1e-9, "gpt2": 1e-9, "gemma": 1e-5}


def four_workers(strategy, state_dir):
    """The 4-worker group of the shared launch (tests/parallel/pipeline_worker.py).

    Returns, per case: this worker's resumed full weights and the unsplit
    model's trained in the chief's process alone (chief only). The chief's
    resumed model is saved to ``STATE_DIR/<case>.weights.h5``.
    """
    chief = keras_comm.topology.is_chief(strategy)
    out = {}
    for case, (name, mode, mesh_shape) in FOUR_WORKER_CASES.items():
        t0 = time.perf_counter()
        result = {}
        with float64():
            if chief:
                result["one_process"] = one_process_fit(name).get_weights()
            backup = os.path.join(state_dir, f"backup64-{case}")
            interrupted_fit(strategy, name, mode, mesh_shape, backup)
            model = resumed_fit(strategy, name, mode, mesh_shape, backup)
            result["weights"] = full_weights(model)
            result["dtypes"] = sorted({str(np.asarray(w).dtype) for w in result["weights"]})
            result["split"] = len(split_weights(model))
            model.save_weights(os.path.join(state_dir if chief else tempfile.mkdtemp(), f"{case}.weights.h5"))
        result["seconds"] = round(time.perf_counter() - t0, 1)
        out[case] = result
    return out


if __name__ == "__main__":
    import sys

    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    from _cluster import finish
    from _cluster import write_result

    from _strategy import strategy

    from _cluster import run_groups

    workers = keras_comm.topology.worker_count(strategy)
    tmp = sys.argv[1]
    if sys.argv[2:] == ["resume"]:
        write_result(run_groups([("resumed", lambda: resume_from_backups(strategy, tmp))]))
        finish()
    # ``distribution_worker.py TMP REFERENCE_DIR``: the models trained alone
    # are read from REFERENCE_DIR (fully_shard_kerashub_worker.reference; the
    # test computes them before the launch). ``TMP resume``: the second launch.
    refs = sys.argv[2]
    # Llama's and Gemma's layout-map models go on to be the resume check's
    # uninterrupted runs (train_and_compare's `uninterrupted`).
    uninterrupted = {}
    groups = [
        (f"{name}-{mode}", lambda name=name, mesh_shape=mesh_shape, mode=mode: train_and_compare(
            strategy, name, mesh_shape, mode, tmp=tmp, reference_dir=refs,
            uninterrupted=uninterrupted if f"{name}-{mode}" in RESUME_CASES else None))
        for name, mesh_shape, mode in [
            ("llama", (1, workers), "model"),
            ("gemma", (1, workers), "model"),
            ("gpt2", None, "data"),
        ]
    ]
    groups.append(("uninterrupted", lambda: stop_with_backups(strategy, tmp, uninterrupted)))
    write_result(run_groups(groups))
    finish()
