"""What a weight split by `keras.distribution` keeps in memory after it is
assigned or loaded, on in-process replicas.

TensorFlow's own count of the bytes its CPU allocator hands out
(`tf.config.experimental.get_memory_info`) before and after: a block that
shared the full value's buffer would keep the full value alive for as long
as the weight lives. Exactness is test_distribution.py's.
"""

import keras
import numpy as np

import keras_comm
from conftest import live_bytes
from conftest import make_strategy

MIB = 2**20
ROWS, COLS = 4096, 2048  # a 32 MiB float32 kernel


def _row_split_model():
    # 4 replicas on a (2, 2) mesh: the kernel's rows are split over "model",
    # so each block (16 MiB) is held by 2 replicas.
    strategy = make_strategy(4)
    devices = keras_comm.distribution.list_devices(strategy)
    mesh = keras.distribution.DeviceMesh((2, 2), ("batch", "model"), devices=devices)
    layout_map = keras.distribution.LayoutMap(mesh)
    layout_map["mlp/d/kernel"] = ("model", None)
    distribution = keras.distribution.ModelParallel(layout_map=layout_map, batch_dim_name="batch")
    with strategy.scope(), distribution.scope():
        model = keras.Sequential([keras.Input((ROWS,)), keras.layers.Dense(COLS, name="d")], name="mlp")
    kernel = model.layers[0].kernel
    assert keras_comm.distribution.is_sharded(kernel)
    return model, kernel


def test_set_weights_and_loading_keep_only_the_blocks(tmp_path):
    # `assign` converts the full value to a tensor and slices it. A
    # leading-dimension slice shares the tensor's buffer, and a variable
    # assigned a tensor nobody else holds adopts that buffer: each block
    # would keep the whole converted value alive. Keras's `load_weights`
    # (and BackupAndRestore's restore) reads each weight whole and assigns it.
    model, kernel = _row_split_model()
    values = [np.random.RandomState(1).standard_normal((ROWS, COLS)).astype("float32"),
              np.zeros((COLS,), "float32")]
    before = live_bytes()
    model.set_weights(values)
    grown = live_bytes() - before
    assert abs(grown) < MIB / 2, ("set_weights", grown / MIB)
    np.testing.assert_array_equal(np.asarray(kernel), values[0])

    path = str(tmp_path / "m.weights.h5")
    model.save_weights(path)
    kernel.assign(np.zeros((ROWS, COLS), "float32"))
    before = live_bytes()
    model.load_weights(path)
    grown = live_bytes() - before
    assert abs(grown) < MIB / 2, ("load_weights", grown / MIB)
    np.testing.assert_array_equal(np.asarray(kernel), values[0])
