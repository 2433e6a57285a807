"""Property-based tests: any constructor arguments and inputs give either a
correct result or a ValueError/TypeError with a message -- never another
exception, a crash or a hang.

Calls run outside any strategy (one replica), where every collective is its
one-rank case; layers whose one-rank forward is the identity are checked
against it.
"""

import inspect
import math

import numpy as np
import pytest
import tensorflow as tf
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import keras
from keras_comm import layers

LAYERS = [getattr(layers, name) for name in layers.__all__]

# One-rank forward is the identity (the op table in docs).
IDENTITY_ON_ONE_RANK = {
    "AllGather", "AllReduce", "Broadcast", "CollectiveGather", "CollectiveScatter",
    "HostAllGather", "HostReduceScatter", "MicroStepAllGather", "MiniStepAllGather",
    "MirrorMicroStepOperator", "MirrorMiniStepOperator", "MirrorOperator", "Reduce",
    "ReduceScatter", "VirtualAccuGrad", "VirtualAdd", "VirtualAssignAdd", "VirtualDiv",
    "AlltoAll",
}

VALUES = st.sampled_from([
    None, 0, 1, 2, 3, -1, 10**9, 0.5, math.nan, math.inf, True, False,
    "", "sum", "max", "prod", "min", "mean", "bogus", "NCHW", "NHWC", "exact",
    "identity", "zeros", "float32", "int32", "float16",
    [], [0], [1], [0, 1], [1, 1], [-1], [0, 0, 0, 0], [[1, 2]], [[2, 2], [2, 2]],
    (0,), {"a": 1}, b"x",
])

DTYPES = st.sampled_from(["float32", "float64", "float16", "int32", "bool"])


def _params(cls):
    sig = inspect.signature(cls.__init__)
    return [
        p for p in list(sig.parameters.values())[1:]
        if p.kind not in (p.VAR_KEYWORD, p.VAR_POSITIONAL)
        and p.name not in ("activity_regularizer", "trainable", "dtype", "autocast", "name")
    ]


def _expected_error(e):
    return isinstance(e, (ValueError, TypeError)) and str(e).strip()


@st.composite
def layer_and_kwargs(draw, cls):
    kwargs = {}
    for p in _params(cls):
        required = p.default is inspect.Parameter.empty
        if required or draw(st.booleans()):
            kwargs[p.name] = draw(VALUES)
    return kwargs


@pytest.mark.parametrize("cls", LAYERS, ids=lambda c: c.__name__)
@settings(max_examples=25, deadline=None, suppress_health_check=list(HealthCheck))
@given(data=st.data())
def test_constructor_and_call_never_crash(cls, data):
    kwargs = data.draw(layer_and_kwargs(cls), label="kwargs")
    try:
        layer = cls(**kwargs)
    except Exception as e:  # noqa: BLE001 (the property is about the type)
        assert _expected_error(e), f"{cls.__name__}(**{kwargs!r}) raised {e!r}"
        return
    # A constructed layer round-trips through its config.
    clone = cls.from_config(layer.get_config())
    assert clone.get_config() == layer.get_config()

    shape = data.draw(st.lists(st.integers(0, 3), min_size=0, max_size=3), label="shape")
    dtype = data.draw(DTYPES, label="dtype")
    x = tf.cast(tf.reshape(tf.range(int(np.prod(shape)) if shape else 1), shape), dtype)
    try:
        y = layer(x)
    except Exception as e:  # noqa: BLE001
        assert _expected_error(e), (
            f"{cls.__name__}(**{kwargs!r}) on {dtype}{shape} raised {type(e).__name__}: {e}"
        )
        return
    if cls.__name__ in IDENTITY_ON_ONE_RANK and tf.is_tensor(y):
        want = x
        assert tuple(y.shape) == tuple(want.shape)
        np.testing.assert_array_equal(
            np.asarray(tf.cast(y, "float64")), np.asarray(tf.cast(tf.cast(want, y.dtype), "float64"))
        )
    if cls.__name__ == "VirtualDiv" and x.dtype.is_floating:
        _check_divided_gradient(layer, x)


def _check_divided_gradient(layer, x):
    """VirtualDiv's whole point: the gradient through it is dy / divisor."""
    w = tf.reshape(1 + tf.math.floormod(tf.range(tf.size(x)), 3), tf.shape(x))
    with tf.GradientTape() as tape:
        tape.watch(x)
        y = layer(x)  # may be autocast to the layer's compute dtype
        loss = tf.reduce_sum(tf.cast(w, y.dtype) * y)
    grad = tape.gradient(loss, x)
    want = np.asarray(w, np.float64) / float(layer.divisor)
    tols = {"float16": 1e-3, "float32": 1e-6, "float64": 1e-12}
    tol = max(tols[x.dtype.name], tols[y.dtype.name])
    np.testing.assert_allclose(np.asarray(grad, np.float64), want, rtol=tol, atol=tol * 1e-4)


@settings(max_examples=30, deadline=None)
@given(
    timeout=st.one_of(st.floats(allow_nan=True, allow_infinity=True), st.integers(-5, 5),
                      st.text(max_size=3), st.none(), st.booleans()),
    group=st.one_of(st.none(), st.lists(st.integers(-2, 5), max_size=4), st.text(max_size=2),
                    st.integers()),
)
def test_group_and_timeout_validation(timeout, group):
    try:
        layer = layers.AllReduce(group=group, timeout=timeout)
    except Exception as e:  # noqa: BLE001
        assert _expected_error(e), f"group={group!r} timeout={timeout!r}: {e!r}"
        assert "Received" in str(e), str(e)
        return
    assert layer.timeout is None or (0 < layer.timeout < math.inf)
    assert layer.group is None or list(layer.group.ranks) == sorted(group)


def test_fuzz_saw_every_layer():
    assert len(LAYERS) >= 20
    assert all(issubclass(c, keras.layers.Layer) for c in LAYERS)
