"""Split compute for tensor-parallel layouts (keras_comm.distribution._split).

The roles of kernel dimensions (pure); then one float64 model holding every
layer kind the split handles -- an embedding split by vocabulary, Dense
column and row splits, EinsumDense with KerasHub's equations, dimensions
split over the batch axis too -- trained one step on 2 replicas ((1, 2)
mesh) and 4 ((2, 2) mesh), compared with the same model unsplit in one
process (forward, and the gradients through the SGD update), and the traced
step's weight all-gathers read to show no split kernel is gathered whole.
With split compute off, the same step gathers every kernel whole.
"""

import keras
import numpy as np
import pytest
import tensorflow as tf

import keras_comm
from conftest import make_strategy
from keras_comm.distribution import _blocks
from keras_comm.distribution import _split
import distribution_worker as W

VOCAB, SEQ, HIDDEN, HEADS, HEAD_DIM = 16, 3, 8, 4, 2
LR = 0.5


# --- Roles (pure) -----------------------------------------------------------------


@pytest.mark.parametrize(
    "equation, roles",
    [
        ("btd,dnh->btnh", [("row", 2), ("column", 2), ("column", 3)]),
        ("btd,ndh->btnh", [("column", 2), ("row", 2), ("column", 3)]),  # Gemma's query
        ("bqm,muh->bquh", [("row", 2), ("column", 2), ("column", 3)]),  # Llama's query
        ("btnh,nhd->btd", [("row", 2), ("row", 3), ("column", 2)]),  # attention output
        ("...d,de->...e", [("row", -1), ("column", -1)]),
        ("btd,tde->btde", [None, None, ("column", 3)]),  # t, d batched: no split
        ("bd,de->eb", [None, None]),  # axis 0 (the samples) moves: no split
    ],
)
def test_einsum_roles(equation, roles):
    assert _split.einsum_roles(equation, len(roles)) == roles


def _blocks_of(shape, axes):
    return _blocks.resolve("w", shape, axes, (2, 2), ("batch", "model"))


def test_which_dimension_splits_the_compute():
    roles = [("row", -1), ("column", -1)]
    # Column over "model", dimension 0 gathered over "batch" (KerasHub's FFN).
    assert _split.split_dimension(_blocks_of((4, 6), ("batch", "model")), roles, "batch") == (1, ("column", -1))
    assert _split.split_dimension(_blocks_of((4, 6), ("model", "batch")), roles, "batch") == (0, ("row", -1))
    # Only the batch axis: gathered on use (FSDP), nothing to split.
    assert _split.split_dimension(_blocks_of((4, 6), ("batch", None)), roles, "batch") is None
    # A dimension over both axes, or no batch axis at all and two split dims.
    assert _split.split_dimension(_blocks_of((4, 6), (("batch", "model"), None)), roles, "batch") is None
    assert _split.split_dimension(_blocks_of((4, 6), ("batch", "model")), roles, None) is None
    # A dimension without a role.
    assert _split.split_dimension(_blocks_of((4, 6), ("model", None)), [None, ("column", -1)], "batch") is None


# --- One step of every layer kind, float64 ------------------------------------------


def model(seed=3):
    keras.utils.set_random_seed(seed)
    ids = keras.Input((SEQ,), dtype="int32")
    x = keras.layers.Embedding(VOCAB, HIDDEN, name="emb")(ids)
    x = keras.layers.Dense(2 * HIDDEN, activation="tanh", name="col")(x)
    x = keras.layers.Dense(HIDDEN, name="row")(x)
    h = keras.layers.EinsumDense(
        "btd,dnh->btnh", (SEQ, HEADS, HEAD_DIM), bias_axes="nh", activation="tanh", name="heads"
    )(x)
    x = keras.layers.EinsumDense("btnh,nhd->btd", (SEQ, HIDDEN), name="heads_out")(h)
    q = keras.layers.EinsumDense("bqm,muh->bquh", (SEQ, HEADS, HEAD_DIM), name="llama_q")(x)
    x = keras.layers.EinsumDense("btnh,nhd->btd", (SEQ, HIDDEN), name="q_out")(q)
    return keras.Model(ids, x, name="split")


