"""Silent misuse made loud (issue 15 item 6): collectives outside any
strategy inside a multi-worker job.

The unsupported-Keras warning on import is in tests/compat/test_compat.py and the
indivisible AlltoAll at build time in tests/ops/test_all_to_all.py.
"""

import json
import warnings

import pytest
import tensorflow as tf

from keras_comm import layers
from keras_comm import topology
from _cluster import run_cluster


@pytest.mark.parametrize("environ, workers", [
    ({}, 1),
    ({"KERAS_COMM_WORLD_SIZE": "2"}, 2),
    ({"WORLD_SIZE": "3"}, 3),
    ({"KERAS_COMM_WORLD_SIZE": "1", "WORLD_SIZE": "4"}, 1),
    ({"TF_CONFIG": json.dumps({"cluster": {"worker": ["a:1", "b:2"]},
                               "task": {"type": "worker", "index": 0}})}, 2),
    ({"TF_CONFIG": json.dumps({"cluster": {"chief": ["a:1"], "worker": ["b:2"]},
                               "task": {"type": "chief", "index": 0}})}, 2),
    ({"TF_CONFIG": json.dumps({"cluster": {"worker": ["a:1"]}})}, 1),
    ({"TF_CONFIG": "not json"}, 1),
    ({"WORLD_SIZE": "many"}, 1),
])
def test_job_workers_reads_launcher_and_tf_config(environ, workers):
    assert topology.job_workers(environ) == workers


def _warnings_of(fn):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        fn()
    return [str(w.message) for w in caught if "outside any tf.distribute" in str(w.message)]


def test_warns_once_outside_a_strategy_in_a_multi_worker_job(monkeypatch):
    monkeypatch.setattr(topology, "_warned_no_strategy", False)
    monkeypatch.setenv("KERAS_COMM_WORLD_SIZE", "2")
    layer = layers.AllReduce(name="ar")
    first = _warnings_of(lambda: layer(tf.ones([2])))
    assert len(first) == 1, first
    assert "one of 2 workers" in first[0] and "'ar'" in first[0]
    assert "strategy.scope()" in first[0]
    assert _warnings_of(lambda: layer(tf.ones([2]))) == []


def test_no_warning_alone_or_under_a_strategy(monkeypatch):
    monkeypatch.setattr(topology, "_warned_no_strategy", False)
    monkeypatch.delenv("KERAS_COMM_WORLD_SIZE", raising=False)
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    monkeypatch.delenv("TF_CONFIG", raising=False)
    assert _warnings_of(lambda: layers.AllReduce()(tf.ones([2]))) == []
    monkeypatch.setenv("KERAS_COMM_WORLD_SIZE", "2")
    # A one-replica strategy is a deliberate choice, not a forgotten scope.
    with tf.distribute.OneDeviceStrategy("/cpu:0").scope():
        assert _warnings_of(lambda: layers.AllReduce()(tf.ones([2]))) == []


@pytest.mark.multiprocess
def test_two_real_workers_without_a_strategy_are_warned():
    # Before the fix each worker trained alone with AllReduce as the identity
    # and no message at all.
    result = run_cluster("no_strategy_worker.py", 2, timeout=240).check()
    for rank, r in enumerate(result.results):
        assert len(r["warnings"]) == 1, (rank, r["warnings"])
        assert "one of 2 workers" in r["warnings"][0]
