"""Worker: the TF multi-worker Keras tutorial flow after `import keras_comm`.

Run by tests/compat/test_compat.py through run_cluster; writes every scenario's
weights, history, evaluate and predict results for comparison with a
single-process reference.
"""

import tensorflow as tf

import keras_comm  # noqa: F401  (applies keras_comm.compat)
from _cluster import write_result

# As in the tutorial: the strategy is created first, from TF_CONFIG.
strategy = tf.distribute.MultiWorkerMirroredStrategy()

import flows  # noqa: E402

write_result(flows.run_all(strategy))
