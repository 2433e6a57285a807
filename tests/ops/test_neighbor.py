"""NeighborExchange and HaloExchange (NeighborExchangeV2)."""

import os

import keras
import numpy as np
import pytest
import tensorflow as tf

from keras_comm import layers as L
from keras_comm import ops
from keras_comm.ops import neighbor
import _gradcheck
from conftest import make_strategy
import p2p_worker as cases


@pytest.mark.inprocess
@pytest.mark.parametrize("pattern", [cases.ring_pattern, cases.asymmetric_pattern], ids=["ring", "asymmetric"])
def test_neighbor_exchange_gradcheck(strategy, mode, pattern):
    n = strategy.num_replicas_in_sync
    op_fn, ref_fn, make = cases.neighbor_case(n, pattern)
    got = _gradcheck.check(strategy, op_fn, ref_fn, make, mode=mode)
    if pattern is cases.ring_pattern:
        # Closed form: rank r receives rank r-1's input (rank-encoded by 100*r).
        for r in range(n):
            np.testing.assert_array_equal(got[r][0][0], make((r - 1) % n, n)[0])


@pytest.mark.inprocess
def test_neighbor_exchange_subgroup_nonmembers_get_zeros():
    strategy = make_strategy(4)
    group = [1, 3]
    send, recv = [[3], [1]], [[3], [1]]
    op_fn, _, make = cases.neighbor_case(4, (send, recv), group=group)

    def ref_fn(xs):
        zero = tf.zeros([1, 3], xs[0].dtype)
        return [zero, xs[3], zero, xs[1]]

    _gradcheck.check(strategy, op_fn, ref_fn, make)


HALO_FORMATS = ["NCHW", "NHWC"]


@pytest.mark.inprocess
@pytest.mark.parametrize("data_format", HALO_FORMATS)
def test_halo_exchange_gradcheck(strategy, mode, data_format):
    n = strategy.num_replicas_in_sync
    op_fn, ref_fn, make = cases.halo_case(n, data_format)
    _gradcheck.check(strategy, op_fn, ref_fn, make, mode=mode)


@pytest.mark.inprocess
def test_halo_exchange_closed_form_rank_encoded():
    """Tiles filled with rank+1: each halo holds its neighbour's rank+1."""
    strategy = make_strategy(4)
    ids = ops.halo_rank_ids(2, 2)

    def make(rank, n):
        return np.full([1, 1, 2, 2], rank + 1.0)

    def op_fn(x):
        return ops.neighbor_exchange_v2(x, ids, [1, 1, 1, 1], ids, [1, 1, 1, 1])

    got = _gradcheck.distributed(strategy, op_fn, make)
    y0 = got[0][0][0, 0]  # rank 0: top-left tile; right=1, bottom=2, bottom_right=3
    np.testing.assert_array_equal(y0, [[0, 0, 0, 0], [0, 1, 1, 2], [0, 1, 1, 2], [0, 3, 3, 4]])
    y3 = got[3][0][0, 0]
    np.testing.assert_array_equal(y3, [[1, 2, 2, 0], [3, 4, 4, 0], [3, 4, 4, 0], [0, 0, 0, 0]])


def test_halo_rank_ids():
    assert ops.halo_rank_ids(1, 2) == [[-1, -1, 1, -1, -1, -1, -1, -1], [-1, -1, -1, -1, -1, -1, 0, -1]]
    torus = ops.halo_rank_ids(3, 3, periodic=True)
    assert torus[0] == [6, 7, 1, 4, 3, 5, 2, 8]


def test_plans_are_deadlock_free_orders():
    _, _, _, _, _, transfers = neighbor.exchange_plan(*cases.ring_pattern(4), [[3]], [[3]])
    keys = [(min(t.src, t.dst), max(t.src, t.dst)) for t in transfers]
    assert keys == sorted(keys) and len(transfers) == 4


