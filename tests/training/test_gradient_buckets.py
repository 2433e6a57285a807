"""Tests for the optimizer's bucketed gradient all-reduce (issue 18).

`keras_comm.set_gradient_bucket_bytes(n)` makes `fit`'s gradient sum one
packed all-reduce per bucket, issued last layer first, instead of one pack.

- pure: `reduction.gradient_buckets` groups and orders the gradients;
- the option's argument checks;
- in-process (2 replicas on logical CPUs): the traced reduction issues one
  CollectiveReduceV2 per bucket, in the documented order and sizes, with the
  closed-form sums; `fit` with buckets gives the same weights as with one
  pack (bit for bit: with 2 replicas each element is one addition,
  whatever the packing) and matches the single-process run within the
  suite's float32 tolerance (tests/compat/test_compat.py's check).
"""

import contextlib

import numpy as np
import pytest
import tensorflow as tf

import keras_comm
from compat import flows
from conftest import make_strategy
from keras_comm.training import reduction
from test_compat import _assert_flow_matches


@contextlib.contextmanager
def bucket_bytes(nbytes):
    previous = keras_comm.get_gradient_bucket_bytes()
    keras_comm.set_gradient_bucket_bytes(nbytes)
    try:
        yield
    finally:
        keras_comm.set_gradient_bucket_bytes(previous)


# --- Pure ---------------------------------------------------------------------


@pytest.mark.parametrize(
    "sizes, nbytes, expected",
    [
        ([48, 16, 16, 4], 0, [[0, 1, 2, 3]]),  # 0: one pack, as upstream
        ([48, 16, 16, 4], 16, [[2, 3], [1], [0]]),  # closes once >= 16
        ([48, 16, 16, 4], 1, [[3], [2], [1], [0]]),
        ([48, 16, 16, 4], 10**9, [[0, 1, 2, 3]]),  # never full: one bucket
        ([4, 4, 100, 4], 8, [[2, 3], [0, 1]]),  # a large one fills its bucket
        ([], 16, []),
    ],
)
def test_gradient_buckets_groups_last_layer_first(sizes, nbytes, expected):
    assert reduction.gradient_buckets(sizes, nbytes) == expected


def test_default_is_8_mib_buckets():
    # The default measured faster than one pack (docs/performance.md).
    assert keras_comm.get_gradient_bucket_bytes() == 8 << 20


@pytest.mark.parametrize(
    "value, error, match",
    [
        (-1, ValueError, r"`nbytes` must be >= 0 \(0 for one pack\). Received: nbytes=-1"),
        (1.5, TypeError, r"`nbytes` must be an int number of bytes .* Received: nbytes=1.5"),
        (True, TypeError, r"Received: nbytes=True"),
        ("16MB", TypeError, r"Received: nbytes='16MB'"),
    ],
)
def test_set_gradient_bucket_bytes_rejects_bad_input(value, error, match):
    previous = keras_comm.get_gradient_bucket_bytes()
    with pytest.raises(error, match=match):
        keras_comm.set_gradient_bucket_bytes(value)
    assert keras_comm.get_gradient_bucket_bytes() == previous


# --- In-process: 2 replicas on logical CPUs -------------------------------------


SHAPES = [(3, 4), (4,), (4, 1), (1,)]  # float32: 48, 16, 16, 4 bytes


@pytest.mark.inprocess
@pytest.mark.parametrize(
    "nbytes, hooked, expected_elements",
    [
        (0, None, [21]),
        (16, None, [5, 4, 12]),
        (1, None, [1, 4, 4, 12]),
        # A variable with its own reduction is not bucketed (its hook, here
        # the identity of `mark_gradient_reduced`, passes it through).
        (16, 1, [5, 12]),
    ],
)
def test_each_bucket_is_one_all_reduce_issued_last_layer_first(nbytes, hooked, expected_elements):
    strategy = make_strategy(2)
    with strategy.scope():
        variables = [tf.Variable(tf.zeros(s)) for s in SHAPES]
    if hooked is not None:
        reduction.mark_gradient_reduced(variables[hooked])
    base = [tf.reshape(tf.range(1.0, np.prod(s) + 1), s) for s in SHAPES]

    def replica():
        r = tf.cast(tf.distribute.get_replica_context().replica_id_in_sync_group, tf.float32)
        pairs = [(b * (r + 1.0), v) for b, v in zip(base, variables)]
        return [g for g, _ in reduction.all_reduce_sum_gradients(None, pairs)]

    with bucket_bytes(nbytes):
        fn = tf.function(lambda: strategy.run(replica))
        graph = fn.get_concrete_function().graph
        out = fn()
    device = strategy.extended.worker_devices[0]
    # Program order is creation order: the ordering token chains them so.
    issued = [
        op.inputs[0].shape.num_elements()
        for op in graph.get_operations()
        if op.type == "CollectiveReduceV2" and op.device == tf.DeviceSpec.from_string(device).to_string()
    ]
    assert issued == expected_elements
    for i, b in enumerate(base):
        for r, value in enumerate(strategy.experimental_local_results(out[i])):
            # Summed: 1x + 2x; hooked: replica r's own (r + 1)x.
            expected = (r + 1.0 if i == hooked else 3.0) * b.numpy()
            np.testing.assert_array_equal(value.numpy(), expected)


@pytest.fixture(scope="module")
def reference():
    return flows.tuple_dataset_flow(contextlib.nullcontext)


@pytest.mark.inprocess
def test_fit_with_buckets_equals_one_pack_and_single_process(reference, monkeypatch):
    strategy = make_strategy(2)
    with bucket_bytes(0):
        one_pack = flows.tuple_dataset_flow(strategy.scope)
    grouped = []
    real = reduction.gradient_buckets

    def recording(sizes, nbytes):
        grouped.append(real(sizes, nbytes))
        return grouped[-1]

    monkeypatch.setattr(reduction, "gradient_buckets", recording)
    with bucket_bytes(16):  # the tuple model's 4 variables: 3 buckets
        bucketed = flows.tuple_dataset_flow(strategy.scope)
    # fit's step took the bucketed path (once per replica per trace).
    assert grouped and all(g == [[2, 3], [1], [0]] for g in grouped), grouped
    assert bucketed["weights"] == one_pack["weights"]
    assert bucketed["history"] == one_pack["history"]
    _assert_flow_matches(reference, bucketed, "2 local replicas, 16-byte buckets")
