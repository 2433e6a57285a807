"""Worker: a real MultiWorkerMirroredStrategy all-reduce over loopback gRPC."""

import tensorflow as tf

from _cluster import write_result

strategy = tf.distribute.MultiWorkerMirroredStrategy()


def replica_fn():
    ctx = tf.distribute.get_replica_context()
    # Rank-encoded input: 1 + replica id, so the sum tells which replicas took part.
    return tf.constant(1.0), tf.cast(ctx.replica_id_in_sync_group, tf.float32) + 1.0


ones, ids = strategy.run(replica_fn)
write_result(
    {
        "num_replicas": strategy.num_replicas_in_sync,
        "sum_ones": float(strategy.reduce(tf.distribute.ReduceOp.SUM, ones, axis=None)),
        "sum_ids": float(strategy.reduce(tf.distribute.ReduceOp.SUM, ids, axis=None)),
    }
)
