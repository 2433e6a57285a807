"""What a `Pipeline`'s training step keeps in memory, on in-process replicas.

TensorFlow's own count of the bytes its CPU allocator hands out
(`tf.config.experimental.get_memory_info`) before and after `model.fit`:
whatever the step function keeps for as long as it lives shows as the
difference. Exactness is test_pipeline.py's.
"""

import keras
import numpy as np

from conftest import live_bytes
from conftest import make_strategy
from keras_comm.parallel import Pipeline

MIB = 2**20


def test_a_stage_smaller_than_the_buffer_keeps_no_zeros_for_its_padding():
    # Stage 0 holds 8 MiB of weights, stage 1 a few KiB: replica 1's buffer
    # is almost all padding, and the padding's part of its gradient is zeros.
    # A zeros tensor of that static shape would become a constant of the
    # step function, kept (8 MiB) for as long as the function lives.
    strategy = make_strategy(2)
    keras.utils.set_random_seed(0)
    with strategy.scope():
        model = keras.Sequential([
            keras.Input((128,)),
            Pipeline([keras.layers.Dense(16384), keras.layers.Dense(2)], 2, "1f1b"),
        ])
        model.compile(optimizer=keras.optimizers.SGD(0.01), loss="mse")
    layer = model.layers[0]
    padding = layer.stage_nbytes(0) - layer.stage_nbytes(1)
    assert padding > 7 * MIB
    rng = np.random.default_rng(0)
    x = rng.normal(size=(8, 128)).astype("float32")
    y = rng.normal(size=(8, 2)).astype("float32")
    before = live_bytes()
    model.fit(x, y, batch_size=8, epochs=1, verbose=0)
    kept = live_bytes() - before
    assert kept < padding / 4, f"the step keeps {kept / MIB:.1f} MiB (padding {padding / MIB:.1f} MiB)"
