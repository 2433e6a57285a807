"""Tests for keras_comm.compat: Keras 3 fit/evaluate/predict under MWMS.

Three levels:

- the upstream guard: the Keras code compat replaces or relies on has not
  changed since compat was written (fast, no cluster);
- in-process: several replicas on logical CPUs (tests/conftest.py) train the
  tutorial flow and must match a single-process run on the same global batches;
- multi-process: the same flow across 2 and 3 worker processes, and stock
  Keras still failing the way keras-team/keras#20585 describes.

Exactness: weights within 1e-4 of the largest weight (float32, several
optimizer steps, different summation orders); metrics within 1e-5 relative;
evaluate/fit metrics bitwise identical on every worker.
"""

import json
import os
import subprocess
import sys

import keras
import numpy as np
import pytest

import keras_comm  # noqa: F401  (applies compat)
from _cluster import shared_cluster
import flows
from conftest import make_strategy
from keras_comm import compat
from keras_comm._private import keras_api

WEIGHT_RTOL = 1e-4
METRIC_RTOL = 1e-5

# The hashes of the Keras code compat replaces or relies on, per Keras
# version, are checked by tests/compat/test_private_api.py.


# --- Patch mechanics (fast) -------------------------------------------------


def test_installed_keras_is_supported_and_patched():
    low, high = compat.SUPPORTED_KERAS
    major_minor = tuple(int(p) for p in keras.version().split(".")[:2])
    assert low <= major_minor < high
    assert compat.is_applied()


def _current_methods():
    methods = {name: keras_api.current_trainer_method(name) for name in compat._METHODS}
    methods["_all_reduce_sum_gradients"] = keras_api.current_gradient_reduction()
    return methods


def test_apply_is_idempotent_and_revert_restores_upstream():
    patched = _current_methods()
    upstream = {
        f"TensorFlowTrainer.{name}": keras_api.trainer_method(name) for name in compat._METHODS
    }
    upstream["TFOptimizer._all_reduce_sum_gradients"] = keras_api.upstream_gradient_reduction()
    try:
        assert compat.apply() is True
        assert compat.apply() is True
        assert _current_methods() == patched

        compat.revert()
        compat.revert()
        assert not compat.is_applied()
        reverted = _current_methods()
        assert reverted["train_step"] is upstream["TensorFlowTrainer.train_step"]
        assert reverted["_make_function"] is upstream["TensorFlowTrainer._make_function"]
        assert reverted["_maybe_symbolic_build"] is upstream["TensorFlowTrainer._maybe_symbolic_build"]
        # Bound through the class: compare the functions.
        assert (
            reverted["_all_reduce_sum_gradients"]
            is upstream["TFOptimizer._all_reduce_sum_gradients"]
        )
    finally:
        compat.apply()
    assert _current_methods() == patched


def test_unsupported_keras_version_changes_nothing(monkeypatch):
    try:
        compat.revert()
        stock = _current_methods()
        monkeypatch.setattr(compat, "_keras_version", lambda: compat.SUPPORTED_KERAS[1])
        assert compat.apply() is False
        assert not compat.is_applied()
        assert _current_methods() == stock
    finally:
        monkeypatch.undo()
        compat.apply()
    assert compat.is_applied()


def test_import_prints_nothing_and_leaves_environment_alone():
    code = (
        "import json, os, sys\n"
        "before = dict(os.environ)\n"
        "import keras_comm\n"
        "from keras_comm import compat\n"
        "assert compat.is_applied()\n"
        "sys.stderr.write(json.dumps(dict(os.environ) == before))\n"
    )
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="3")
    proc = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout == ""
    assert proc.stderr.rstrip().endswith("true")


def test_import_warns_when_keras_is_unsupported():
    # Before issue 15 item 6, `apply()` returned False here and the import said
    # nothing: `fit` under MWMS then failed later in stock Keras code.
    code = (
        "import json, sys, warnings\n"
        "import keras\n"
        "keras.version = lambda: '3.99.0'\n"
        "with warnings.catch_warnings(record=True) as caught:\n"
        "    warnings.simplefilter('always')\n"
        "    import keras_comm\n"
        "from keras_comm import compat\n"
        "assert not compat.is_applied()\n"
        "mine = [str(w.message) for w in caught if 'keras_comm' in str(w.message)]\n"
        "sys.stderr.write('RESULT ' + json.dumps(mine))\n"
    )
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="3")
    proc = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    messages = json.loads(proc.stderr.rsplit("RESULT ", 1)[1])
    assert len(messages) == 1, messages
    low, high = compat.SUPPORTED_KERAS
    assert f">={low[0]}.{low[1]},<{high[0]}.{high[1]}" in messages[0]
    assert "found Keras 3.99.0 with the 'tensorflow' backend" in messages[0]


