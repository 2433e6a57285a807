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
        return keras_api.trainer_method("_make_function")(model, replica_step)

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
    # at every call, and the eager ops of `get_next_as_optional` one by one
    # (issue 18). Compiled, the same agreement is one graph collective. The
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

    return function


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
