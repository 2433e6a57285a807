"""The step owner: turns a per-replica step into the host function `fit` calls.

Every compiled step keras_comm runs is made here, by `make_function` (one
micro-batch per step, under MultiWorkerMirroredStrategy: `fit`'s and
`evaluate`'s), `make_predict_function` (`predict`'s) or
`compile_replica_call` (a step with no input batch). In order, a step:

1. pulls one batch on the host (the host loop of `steps_per_execution`);
2. runs the policy's replica step under `strategy.run` inside one
   `fusion_scope` (all-reduces sharing a `fusion` id become one transfer);
3. reduces its outputs: exact global metrics (`keras_comm.training.metrics`),
   or for `predict` the replicas' outputs concatenated in input order;
4. is watched as a whole by `keras_comm.watchdog.guard` (the collective
   timeout, with no per-op TensorFlow threads), whose clock starts when
   tracing ends;
5. raises collective errors translated by `keras_comm.errors` (which layer,
   which group, what to do).

A policy (see `keras_comm.training`) supplies only the replica step.
"""

import functools
import threading

import tensorflow as tf

from keras_comm import errors
from keras_comm import watchdog
from keras_comm._private import keras_api
from keras_comm._private import tf_api
from keras_comm.ops._fusion import fusion_scope
from keras_comm.training import metrics


def is_mwms(strategy, min_replicas=2):
    """Whether `strategy` is MultiWorkerMirroredStrategy with enough replicas.

    Covers the multi-worker form and the in-process form built from several
    local devices; MirroredStrategy and TPUStrategy keep stock behaviour.
    With a single replica a step has nothing to combine.
    """
    return (
        isinstance(strategy, tf.distribute.MultiWorkerMirroredStrategy)
        and strategy.num_replicas_in_sync >= min_replicas
    )


def symbolic_build(model, iterator=None, data_batch=None):
    """Builds `model` for `fit` from the dataset's element spec.

    Replaces `TensorFlowTrainer._maybe_symbolic_build`: upstream pulls a
    batch from `iterator` and `strategy.reduce`s it, which fails under
    MultiWorkerMirroredStrategy and consumes a step's input; the symbolic
    build only needs shapes and dtypes, which the distributed dataset's
    `element_spec` gives without consuming or communicating data.
    """
    # A single-replica MWMS hands out PerReplica batches too, so it needs
    # this as much as a cluster does.
    if not is_mwms(keras_api.model_strategy(model), min_replicas=1):
        upstream = keras_api.trainer_method("_maybe_symbolic_build")
        return upstream(model, iterator, data_batch)
    if iterator is not None and data_batch is None:
        # Every replica receives the same structure; one replica's spec
        # describes the inputs the model will be called on.
        data_batch = tf.nest.map_structure(
            tf_api.per_replica_component_spec,
            keras_api.iterator_element_spec(iterator),
            expand_composites=False,
        )
    with model.distribute_strategy.scope():
        keras_api.symbolic_build(model, data_batch)


