"""Worker: ParallelOptimizer across real processes, many configurations per launch.

Each worker is one replica. For every configuration it trains with the
callback under MultiWorkerMirroredStrategy, then trains the same model in
this process alone with the plain optimizer and batch
``accumulation_steps x global micro-batch``, and reports the max relative
weight difference, the state bytes and a checksum of the final weights
(equal on every worker).

Usage: parallel_optimizer_worker.py CONFIG [CONFIG ...], CONFIG = opt:acc:zero
with opt in sgd, adam, adamw (suffix +lso for a LossScaleOptimizer).
`results(strategy, configs)` runs them in a worker of another launch too
(callbacks/parallel_optimizer_memory_worker.py: the 2-worker configurations
ride in its launches, which pay the import and the cluster's setup anyway).
Import this module only after creating the strategy (TF_CONFIG is read once).
"""

import sys
import time

import numpy as np
import tensorflow as tf

from _cluster import finish, write_result

STEPS = 8  # micro-batches per epoch

# The configurations each worker count trains, opt:accumulation_steps:zero_stage.
# Every optimizer, accumulation_steps and zero_stage appears on each worker
# count; the in-process tests cover the rest. 2 workers: in the state-bytes
# launches (parallel_optimizer_memory_worker.py); 3: in the shared 3-worker
# launch (tests/acceptance/shared_launch_worker.py).
CONFIGS = {
    2: ["sgd:1:0", "adam:2:1", "adamw+lso:4:2"],
    3: ["adamw:2:0", "sgd:4:1", "adam:1:2"],
}


def data(n_workers):
    rng = np.random.default_rng(0)
    n = 2 * n_workers * STEPS
    return (
        rng.normal(size=(n, 5)).astype("float32"),
        rng.normal(size=(n, 3)).astype("float32"),
    )


def optimizer(spec):
    import keras

    name, lso = spec.split("+")[0], spec.endswith("+lso")
    opt = {
        "sgd": lambda: keras.optimizers.SGD(0.1, momentum=0.9),
        "adam": lambda: keras.optimizers.Adam(0.05),
        "adamw": lambda: keras.optimizers.AdamW(0.05, weight_decay=0.1),
    }[name]()
    return keras.optimizers.LossScaleOptimizer(opt) if lso else opt


def model(spec):
    import keras

    keras.utils.set_random_seed(1)
    m = keras.Sequential(
        [keras.Input((5,)), keras.layers.Dense(4, activation="tanh"), keras.layers.Dense(3)]
    )
    m.compile(optimizer=optimizer(spec), loss="mse")
    return m


def dataset(x, y, batch):
    ds = tf.data.Dataset.from_tensor_slices((x, y)).batch(batch)
    options = tf.data.Options()
    options.experimental_distribute.auto_shard_policy = tf.data.experimental.AutoShardPolicy.DATA
    return ds.with_options(options)


def run(strategy, config, x, y):
    import keras_comm

    micro = 2 * strategy.num_replicas_in_sync  # global micro-batch: 2 samples per worker
    spec, acc, zero = config.split(":")
    acc, zero = int(acc), int(zero)
    with strategy.scope():
        parallel = model(spec)
    po = keras_comm.callbacks.ParallelOptimizer(accumulation_steps=acc, zero_stage=zero)
    parallel.fit(dataset(x, y, micro), epochs=2, verbose=0, callbacks=[po])
    single = model(spec)
    single.fit(dataset(x, y, micro * acc), epochs=2, verbose=0)
    rel = max(
        float(np.abs(a - b).max() / max(np.abs(b).max(), 1e-12))
        for a, b in zip(parallel.get_weights(), single.get_weights())
    )
    return {
        "max_rel": rel,
        "state": po.state_bytes(breakdown=True),
        "unsharded": po.unsharded_state_bytes(),
        "counts": po.counts,
        "checksum": float(sum(np.abs(w).sum() for w in parallel.get_weights())),
        "num_vars": len(parallel.trainable_variables),
    }


def results(strategy, configs):
    """``{"rank", "world", "results": {config: run's dict}, "seconds"}``."""
    x, y = data(strategy.num_replicas_in_sync)
    start = time.time()
    out = {c: run(strategy, c, x, y) for c in configs}
    return {
        "rank": int(strategy.cluster_resolver.task_id),
        "world": strategy.num_replicas_in_sync,
        "results": out,
        "seconds": time.time() - start,
    }


if __name__ == "__main__":
    from _strategy import strategy

    write_result(results(strategy, sys.argv[1:]))
    finish()  # _cluster.finish: skip the slow teardown
