"""The one MultiWorkerMirroredStrategy of a worker process.

Several workers' checks share one launch (acceptance/shared_launch_worker.py:
the collectives, mirror, non-trainable, point-to-point, parallel,
ParallelOptimizer and compat groups; checkpoint_launch_worker.py: the
checkpoint, sharded-checkpoint and backup-agreement workers), so that the
launch's TensorFlow import and cluster setup (~8 CPU-seconds per process)
are paid once. A process creates its strategy once, so they import it from
here.
"""

import tensorflow as tf
from _shared import without_tf_data_autotune

# As in the pytest processes (conftest.py): with tf.data autotuning on, the
# end of each `fit` and `evaluate` waits for the released iterators'
# destructors (keras_comm.training.step), measured at ~10 s on 3 of 4 ranks
# of a 4-worker FullyShard GPT-2 fit whose 3 steps take 13 s; values and
# order are unchanged. The examples and docs' blocks keep autotuning.
without_tf_data_autotune()
strategy = tf.distribute.MultiWorkerMirroredStrategy()
