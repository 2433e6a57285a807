"""Initial values the workers agree on: worker 0's, sent to every worker.

`tf.distribute.MultiWorkerMirroredStrategy` makes a mirrored variable start
alike everywhere by broadcasting worker 0's initial value when the variable
is created. keras_comm's per-replica weights (tensor-parallel shards,
`FullyShard`'s flat shards, a `Pipeline`'s stage buffer) are written after
creation, each replica its own slice of a full value, so that broadcast does
not reach them. A full value computed on every worker from a seed derived
from the weight's path would not do either: a path holds Keras's automatic
layer names ("dense_7"), which count the layers the *process* made before,
so a chief that first built another model (an evaluation copy, a reference)
would draw other values than the other workers, and replicas holding the
same shard would start -- and, their gradients being summed, stay --
different.

`chief_value` does for those full values what MWMS does for mirrored ones:
worker 0 computes the value, broadcasts send it to every worker (in pieces
of at most `_PIECE_BYTES`), and each worker keeps its slices. Names, seeds
and the process's history then cannot matter. Only with more than one
worker: in one process every local replica slices the same host value
already.

Every worker must call `chief_value` for the same weights in the same order
(as it creates the same variables in the same order under MWMS, whose own
broadcasts need that too). Building a sharded model on the chief alone,
inside the strategy's scope, would wait for the other workers; build such
a reference outside the scope.
"""

import weakref

import numpy as np
import tensorflow as tf

from keras_comm import errors
from keras_comm import ops
from keras_comm import topology
from keras_comm import watchdog

# The dtypes `keras_comm.ops.broadcast` sends as they are; integer and bool
# values travel as int64 (exactly), anything else is refused.
_SENT_AS_IS = (tf.float16, tf.bfloat16, tf.float32, tf.float64, tf.int32, tf.int64)

# Values travel in pieces of at most this many bytes: a collective's
# transport copies what it sends and receives into host buffers that the
# process keeps, a few times a piece's size.
_PIECE_BYTES = 4 << 20

_SITE = watchdog.Site("the broadcast of worker 0's initial weights")

# strategy -> its compiled broadcast (one trace per dtype: the values are
# sent flat and the function relaxes the length after the second shape).
_functions = weakref.WeakKeyDictionary()


def chief_value(strategy, shape, dtype, compute):
    """Worker 0's `compute()` (a numpy array of `shape`), on every worker.

    Host side. `compute` runs on worker 0 only when there is more than one
    worker (elsewhere only `shape` and `dtype` are used); with one worker it
    is simply called.

    Args:
        strategy: the variables' strategy.
        shape: the value's shape.
        dtype: its dtype (a TF or numpy dtype or name).
        compute: ``compute() -> array`` of that shape.

    Returns:
        A numpy array: worker 0's value.

    Raises:
        TypeError: if the value's dtype cannot be sent (neither floating nor
            integer nor bool).
    """
    if not topology.is_multi_worker(strategy):
        return np.asarray(compute())
    dtype = tf.as_dtype(dtype)
    shape = tuple(int(d) for d in shape)
    chief = topology.is_chief(strategy)
    if chief:
        value = np.asarray(compute())
        if value.shape != shape:  # a bug of the caller: the receivers expect `shape`
            raise ValueError(
                f"The initial value to broadcast must have shape {shape}. "
                f"Received: value of shape {value.shape}"
            )
        value = np.reshape(value, [-1])
    wire = dtype
    if dtype not in _SENT_AS_IS:
        if not (dtype.is_integer or dtype.is_bool):
            raise TypeError(
                "Initial weights are broadcast from worker 0; this dtype cannot "
                f"be sent (floating, integer and bool can). Received: dtype={dtype.name}"
            )
        wire = tf.int64
    size = int(np.prod(shape))
    out = np.empty(size, dtype.as_numpy_dtype)
    step = max(1, _PIECE_BYTES // wire.size)
    with strategy.scope(), errors.collective_errors(), watchdog.guard(_SITE):
        for start in range(0, max(size, 1), step):
            stop = min(start + step, size)
            part = value[start:stop] if chief else np.zeros(stop - start, dtype.as_numpy_dtype)
            got = _broadcast_function(strategy)(tf.cast(tf.constant(part), wire))
            out[start:stop] = np.asarray(tf.cast(strategy.experimental_local_results(got)[0], dtype))
    return out.reshape(shape)


def _broadcast_function(strategy):
    fn = _functions.get(strategy)
    if fn is None:

        def replica_fn(x):
            return ops.broadcast(x, root=0, gradient="identity", name="initial_weights")

        fn = tf.function(lambda x: strategy.run(replica_fn, args=(x,)), reduce_retracing=True)
        _functions[strategy] = fn
    return fn
