"""Sparse (embedding) gradients with repeated tokens get the optimizer's own maths.

An embedding's gradient is a `tf.IndexedSlices` with a row per looked-up
token. Upstream Keras 3 applies it row by row, so Adam's second moment of a
token seen twice is ``g1**2 + g2**2``; keras_comm sums the duplicates first
(`keras_comm.training.reduction.sum_duplicate_rows`). Checked against Adam on
the dense gradient, computed in float64 numpy from the closed-form backward of
embedding -> flatten -> dense -> mean squared error.
"""

import keras
import numpy as np

import keras_comm  # noqa: F401  (installs the fix)

IDS = np.array([[1, 1, 2, 1], [3, 2, 2, 0]], "int32")  # tokens 1 and 2 repeat
Y = np.array([[0.5], [-1.0]], "float32")
LR, B1, B2, EPS = 0.1, 0.9, 0.999, 1e-7


def _model():
    keras.utils.set_random_seed(3)
    return keras.Sequential(
        [
            keras.Input((4,), dtype="int32"),
            keras.layers.Embedding(6, 3, name="emb"),
            keras.layers.Flatten(),
            keras.layers.Dense(1, name="out"),
        ]
    )


def _adam(w, g):
    m, v = (1 - B1) * g, (1 - B2) * g * g
    alpha = LR * np.sqrt(1 - B2) / (1 - B1)
    return w - alpha * m / (np.sqrt(v) + EPS)


def _expected_embedding(emb, kernel, bias, row_by_row=False):
    x = emb[IDS].reshape(2, 12)
    r = x @ kernel + bias - Y  # d(mean squared error)/d(prediction) = 2 r / 2
    dx = (r @ kernel.T).reshape(2, 4, 3)
    if not row_by_row:
        grad = np.zeros_like(emb)
        np.add.at(grad, IDS, dx)
        return _adam(emb, grad)
    # Upstream's row-by-row application: moments from the unsummed rows.
    m = np.zeros_like(emb)
    v = np.zeros_like(emb)
    np.add.at(m, IDS, (1 - B1) * dx)
    np.add.at(v, IDS, (1 - B2) * dx * dx)
    alpha = LR * np.sqrt(1 - B2) / (1 - B1)
    return emb - alpha * m / (np.sqrt(v) + EPS)


def test_adam_on_an_embedding_with_repeated_tokens_is_adam_on_the_dense_gradient():
    model = _model()
    emb, kernel, bias = (w.astype("float64") for w in model.get_weights())
    model.compile(optimizer=keras.optimizers.Adam(LR), loss="mse", jit_compile=False)
    model.fit(IDS, Y, batch_size=2, epochs=1, shuffle=False, verbose=0)
    got = model.get_weights()[0]
    expected = _expected_embedding(emb, kernel, bias)
    np.testing.assert_allclose(got, expected, rtol=1e-5, atol=1e-6)
    # The check can fail: upstream's row-by-row moments move the repeated
    # tokens' rows (1 and 2) elsewhere, far beyond the tolerance.
    upstream = _expected_embedding(emb, kernel, bias, row_by_row=True)
    moved = np.abs(upstream - expected).max(axis=1)
    assert moved[1] > 1e-3 and moved[2] > 1e-3, moved
    assert np.abs(upstream - expected)[[0, 3]].max() < 1e-9  # tokens seen once agree
