"""A module that runs a TensorFlow op on import: `--preload` must refuse it."""

import tensorflow as tf

tf.constant(1.0)
