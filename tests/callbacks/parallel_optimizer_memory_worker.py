"""Worker: peak resident memory of one ParallelOptimizer configuration.

Each launch is one configuration in fresh processes (peak RSS only grows):
an MLP of 15.8M parameters (63 MB of float32 weights, in 15 layers so that
the optimizer's per-variable temporaries stay small), zero_stage 1, and the
optimizer given on the command line. TensorFlow runs one op at a time
(inter-op parallelism 1) so the peak does not depend on how concurrent ops
happened to overlap.

Usage: parallel_optimizer_memory_worker.py OPTIMIZER ZERO_STAGE [CONFIG ...],
OPTIMIZER in adam, sgd (no momentum: no slots). After the memory is read,
the same processes run parallel_optimizer_worker's CONFIGs (its result
under "configs"): they cannot move the figure already taken, and they spare
the suite a launch of their own.
"""

import resource
import sys

import tensorflow as tf

tf.config.threading.set_inter_op_parallelism_threads(1)
strategy = tf.distribute.MultiWorkerMirroredStrategy()

import keras  # noqa: E402
import numpy as np  # noqa: E402

import keras_comm  # noqa: E402,F401
from _cluster import finish, write_result  # noqa: E402

PER_REPLICA_BATCH = 512  # activations (~50 MB) make the step the peak, not fit's start


def peak():
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def anonymous():
    """Resident anonymous memory (RssAnon): the heap, without the shared
    libraries' file pages, which the kernel drops and re-reads under memory
    pressure from other processes. TensorFlow's CPU allocator keeps what it
    once took, so after `fit` this is the peak of the heap."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("RssAnon:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("no RssAnon in /proc/self/status")


def held():
    """RssAnon once the C allocator has handed its free pages back.

    TensorFlow's CPU tensors come from malloc, which keeps freed chunks
    resident in per-thread arenas: how much of the step's temporaries stays
    after `fit` depends on which threads ran them and how they overlapped,
    and so on the load beside the job (raw RssAnon put Adam's state at 1.1 W
    on a quiet machine, 1.6-2.1 W beside a CPU-bound process).
    `malloc_trim(0)` returns every free page of every arena to the kernel
    (measured: 1.0 W quiet, 1.4 W beside the CPU-bound process)."""
    import ctypes

    ctypes.CDLL("libc.so.6").malloc_trim(0)
    return anonymous()


def main(name, zero, configs):
    n = strategy.num_replicas_in_sync
    keras.utils.set_random_seed(0)
    with strategy.scope():
        model = keras.Sequential(
            [keras.Input((1024,))]
            + [keras.layers.Dense(1024, activation="relu") for _ in range(15)]
            + [keras.layers.Dense(8)]
        )
        opt = keras.optimizers.Adam(1e-4) if name == "adam" else keras.optimizers.SGD(1e-4)
        model.compile(optimizer=opt, loss="mse")
    rng = np.random.default_rng(0)
    x = rng.random((PER_REPLICA_BATCH * n, 1024), dtype=np.float32)
    y = rng.random((PER_REPLICA_BATCH * n, 8), dtype=np.float32)
    ds = tf.data.Dataset.from_tensor_slices((x, y)).repeat().batch(PER_REPLICA_BATCH * n)
    built = peak()
    po = keras_comm.callbacks.ParallelOptimizer(zero_stage=zero)
    model.fit(ds, epochs=1, steps_per_epoch=3, verbose=0, callbacks=[po])
    out = {
        "rank": int(strategy.cluster_resolver.task_id),
        "peak": peak(),
        "anonymous": anonymous(),
        "held": held(),
        "built": built,
        "state": po.state_bytes(breakdown=True),
        "weights": sum(int(np.prod(v.shape)) * 4 for v in model.trainable_variables),
    }
    if configs:
        import parallel_optimizer_worker

        out["configs"] = parallel_optimizer_worker.results(strategy, configs)
    write_result(out)


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]), sys.argv[3:])
    finish()  # _cluster.finish: skip the slow teardown
