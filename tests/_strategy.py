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

strategy = tf.distribute.MultiWorkerMirroredStrategy()
