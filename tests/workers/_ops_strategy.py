"""The one MultiWorkerMirroredStrategy of an ops worker process.

collectives_worker and mirror_worker both run in one launch (ops_worker.py);
a process creates its strategy once, so both import it from here.
"""

import tensorflow as tf

strategy = tf.distribute.MultiWorkerMirroredStrategy()