class TestLayers:
    def _layers(self):
        ids = ops.halo_rank_ids(1, 2)
        return [
            L.NeighborExchange([[2], [0]], [[2], [0]], [(None, 3)], [(None, 3)], group=[0, 2], timeout=9),
            L.NeighborExchangeV2(ids, [1, 1, 1, 1], ids, [1, 1, 1, 1], data_format="NHWC"),
        ]

    def test_config_round_trip(self):
        for layer in self._layers():
            clone = type(layer).from_config(layer.get_config())
            assert clone.get_config() == layer.get_config()

    def test_models_save_load_world_of_one(self, tmp_path):
        ex, halo = self._layers()
        ex = L.NeighborExchange([[1], [0]], [[1], [0]], [(None, 3)], [(None, 3)])
        a = keras.Input((3,))
        img = keras.Input((2, 3, 4))
        (b,) = ex([a])
        model = keras.Model([a, img], [b, halo(img)])
        assert model.output_shape == [(None, 3), (None, 4, 5, 4)]
        path = os.path.join(tmp_path, "m.keras")
        model.save(path)
        loaded = keras.models.load_model(path)
        xs = [np.ones((2, 3), "float32"), np.ones((2, 2, 3, 4), "float32")]
        out = loaded.predict(xs, verbose=0)
        np.testing.assert_array_equal(out[0], 0)  # nothing received in a world of one
        np.testing.assert_array_equal(out[1][:, 1:-1, 1:-1], 1)  # zero border
        seq = keras.Sequential([keras.Input((2, 3, 4)), halo])
        assert seq.output_shape == (None, 4, 5, 4)

    def test_reference_names_are_aliases_and_old_configs_load(self):
        assert ops.neighbor_exchange_v2 is ops.halo_exchange
        assert L.NeighborExchangeV2 is L.HaloExchange
        ids = ops.halo_rank_ids(1, 2)
        layer = L.HaloExchange(ids, [1, 1, 1, 1], ids, [1, 1, 1, 1], data_format="NHWC", name="halo")
        saved = keras.saving.serialize_keras_object(layer)
        assert saved["class_name"] == "HaloExchange"
        # What a file saved before the rename holds: the MindSpore class name.
        old = dict(saved, class_name="NeighborExchangeV2", registered_name="keras_comm>NeighborExchangeV2")
        loaded = keras.saving.deserialize_keras_object(old)
        assert type(loaded) is L.HaloExchange
        assert loaded.get_config() == layer.get_config()

    @pytest.mark.parametrize(
        "kwargs, error, text",
        [
            (dict(send_ranks=[[1], [0]], recv_ranks=[[1]]), ValueError, "len(recv_ranks)=1"),
            (dict(send_ranks=[[1, 1], [0]], recv_ranks=[[1], [0]]), ValueError, "send_ranks[0]=[1, 1]"),
            (dict(send_ranks=[[0], [0]], recv_ranks=[[1], [0]]), ValueError, "names rank 0 itself"),
            (dict(send_ranks=[[1], [None]], recv_ranks=[[None], [None]]), ValueError, "receives 0 from rank 0"),
            (dict(send_ranks=[[2], [0]], recv_ranks=[[1], [0]]), ValueError, "not in the group"),
            (dict(send_ranks=[[-1], [0]], recv_ranks=[[1], [0]]), ValueError, "entry=-1"),
            (dict(send_ranks=[[1], [0]], recv_ranks=[[1], [0]], recv_shapes=[(4,)]), ValueError, "shapes must match"),
        ],
    )
    def test_bad_exchange(self, kwargs, error, text):
        args = dict(recv_shapes=[(3,)], send_shapes=[(3,)])
        args.update(kwargs)
        with pytest.raises(error) as info:
            L.NeighborExchange(**args)
        assert text in str(info.value) and "Received" in str(info.value)

    @pytest.mark.parametrize(
        "kwargs, text",
        [
            (dict(data_format="NWHC"), "data_format='NWHC'"),
            (dict(send_lens=[1, 1, 1]), "send_lens=[1, 1, 1]"),
            (dict(recv_lens=[1, 1, -1, 1]), "recv_lens=[1, 1, -1, 1]"),
            (dict(send_lens=[1, 1, 2, 1]), "send_lens=[1, 1, 2, 1]"),
            (dict(recv_rank_ids=[[-1] * 8, [-1] * 8]), "not 0"),
        ],
    )
    def test_bad_halo(self, kwargs, text):
        ids = ops.halo_rank_ids(1, 2)
        args = dict(send_rank_ids=ids, send_lens=[1, 1, 1, 1], recv_rank_ids=ids, recv_lens=[1, 1, 1, 1])
        args.update(kwargs)
        with pytest.raises(ValueError) as info:
            L.NeighborExchangeV2(**args)
        assert text in str(info.value)

    def test_halo_strip_larger_than_tile(self):
        ids = ops.halo_rank_ids(1, 1)
        layer = L.NeighborExchangeV2(ids, [3, 3, 1, 1], ids, [3, 3, 1, 1])
        with pytest.raises(ValueError, match="exceed the tile of 2x2"):
            layer(tf.ones([1, 1, 2, 2]))
