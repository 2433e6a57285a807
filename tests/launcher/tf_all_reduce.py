"""Worker: a real MultiWorkerMirroredStrategy all-reduce over loopback gRPC.

Rank 0 (the chief, host of the coordination service) then ends at once while
rank 1 still uses the service a few seconds later: the launcher's exit
barrier keeps the chief alive until then.
"""

import os
import time

import tensorflow as tf
from tensorflow.python.eager import context

from _cluster import write_result

strategy = tf.distribute.MultiWorkerMirroredStrategy()


def replica_fn():
    ctx = tf.distribute.get_replica_context()
    # Rank-encoded input: 1 + replica id, so the sum tells which replicas took part.
    return tf.constant(1.0), tf.cast(ctx.replica_id_in_sync_group, tf.float32) + 1.0


ones, ids = strategy.run(replica_fn)
result = {
    "num_replicas": strategy.num_replicas_in_sync,
    "sum_ones": float(strategy.reduce(tf.distribute.ReduceOp.SUM, ones, axis=None)),
    "sum_ids": float(strategy.reduce(tf.distribute.ReduceOp.SUM, ids, axis=None)),
}
if os.environ["RANK"] == "1":
    time.sleep(3.0)
    context.context().set_config_key_value("late", "still here")
    result["late"] = context.context().get_config_key_value("late")
write_result(result)