def make_function(model, replica_step):
    """The host function running `replica_step` once per batch, on every replica.

    Replaces `TensorFlowTrainer._make_function` under MultiWorkerMirroredStrategy
    (other strategies get upstream's). What differs from upstream, each
    needed under that strategy:

    - Step logs that are the model's metrics are computed from the metrics'
      state summed over all replicas (`metrics.reduce_step_outputs`).
    - `steps_per_execution > 1` runs as a host loop over single-step calls.
      Upstream calls the step `tf.function` inside a `tf.while_loop`/`tf.cond`;
      TF's collectives take their instance keys as call-time captures, which
      do not propagate out of control flow, so under multi-replica strategies
      it fails with "You must feed a value for placeholder tensor
      'while/cond/Placeholder'". The host loop keeps what users see --
      callbacks every `steps_per_execution` steps, a partial last execution --
      but not the saving in launch overhead.
    - A worker with an empty shard gets a batch of static size 0, which
      Keras's loss code cannot handle (see `_unknown_if_empty`).

    Args:
        model: the Keras model whose strategy, `run_eagerly`, `jit_compile`
            and `steps_per_execution` apply.
        replica_step: ``fn(data) -> logs`` run per replica (a policy's step:
            `model.train_step`, `test_step`, or a `ParallelOptimizer` step).

    Returns:
        ``function(iterator) -> logs``, what `fit` stores as
        `model.train_function`; raises StopIteration when the data ends.
    """
    strategy = model.distribute_strategy
    if not is_mwms(strategy):
        function = keras_api.trainer_method("_make_function")(model, replica_step)
        # A one-replica MWMS (a one-worker cluster) runs upstream's step over
        # a distributed iterator, whose destructor stalls the same way.
        if is_mwms(strategy, min_replicas=1):
            return _releasing_previous_iterator(function)
        return function

    def step_on_replica(data):
        return replica_step(tf.nest.map_structure(_unknown_if_empty, data))

    @tf.autograph.experimental.do_not_convert
    def one_step_on_data(data):
        with fusion_scope():
            outputs = strategy.run(step_on_replica, args=(data,))
        outputs = metrics.reduce_step_outputs(model, strategy, outputs)
        if not model.run_eagerly:
            watchdog.restart()  # tracing ends here: the step's clock starts
        return outputs

    if not model.run_eagerly and model.jit_compile:
        one_step_on_data = tf.function(
            one_step_on_data, reduce_retracing=True, jit_compile=True
        )
    one_step_on_data = keras_api.autoconvert_optionals(model, one_step_on_data)

    # The batch is pulled in a compiled function, not by `next(iterator)` on
    # the host: an eager `next` on a distributed iterator runs its
    # end-of-data agreement (a scalar all-reduce of "has a value") as an
    # eager collective, through a `ThreadPool` TensorFlow creates and drops
    # at every call, and the eager ops of `get_next_as_optional` one by one.
    # Compiled, the same agreement is one graph collective. The
    # host reads only whether any worker had data, so a call at the end of
    # data runs nothing of the step.
    @tf.autograph.experimental.do_not_convert
    def next_optional(iterator):
        optional = iterator.get_next_as_optional()
        if not model.run_eagerly:
            watchdog.restart()
        return optional

    @tf.autograph.experimental.do_not_convert
    def one_step_on_optional(optional):
        return one_step_on_data(optional.get_value())

    if not model.run_eagerly:
        next_optional = tf.function(next_optional)
        one_step_on_optional = tf.function(one_step_on_optional, reduce_retracing=True)

    name = getattr(replica_step, "__name__", "step").lstrip("_")
    site = watchdog.Site(f"the model's {name}")

    def function(iterator):
        outputs = None
        for _ in range(model.steps_per_execution):
            # The pull and the step each get their own guard, so their
            # clocks do not add up: a batch that is slow to arrive (a loaded
            # input pipeline, the first batch of an iterator) does not eat
            # into the step's timeout, nor the step into the pull's. Both
            # report under the step's site, since a pull that never
            # completes is a peer that stopped before this step: its
            # end-of-data agreement is a collective.
            with errors.collective_errors(), watchdog.guard(site):
                # Under MWMS the distributed iterator agrees across workers
                # on the end of data: a worker with no samples left gets an
                # empty batch until every worker is out, so all run the
                # same steps, and all see "no value" on the same call.
                try:
                    optional = next_optional(iterator)
                except (StopIteration, tf.errors.OutOfRangeError):
                    break
                has_value = bool(optional.has_value())
            if not has_value:
                break
            with errors.collective_errors(), watchdog.guard(site):
                outputs = one_step_on_optional(optional)
        if outputs is None:
            raise StopIteration
        return outputs

    return _releasing_previous_iterator(function)


