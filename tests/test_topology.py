"""Groups, ranks and collective keys; in-process primitives on logical CPUs."""

import numpy as np
import pytest
import tensorflow as tf

import keras_comm
from keras_comm import topology
from keras_comm.ops import _collective as C
from conftest import run_replicas


class TestGroup:
    def test_sorted_and_indexed(self):
        g = keras_comm.Group([3, 1])
        assert g.ranks == (1, 3)
        assert g.size == 2
        assert g.index(3) == 1
        assert 1 in g and 0 not in g

    @pytest.mark.parametrize(
        "ranks, error, text",
        [
            ([], ValueError, "must not be empty"),
            ([0, 0, 1], ValueError, "repeated: [0]"),
            ([-1], ValueError, ">= 0"),
            (["0"], TypeError, "int ranks"),
            ("01", TypeError, "list of global ranks"),
            ([1.0], TypeError, "int ranks"),
        ],
    )
    def test_bad_ranks(self, ranks, error, text):
        with pytest.raises(error, match="Received") as info:
            keras_comm.Group(ranks)
        assert text in str(info.value)

    def test_outside_world(self):
        with pytest.raises(ValueError, match=r"ranks \[4\] outside the world of 4"):
            keras_comm.Group([0, 4]).check_world(4)

    def test_key_depends_only_on_ranks(self):
        assert keras_comm.Group([2, 0]).key == keras_comm.Group((0, 2)).key
        assert keras_comm.Group([0, 1]).key != keras_comm.Group([0, 2]).key
        # Far above tf.distribute's own keys, which count from 1.
        assert keras_comm.Group([0]).key >= 1 << 24

    def test_as_group_names_argument(self):
        assert topology.as_group(None) is None
        with pytest.raises(ValueError, match="`root_group` must not be empty"):
            topology.as_group([], name="root_group")


def test_rank_outside_strategy():
    assert keras_comm.world_size() == 1
    assert keras_comm.rank() == 0


@pytest.mark.inprocess
def test_one_process_is_one_chief_worker(strategy):
    """In-process replicas are one worker: no broadcast of initial values, no
    redirected callback paths. (Several workers: the 4-worker launch of
    test_parallel_multiprocess, whose chief alone computes the initial values.)"""
    for s in (strategy, tf.distribute.get_strategy()):
        assert topology.worker_count(s) == 1
        assert not topology.is_multi_worker(s)
        assert topology.task_id(s) == 0
        assert topology.is_chief(s)


@pytest.mark.inprocess
def test_rank_in_replicas(strategy, mode):
    got = run_replicas(strategy, lambda: tf.constant(keras_comm.rank()), mode=mode)
    assert [int(g) for g in got] == list(range(strategy.num_replicas_in_sync))


@pytest.mark.inprocess
def test_rank_in_cross_replica_context_is_an_error(strategy):
    with strategy.scope():
        with pytest.raises(RuntimeError, match="cross-replica context"):
            keras_comm.rank()


@pytest.mark.inprocess
def test_instance_keys_survive_retracing(strategy):
    """Two traces of one function, called alternately, still match up."""
    n = strategy.num_replicas_in_sync

    def fn(x):
        rep = topology.current_replica()
        call = C.Call(rep, keras_comm.Group(range(n)), timeout=30)
        return C.run(lambda: C.all_reduce(x * (rep.rank + 1), call))

    f = tf.function(lambda x: strategy.run(fn, args=(x,)))
    total = n * (n + 1) / 2
    for shape in ([2], [3], [2], [3, 1]):
        out = f(tf.ones(shape))
        for v in strategy.experimental_local_results(out):
            np.testing.assert_allclose(v.numpy(), np.full(shape, total))