def layout_map(mesh):
    m = keras.distribution.LayoutMap(mesh)
    m["emb/embeddings"] = ("model", "batch")  # vocabulary; hidden gathered
    m["col/kernel"] = ("batch", "model")  # column; rows gathered
    m["col/bias"] = ("model",)  # a split bias: gathered on use
    m["row/kernel"] = ("model", "batch")  # row
    m["heads/kernel"] = ("batch", "model", None)  # heads: column
    m["heads_out/kernel"] = ("model", None, "batch")  # heads contracted: row
    m["llama_q/kernel"] = ("model", "batch", None)  # Llama's query: row
    m["q_out/kernel"] = (None, "model", None)  # head_dim contracted: row
    return m


KERNELS = ["emb/embeddings", "col/kernel", "row/kernel", "heads/kernel",
           "heads_out/kernel", "llama_q/kernel", "q_out/kernel"]


def _data(batch):
    rng = np.random.RandomState(5)
    ids = rng.randint(-2, VOCAB, size=(batch, SEQ)).astype("int32")  # negative ids count from the end
    return ids, rng.randn(batch, SEQ, HIDDEN)


def _reference(x, y):
    ref = model()
    w0 = ref.get_weights()
    with tf.GradientTape() as tape:
        loss = keras.losses.MeanSquaredError()(y, ref(x))
    grads = tape.gradient(loss, ref.trainable_weights)
    expected = [w - LR * np.asarray(tf.convert_to_tensor(g)) for w, g in zip(w0, grads)]
    return w0, np.asarray(ref(x)), expected


@pytest.mark.parametrize(
    "replicas, mesh_shape, enabled",
    [(2, (1, 2), True), (4, (2, 2), True), (2, (1, 2), False)],
)
def test_split_compute_equals_one_process_in_float64(replicas, mesh_shape, enabled):
    # The global dtype policy, not floatx, decides a new layer's dtype once
    # any layer has been made in this process (Keras fixes the policy from
    # floatx at its first read): set both, restore both.
    floatx, policy = keras.config.floatx(), keras.config.dtype_policy()
    keras.config.set_floatx("float64")
    keras.config.set_dtype_policy("float64")
    try:
        strategy = make_strategy(replicas)
        x, y = _data(2 * replicas)
        w0, forward, expected = _reference(x, y)
        devices = keras_comm.distribution.list_devices(strategy)
        mesh = keras.distribution.DeviceMesh(mesh_shape, ("batch", "model"), devices=devices)
        dist = keras.distribution.ModelParallel(layout_map=layout_map(mesh), batch_dim_name="batch")
        with strategy.scope(), dist.scope():
            split = model()
            split.compile(optimizer=keras.optimizers.SGD(LR), loss="mse", jit_compile=False)
        assert len(W.split_weights(split)) == 8
        assert W.rel(w0, split.get_weights()) == 0.0
        _split.enabled = enabled
        try:
            with W.recording_weight_gathers() as records:
                split.fit(x, y, batch_size=len(x), epochs=1, shuffle=False, verbose=0)
            after = split.get_weights()
            predicted = split.predict(x, batch_size=len(x), verbose=0)
        finally:
            _split.enabled = True
    finally:
        keras.config.set_floatx(floatx)
        keras.config.set_dtype_policy(policy)
    # Gradients: the SGD step's change equals the reference gradient's.
    delta = [a - w for a, w in zip(after, w0)]
    want = [e - w for e, w in zip(expected, w0)]
    assert W.rel(want, delta) <= 1e-9
    split.set_weights(w0)
    assert W.rel([forward], [split.predict(x, batch_size=len(x), verbose=0)]) <= 1e-12
    assert predicted.shape == forward.shape
    whole = set(W.gathered_whole(split, records))
    # Every in-process replica traces its own step: bytes per replica.
    print(f"replicas={replicas} split_compute={enabled}: split weights all-gathered per "
          f"replica per step {W.gathered_bytes(split, records) // replicas} bytes; "
          f"the split weights hold {8 * sum(int(np.prod(v.shape)) for v in W.split_weights(split))}")
    if enabled:
        assert whole == {"col/bias"}, whole  # no kernel, no table
    else:
        assert whole == set(KERNELS) | {"col/bias"}, whole