def make_predict_function(model, force=False):
    """Sets `model.predict_function` to a guarded per-batch predict step.

    Replaces `TensorFlowTrainer.make_predict_function` under
    MultiWorkerMirroredStrategy (other strategies get upstream's), so that
    `predict` runs like `fit`'s and `evaluate`'s steps: each batch under
    `strategy.run` in one `fusion_scope`, the call under `watchdog.guard`
    (a collective that never completes raises keras_comm's timeout error
    instead of waiting forever; its collectives take no per-op TensorFlow
    timeout threads) with collective errors translated. Upstream's predict
    step runs outside any guard.

    What a batch returns is upstream's: the replicas' outputs concatenated
    in input order (`keras_api.concat_replica_outputs`; across workers an
    all-gather, so every worker returns the whole input's predictions).
    `steps_per_execution` batches arrive together (Keras's `predict` passes
    a list of them); they run as a host loop of single steps, as in
    `make_function`, and their outputs are concatenated on the host.

    Args:
        model: the Keras model.
        force: rebuild even if `model.predict_function` is set.

    Returns:
        The function, ``function(batches) -> outputs``, also stored as
        `model.predict_function`.
    """
    if model.predict_function is not None and not force:
        return model.predict_function
    strategy = model.distribute_strategy
    if not is_mwms(strategy):
        return keras_api.trainer_method("make_predict_function")(model, force)

    @tf.autograph.experimental.do_not_convert
    def one_step_on_data(data):
        with fusion_scope():
            outputs = strategy.run(model.predict_step, args=(data,))
        outputs = keras_api.concat_replica_outputs(outputs, strategy)
        if not model.run_eagerly:
            watchdog.restart()  # tracing ends here: the step's clock starts
        return outputs

    if not model.run_eagerly:
        one_step_on_data = tf.function(one_step_on_data, reduce_retracing=True)
    one_step_on_data = keras_api.autoconvert_optionals(model, one_step_on_data)
    site = watchdog.Site("the model's predict_step")

    def function(batches):
        outputs = []
        for data in batches:
            with errors.collective_errors(), watchdog.guard(site):
                outputs.append(one_step_on_data(data))
        return tf.nest.map_structure(lambda *steps: _concat(steps), *outputs)

    model.predict_function = function
    return function


def _concat(tensors):
    """Batch outputs of consecutive steps, joined along the batch axis."""
    if len(tensors) == 1:
        return tensors[0]
    if isinstance(tensors[0], tf.SparseTensor):
        return tf.sparse.concat(axis=0, sp_inputs=list(tensors))
    if tensors[0].shape.rank == 0:
        return tf.stack(tensors)
    return tf.concat(tensors, axis=0)


def one_iterator_per_epoch(epoch_iterator):
    """Whether Keras's epoch iterator skips its spare iterator.

    Under MultiWorkerMirroredStrategy (one worker too) each epoch of `fit`
    and each `evaluate` creates only the distributed iterator it uses
    (`keras_api.enumerate_epoch_one_iterator`): upstream also builds, as each
    epoch ends, one the next epoch discards -- a multi-device iterator
    created and then destroyed on the host before the next epoch's first
    step. Other strategies keep upstream's generator.
    """
    return is_mwms(keras_api.epoch_iterator_strategy(epoch_iterator), min_replicas=1)


# --- Where the previous epoch's iterator is destroyed -------------------------
#
# `fit` drops the last reference to an epoch's iterator on the host thread
# when it rebinds its `iterator` at the next epoch's first step, and with
# tf.data autotuning on that destructor can sleep for up to a minute, while
# under MultiWorkerMirroredStrategy every other worker waits for this one in
# the next collective. It is a lost wakeup in TensorFlow (2.21): the root
# iterator's destructor cancels its autotuning thread (`Model::OptimizeLoop`),
# whose cancellation callback notifies that thread while
# `CancellationManager::IsCancelled()` is still false (it turns true only
# after every callback has run); a thread that wakes in that window sleeps
# again until its next optimization (the period doubles up to 60 s), and the
# destructor joins it (`LogicalThreadWrapper::~LogicalThreadWrapper`). The
# pipeline is torn down by then: the long part is a sleep that holds no CPU
# and nothing a step uses.
#
# So, inside `fit` and `evaluate` (`releasing_iterators`, installed by
# `keras_comm.compat`), each step function holds the iterator it was last
# called with; once a new iterator's first call has returned, the previous
# one is dropped on a release thread. When the call returns or raises (in a
# `finally`) the iterators still held are handed to release threads too, and
# the call returns without waiting for them: a sleeping destructor there would
# hold the end of every `fit` and `evaluate` on the workers it hit (~10 s on 3
# of 4 ranks of a KerasHub fit) while the others wait in their next
# collective. Release threads are not daemons, so the interpreter joins them
# before its finalization (which would end a thread inside TensorFlow's C++
# destructor: SIGABRT); `keras-comm-run` joins them before its exit barrier,
# so no worker outlives its peers by a destructor's sleep (the chief hosts the
# coordination service, and exited peers that miss its heartbeats for 10 s
# abort it).
# Every used iterator is released this way, whatever its dataset's options
# say: with more than one device per worker the distributed iterator reads
# through a `MultiDeviceIterator`, whose per-device pipelines (a generator
# and a prefetch that tf.data builds with default options) autotune even
# when the user's dataset turns autotuning off, and their destructors sleep
# the same way.
# Outside a scope (`train_on_batch`, a step function called directly) nothing
# is held.

