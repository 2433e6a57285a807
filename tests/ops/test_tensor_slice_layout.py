"""GetTensorSlice with a MindSpore layout: device matrix + tensor map (issue 17 item 4).

Forward values are closed forms (member p = grid coordinates in row-major
order; slice by hand with numpy); gradients, both modes, against the float64
single-process simulation (`_gradcheck`).
"""

import numpy as np
import pytest
import tensorflow as tf

import keras_comm
from keras_comm import layers
from keras_comm import ops
from keras_comm.ops.virtual import layout_slices
from conftest import make_strategy
from _gradcheck import check


def test_layout_slices_pure():
    # Grid [2, 2]: member 2 is at (1, 0). Map [1, 0]: dim 0 by grid dim 0
    # (the slow one, counted 1 from the end), dim 1 by grid dim 1.
    assert layout_slices(2, (2, 2), (1, 0)) == [(2, 1), (2, 0)]
    assert layout_slices(1, (2, 2), (1, 0)) == [(2, 0), (2, 1)]
    assert layout_slices(3, (2, 2), (0, -1)) == [(2, 1), (1, 0)]
    assert layout_slices(5, (2, 3), (-1, 1, 0)) == [(1, 0), (2, 1), (3, 2)]
    assert layout_slices(0, (4,), (0, -1)) == [(4, 0), (1, 0)]


def _x(r, n):
    return np.arange(24, dtype=np.float64).reshape(4, 6) + 100.0 * r


def _by_hand(x, r, device_matrix, tensor_map):
    """The slice from the definition: coordinates of r in the row-major grid."""
    coords = np.unravel_index(r, device_matrix)
    out = x
    for axis, m in enumerate(tensor_map):
        if m == -1:
            continue
        g = len(device_matrix) - 1 - m
        n, i = device_matrix[g], coords[g]
        size = x.shape[axis] // n
        out = np.take(out, range(i * size, (i + 1) * size), axis=axis)
    return out


LAYOUTS = {
    2: [((2,), (-1, 0)), ((2,), (0, -1)), ((1, 2), (1, 0)), ((2, 1), (1, 0))],
    4: [((2, 2), (1, 0)), ((2, 2), (0, 1)), ((2, 2), (0, -1)), ((4,), (-1, -1)), ((2, 2), (-1, 1))],
}


def _reference(device_matrix, tensor_map, exact):
    def ref(xs):
        out = []
        for r, x in enumerate(xs):
            index = []
            for axis, (n, i) in enumerate(layout_slices(r, device_matrix, tensor_map)):
                size = x.shape[axis] // n
                index.append(slice(i * size, (i + 1) * size))
            y = x[tuple(index)]
            out.append(y if exact else tf.stop_gradient(y))
        return out

    return ref


@pytest.mark.inprocess
@pytest.mark.parametrize("backward", ["exact", "zeros"])
def test_layout_forward_and_backward(strategy, mode, backward):
    n = strategy.num_replicas_in_sync
    for device_matrix, tensor_map in LAYOUTS[n]:
        got = check(
            strategy,
            lambda x: ops.get_tensor_slice(
                x, backward=backward, device_matrix=device_matrix, tensor_map=tensor_map
            ),
            _reference(device_matrix, tensor_map, backward == "exact"),
            _x,
            mode=mode,
        )
        for r, (y, g) in enumerate(got):
            want = _by_hand(_x(r, n), r, device_matrix, tensor_map)
            np.testing.assert_array_equal(y, want, err_msg=f"{device_matrix} {tensor_map} rank {r}")
            if backward == "zeros":
                np.testing.assert_array_equal(g, np.zeros([4, 6]))


@pytest.mark.inprocess
def test_layout_subgroup_and_non_members(mode):
    strategy = make_strategy(4)
    group = [1, 2]
    got = check(
        strategy,
        lambda x: ops.get_tensor_slice(
            x, group=group, backward="exact", device_matrix=[2], tensor_map=[-1, 0]
        ),
        lambda xs: [
            x[:, 3 * group.index(r) : 3 * group.index(r) + 3] if r in group else x
            for r, x in enumerate(xs)
        ],
        _x,
        mode=mode,
    )
    assert got[0][0].shape == (4, 6) and got[1][0].shape == (4, 3)


def test_layout_one_axis_equivalence():
    # With one grid dimension splitting one axis, the layout is the one-axis slice.
    strategy = make_strategy(2)

    def fn():
        x = tf.constant(_x(0, 2))
        return (
            ops.get_tensor_slice(x, 1),
            ops.get_tensor_slice(x, device_matrix=[2], tensor_map=[-1, 0]),
        )

    for a, b in keras_comm_run(strategy, fn):
        np.testing.assert_array_equal(a, b)


def keras_comm_run(strategy, fn):
    from conftest import run_replicas

    return run_replicas(strategy, fn, mode="function")


@pytest.mark.parametrize(
    "kwargs, error, text",
    [
        (dict(device_matrix=[2]), ValueError, "tensor_map=None"),
        (dict(device_matrix=[2, 2], tensor_map=[0, 2]), ValueError, "tensor_map=[0, 2]"),
        (dict(device_matrix=[2, 2], tensor_map=[0, 0]), ValueError, "tensor_map=[0, 0]"),
        (dict(device_matrix=[0], tensor_map=[0]), ValueError, "device_matrix=0"),
        (dict(device_matrix=[2], tensor_map=[0], axis=1), ValueError, "axis=1"),
        (dict(device_matrix=[2], tensor_map=[0], group=[0, 1, 2]), ValueError, "device_matrix=[2]"),
    ],
)
def test_layout_validated_at_construction(kwargs, error, text):
    with pytest.raises(error, match="Received") as info:
        layers.GetTensorSlice(**kwargs)
    assert text in str(info.value)


def test_layout_checked_against_input_and_world():
    x = tf.zeros([4, 6])
    with pytest.raises(ValueError, match="one entry per dimension"):
        ops.get_tensor_slice(x, device_matrix=[1], tensor_map=[0])
    with pytest.raises(ValueError, match="must hold the group's 1 members"):
        ops.get_tensor_slice(x, device_matrix=[2], tensor_map=[0, -1])
    strategy = make_strategy(4)
    with pytest.raises(ValueError, match="divisible"):
        run = lambda: ops.get_tensor_slice(tf.zeros([3, 6]), device_matrix=[2, 2], tensor_map=[1, 0])  # noqa: E731
        strategy.run(run)


def test_layer_layout_config_shape_and_old_config():
    layer = layers.GetTensorSlice(device_matrix=[2, 2], tensor_map=[1, 0], backward="exact")
    config = layer.get_config()
    assert config["device_matrix"] == [2, 2] and config["tensor_map"] == [1, 0]
    assert layers.GetTensorSlice.from_config(config).get_config() == config
    assert layer.compute_output_shape((4, 6)) == (2, 3)
    old = layers.GetTensorSlice(axis=1, num_slices=2).get_config()
    for key in ("device_matrix", "tensor_map"):
        old.pop(key)  # a config saved before the layout existed
    loaded = layers.GetTensorSlice.from_config(old)
    assert loaded.device_matrix is None and loaded.compute_output_shape((4, 6)) == (4, 3)