# --- Comparison helpers -----------------------------------------------------


def _max_relative_weight_diff(expected, actual):
    worst = 0.0
    for e, a in zip(expected, actual, strict=True):
        e, a = np.asarray(e), np.asarray(a)
        worst = max(worst, float(np.max(np.abs(e - a)) / np.max(np.abs(e))))
    return worst


def _assert_flow_matches(reference, got, label):
    assert _max_relative_weight_diff(reference["weights"], got["weights"]) <= WEIGHT_RTOL, label
    assert got["history"].keys() == reference["history"].keys(), label
    for key, values in reference["history"].items():
        np.testing.assert_allclose(
            got["history"][key], values, rtol=METRIC_RTOL, atol=1e-7, err_msg=f"{label} {key}"
        )
    assert got["evaluate"].keys() == reference["evaluate"].keys(), label
    for key, value in reference["evaluate"].items():
        np.testing.assert_allclose(
            got["evaluate"][key], value, rtol=METRIC_RTOL, atol=1e-7, err_msg=f"{label} {key}"
        )
    np.testing.assert_allclose(
        got["predict"], reference["predict"], rtol=1e-5, atol=1e-6, err_msg=f"{label} predict"
    )


@pytest.fixture(scope="module")
def reference():
    """Every scenario trained in this process without a strategy."""
    return flows.run_all(None)


# --- In-process: replicas on logical CPUs -----------------------------------


@pytest.mark.inprocess
def test_fit_evaluate_predict_exact_with_local_replicas(reference):
    # 25 samples in batches of 6: the last global batch has one sample, so
    # one replica gets an empty shard.
    strategy = make_strategy(2)
    got = flows.tuple_dataset_flow(strategy.scope)
    _assert_flow_matches(reference["tuple_dataset"], got, "2 local replicas")


# --- Multi-process ------------------------------------------------------------


@pytest.mark.multiprocess
# 3 workers only: the worker has no branch on the worker count, and 3 (uneven
# splits) covers what 2 would; 2 and 4 replicas run in-process (tests/conftest.py).
@pytest.mark.parametrize("num_workers", [3])
def test_tutorial_flow_across_workers_matches_single_process(reference, num_workers):
    # The suite's shared 3-worker launch (tests/acceptance/shared_launch_worker.py).
    result = shared_cluster("acceptance/shared_launch_worker.py", num_workers, timeout=900).check()
    results = [r["compat_flow"] for r in result.results]
    first = results[0]
    for rank, worker in enumerate(results):
        for name in reference:
            label = f"{name}, rank {rank} of {num_workers}"
            _assert_flow_matches(reference[name], worker[name], label)
            # Metrics come from all-reduced state: identical, not just close.
            assert worker[name]["history"] == first[name]["history"], label
            assert worker[name]["evaluate"] == first[name]["evaluate"], label
            assert worker[name]["weights"] == first[name]["weights"], label


@pytest.mark.multiprocess
def test_stock_keras_still_fails_under_mwms():
    # The suite's shared 2-worker launch (tests/acceptance/shared_launch_worker.py).
    result = shared_cluster("acceptance/shared_launch_worker.py", 2, timeout=900).check()
    for worker in (r["stock_keras"] for r in result.results):
        assert worker["stock"] and "Attempt to convert a value (PerReplica" in worker["stock"], (
            "Stock Keras no longer fails building the model under MWMS "
            f"(got {worker['stock']!r}); upstream may have fixed keras-team/keras#20585: "
            "re-evaluate keras_comm.training.step.symbolic_build."
        )
        assert worker["build_fixed"] and "Invalid reduction dimension" in worker["build_fixed"], (
            "Stock Keras no longer fails reducing step metrics under MWMS "
            f"(got {worker['build_fixed']!r}); re-evaluate keras_comm.training.step.make_function."
        )