#: Name of the threads that drop released iterators (keras_comm_run's
#: bootstrap joins threads of this name before its exit barrier).
RELEASE_THREAD_NAME = "keras_comm_iterator_release"

_scopes = threading.local()


class _ReleaseScope:
    """The iterators held during one `fit`/`evaluate`."""

    def __init__(self):
        self.held = {}  # step function's key -> [its latest iterator]

    def swap(self, key, iterator):
        """Holds `iterator` for `key`; returns a box with the iterator it replaces.

        Returns None when `iterator` is the one already held.
        """
        box = self.held.get(key)
        if box is not None and box[0] is iterator:
            return None
        self.held[key] = [iterator]
        return box if box is not None else []

    def release(self, box):
        """Drops the reference in `box` where its destructor cannot stall a step."""
        if not box:
            return
        threading.Thread(
            target=_drop, args=(box,), name=RELEASE_THREAD_NAME, daemon=False
        ).start()

    def close(self):
        """Releases what is still held, without waiting for the releases."""
        held, self.held = list(self.held.values()), {}
        while held:
            self.release(held.pop())


def _drop(box):
    try:
        del box[:]  # the last reference: the destructor runs on this thread
    except Exception:  # noqa: BLE001  (a failing destructor has nowhere to go)
        pass


def releasing_iterators(method):
    """Wraps `fit`/`evaluate` so that no iterator's destructor runs on their thread.

    Args:
        method: upstream's `TensorFlowTrainer.fit` or `.evaluate`.

    Returns:
        The method, run inside its own release scope (see above); nested calls
        (`fit`'s validation `evaluate`) get their own scope.
    """

    @functools.wraps(method)
    def run_in_release_scope(self, *args, **kwargs):
        outer = getattr(_scopes, "current", None)
        scope = _scopes.current = _ReleaseScope()
        try:
            return method(self, *args, **kwargs)
        finally:
            _scopes.current = outer
            scope.close()

    run_in_release_scope._keras_comm_releasing = True
    return run_in_release_scope


def pending_releases():
    """The release threads still running, of every scope."""
    return [t for t in threading.enumerate() if t.name == RELEASE_THREAD_NAME]


def _releasing_previous_iterator(function):
    """`function(iterator)`, holding its latest iterator inside a release scope."""
    key = object()

    @functools.wraps(function)
    def holding(iterator):
        scope = getattr(_scopes, "current", None)
        if scope is None:
            return function(iterator)
        previous = scope.swap(key, iterator)
        if not previous:
            return function(iterator)
        try:
            return function(iterator)
        finally:
            # After the new iterator's first call (never beside the first
            # pull, which starts its pipeline), whether the call returned,
            # met the end of data or failed: the previous one is not used again.
            scope.release(previous)

    return holding


def compile_replica_call(strategy, replica_fn, what):
    """A compiled ``strategy.run(replica_fn)`` with no input, as a host call.

    For steps that take no batch (a `ParallelOptimizer` flush, its slot
    gather and reshard). Like `make_function`'s steps, each call runs under
    the watchdog and raises translated collective errors.

    Args:
        strategy: the model's strategy.
        replica_fn: ``fn()`` run per replica.
        what: how a timeout names the call.
    """
    fn = tf.function(lambda: strategy.run(replica_fn))
    site = watchdog.Site(what)

    def call():
        with errors.collective_errors(), watchdog.guard(site):
            return fn()

    return call


def _unknown_if_empty(value):
    """Hides a batch dimension that is statically 0.

    A worker whose shard of the final global batch is empty gets a batch whose
    static shape is (0, ...). Keras's loss reduction returns a loss of static
    shape (0,) unreduced, which then cannot be added to the scalar losses
    ("Shapes must be equal rank"). With the batch size unknown at trace time,
    the usual reduction runs and the empty batch contributes zero.
    """
    if (
        isinstance(value, tf.Tensor)
        and not tf.executing_eagerly()
        and value.shape.rank
        and value.shape[0] == 0
    ):
        return tf.compat.v1.placeholder_with_default(
            value, [None] + value.shape[1:].as_list()
        )
    return value
