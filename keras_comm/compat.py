"""Makes Keras 3 `fit`, `evaluate` and `predict` exact under MultiWorkerMirroredStrategy.

Stock Keras 3 (TensorFlow backend) cannot train under
`tf.distribute.MultiWorkerMirroredStrategy` (keras-team/keras#20585, #20329,
tensorflow/tensorflow#72388), and where it runs it is not exact:

1. `TensorFlowTrainer._maybe_symbolic_build` builds the model from a batch it
   pulls out of the distributed iterator and passes the nest of `PerReplica`
   values to `strategy.reduce`, which fails ("Attempt to convert a value
   (PerReplica...)"). Pulling a batch also consumes a step's worth of input
   when the iterator is kept across epochs.
   Replacement: build from the distributed dataset's `element_spec` (shapes and
   dtypes only: no data consumed, nothing communicated).
2. `TensorFlowTrainer._make_function` reduces step outputs with
   `reduce_per_replica`, which under MWMS uses `axis=0` and fails on scalar
   metrics ("Invalid reduction dimension 0"); a mean of per-replica metric
   results would anyway be wrong when replicas hold different numbers of
   samples (the final partial batch) or sample weights. Its
   `steps_per_execution > 1` loop fails under any multi-replica strategy.
   Replacement under MWMS: the step's metric logs are each metric's result
   over its state summed across all replicas (one packed all-reduce per step),
   exact and identical on every worker; `steps_per_execution` runs as a host
   loop of single steps. Other strategies get upstream's function.
3. `TensorFlowTrainer.train_step` averages the loss per replica and sums the
   replicas' gradients scaled by 1/num_replicas: a mean of per-replica means,
   which is the mean over the global batch only when every replica holds as
   many samples as the others. Replacement: the same step, with the loss
   scaled by `num_replicas * local_batch / global_batch` (one scalar
   all-reduce), which is exactly 1 for equal shards and makes the final
   partial batch exact too.

4. `TFOptimizer._all_reduce_sum_gradients` is wrapped so that a variable may
   carry its own gradient reduction (sharded weights of `keras_comm.parallel`
   reduce over their data-parallel group, not the world); other variables are
   reduced exactly as upstream. `mark_gradient_reduced(v)` gives `v` the
   identity reduction: for a weight whose gradient a comm layer (e.g.
   `MirrorOperator`) already summed, so that no gradient is reduced twice.

`train_step_gradients(model, data)` is the default step's per-replica
gradients and logs without the update, for `keras_comm.callbacks`.

`predict` is left to Keras: under MultiWorkerMirroredStrategy every worker
passes the same (global) input, the input is sharded across workers, and
`predict` all-gathers the outputs in input order, so each worker returns the
full predictions for the whole input, identical on all workers.

Scope and limits:

- Applied on `import keras_comm`; `apply()` is idempotent and `revert()` restores
  stock Keras. Only Keras `>=3.10,<3.16` with the TensorFlow backend is patched:
  elsewhere `apply()` changes nothing and returns False, because the replaced
  code is private Keras code that may differ. `tests/test_compat.py` records a
  hash of each replaced function per Keras version and fails when it changes.
- The exact-loss scaling lives in the default `train_step`; a model that
  overrides `train_step` keeps its own loss scaling. The loss normalisation
  made exact is Keras's default `"sum_over_batch_size"` (mean over samples);
  `"mean_with_sample_weight"` losses are combined by sample counts.
- Only `MultiWorkerMirroredStrategy` (also its in-process form with several
  local devices) is changed; other strategies run stock Keras code paths.
- Per-output loss metrics of multi-output models ("<output>_loss") are
  averaged by Keras per step, not per sample (their update uses the static
  batch size, unknown when traced), single-process too; under MWMS they are
  averaged per replica-step, so they can differ on a partial final batch.
- `run_eagerly=True` is not covered: an empty shard keeps its static size 0
  there.
- NumPy inputs are shuffled by Keras on each worker; unless every worker sets
  the same seed (`keras.utils.set_random_seed`) or passes `shuffle=False`, the
  workers' permutations differ and a global batch is not a slice of one
  permutation.
"""

import keras
import tensorflow as tf

from keras_comm import watchdog
from keras_comm.ops._fusion import fusion_scope

__all__ = [
    "apply",
    "is_applied",
    "mark_gradient_reduced",
    "revert",
    "train_step_gradients",
    "SUPPORTED_KERAS",
]

#: Keras versions whose trainer code this module was written against
#: (lower bound inclusive, upper bound exclusive), as (major, minor).
SUPPORTED_KERAS = ((3, 10), (3, 16))

# Names of the replaced attributes, per owner. Originals are stored on the
# patched module itself (not here) so that re-importing or reloading this
# module cannot mistake a patched function for an original one.
_METHODS = ("_maybe_symbolic_build", "_make_function", "train_step")
_ORIGINALS_ATTR = "_keras_comm_compat_originals"


def _keras_version():
    parts = keras.version().split(".")
    return int(parts[0]), int("".join(c for c in parts[1] if c.isdigit()) or 0)


def _supported():
    low, high = SUPPORTED_KERAS
    return (
        keras.backend.backend() == "tensorflow"
        and low <= _keras_version() < high
    )


def _trainer_module():
    from keras.src.backend.tensorflow import trainer

    return trainer


def is_applied():
    """Returns whether the Keras trainer currently carries this module's fix."""
    if not _supported():
        return False
    return hasattr(_trainer_module(), _ORIGINALS_ATTR)


def apply():
    """Patches the Keras TensorFlow trainer for MultiWorkerMirroredStrategy.

    Safe to call any number of times: a second call finds the patch in place
    and does nothing.

    Returns:
        True if the fix is in place after the call; False if the installed
        Keras version or backend is outside `SUPPORTED_KERAS` / TensorFlow,
        in which case nothing was changed.
    """
    if not _supported():
        return False
    module = _trainer_module()
    if hasattr(module, _ORIGINALS_ATTR):
        return True
    cls = module.TensorFlowTrainer
    replacements = {
        "_maybe_symbolic_build": _maybe_symbolic_build,
        "_make_function": _make_function,
        "train_step": _train_step,
    }
    setattr(module, _ORIGINALS_ATTR, {name: cls.__dict__[name] for name in _METHODS})
    for name in _METHODS:
        setattr(cls, name, replacements[name])
    _apply_gradient_hook()
    return True


def revert():
    """Restores stock Keras; a no-op when the fix is not applied.

    Functions already traced by a model keep the code they were traced with:
    revert before building step functions (e.g. before the first `fit`).
    """
    if not _supported():
        return
    module = _trainer_module()
    originals = getattr(module, _ORIGINALS_ATTR, None)
    if originals is None:
        return
    cls = module.TensorFlowTrainer
    for name in _METHODS:
        setattr(cls, name, originals[name])
    delattr(module, _ORIGINALS_ATTR)
    _revert_gradient_hook()


def _original(name):
    return getattr(_trainer_module(), _ORIGINALS_ATTR)[name]


def _is_mwms(strategy, min_replicas=2):
    # Covers the multi-worker form and the in-process form built from several
    # local devices; MirroredStrategy and TPUStrategy keep stock behaviour.
    # With a single replica the step code has nothing to combine.
    return (
        isinstance(strategy, tf.distribute.MultiWorkerMirroredStrategy)
        and strategy.num_replicas_in_sync >= min_replicas
    )


# --- 1. Build from the dataset's element spec --------------------------------


def _local_spec(spec):
    # Every replica receives the same structure; one replica's spec describes
    # the inputs the model will be called on.
    value_specs = getattr(spec, "_value_specs", None)
    if isinstance(spec, tf.TypeSpec) and value_specs is not None:
        return value_specs[0]
    return spec


def _maybe_symbolic_build(self, iterator=None, data_batch=None):
    """Replaces `TensorFlowTrainer._maybe_symbolic_build`.

    Upstream pulls a batch from `iterator` and `strategy.reduce`s it; here the
    symbolic build only needs shapes and dtypes, which the distributed
    dataset's `element_spec` gives without consuming or communicating data.
    """
    # A single-replica MWMS hands out PerReplica batches too, so it needs
    # this as much as a cluster does.
    if not _is_mwms(self._distribute_strategy, min_replicas=1):
        return _original("_maybe_symbolic_build")(self, iterator, data_batch)
    if iterator is not None and data_batch is None:
        element_spec = iterator._get_iterator().element_spec
        data_batch = tf.nest.map_structure(
            _local_spec, element_spec, expand_composites=False
        )
    with self.distribute_strategy.scope():
        self._symbolic_build(data_batch=data_batch)


# --- 2. Step functions with exact, identical logs on every worker ---------


def _make_function(self, step_function):
    """Replaces `TensorFlowTrainer._make_function` under MWMS (others: upstream).

    Differences from upstream, each needed under MultiWorkerMirroredStrategy:

    - Step logs that are the model's metrics (the key test Keras applies in
      `_get_metrics_result_or_logs`) are computed from the metrics' state
      summed over all replicas: the exact global value, identical on every
      worker. Upstream's `reduce_per_replica` reduces them with `axis=0`,
      which fails on scalars, and a mean of per-replica results would weight
      replicas equally whatever their sample counts.
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
    """
    strategy = self.distribute_strategy
    if not _is_mwms(strategy):
        return _original("_make_function")(self, step_function)

    def step_on_replica(data):
        return step_function(tf.nest.map_structure(_unknown_if_empty, data))

    @tf.autograph.experimental.do_not_convert
    def one_step_on_data(data):
        # One fusion scope per step: all-reduces and mirrors sharing a
        # `fusion` id are packed (see keras_comm.ops.fusion_scope).
        with fusion_scope():
            outputs = strategy.run(step_on_replica, args=(data,))
        outputs = _reduce_step_outputs(self, strategy, outputs)
        if not self.run_eagerly:
            watchdog.restart()  # tracing ends here: the step's clock starts
        return outputs

    if not self.run_eagerly:
        one_step_on_data = tf.function(
            one_step_on_data,
            reduce_retracing=True,
            jit_compile=self.jit_compile,
        )
    # Keras >= 3.12 passes tf.experimental.Optional inputs to steps as None.
    autoconvert_optionals = getattr(self, "_autoconvert_optionals", None)
    if autoconvert_optionals is not None:
        one_step_on_data = autoconvert_optionals(one_step_on_data)

    # Each step runs under the process watchdog, which enforces keras_comm's
    # timeout without TensorFlow's per-op timeout threads (keras_comm.watchdog).
    name = getattr(step_function, "__name__", "step").lstrip("_")
    site = watchdog.Site(f"the model's {name}")

    def function(iterator):
        outputs = None
        for _ in range(self.steps_per_execution):
            with watchdog.guard(site):
                try:
                    # Under MWMS the distributed iterator agrees across workers
                    # on the end of data: a worker with no samples left gets an
                    # empty batch until every worker is out, so all run the
                    # same steps.
                    data = next(iterator)
                except (StopIteration, tf.errors.OutOfRangeError):
                    break
                outputs = one_step_on_data(data)
        if outputs is None:
            raise StopIteration
        return outputs

    return function


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


def _replica_contribution(variable, replica_id, num_replicas):
    # What a replica adds to the all-reduce SUM so that the sum is the value
    # TensorFlow would read in cross-replica context for this aggregation.
    value = tf.cast(tf.reshape(variable.value, [-1]), tf.float64)
    if variable.aggregation == "sum":
        return value
    if variable.aggregation == "mean":
        return value / num_replicas
    # "only_first_replica" and "none": the first replica's value.
    return tf.where(tf.equal(replica_id, 0), value, tf.zeros_like(value))


def _global_metric_state(variables, strategy):
    """All replicas' metric state, summed: one packed all-reduce in float64.

    float64 keeps integer-valued counters exact and rounding negligible
    whatever order the ring adds the pieces in.
    """

    def local_state():
        context = tf.distribute.get_replica_context()
        replica_id = tf.cast(context.replica_id_in_sync_group, tf.int32)
        packed = tf.concat(
            [
                _replica_contribution(v, replica_id, strategy.num_replicas_in_sync)
                for v in variables
            ],
            axis=0,
        )
        return context.all_reduce(tf.distribute.ReduceOp.SUM, packed)

    packed = strategy.experimental_local_results(strategy.run(local_state))[0]
    sizes = [int(v.value.shape.num_elements()) for v in variables]
    return [
        tf.cast(tf.reshape(piece, v.value.shape), v.dtype)
        for piece, v in zip(tf.split(packed, sizes), variables)
    ]


def _metrics_result(model, state_for):
    # Mirrors `Trainer.get_metrics_result`, reading each metric from the given
    # state instead of its variables.
    results = {}
    for metric in model.metrics:
        result = metric.stateless_result(state_for(metric))
        if isinstance(result, dict):
            results.update(result)
        else:
            results[metric.name] = result
    return results


def _is_model_metrics_logs(model, outputs):
    # Evaluated on zeros in a stateless scope: reads no synchronised variable,
    # so it adds no collective to the step.
    if not isinstance(outputs, dict):
        return False
    keys = _metrics_result(
        model,
        lambda m: [tf.zeros(v.value.shape, v.dtype) for v in m.variables],
    ).keys()
    return set(keys) == set(outputs.keys())


def _reduce_step_outputs(model, strategy, outputs):
    """Exact global metrics for metric logs; a mean over replicas otherwise."""
    if _is_model_metrics_logs(model, outputs):
        variables = [v for m in model.metrics for v in m.variables]
        if not variables:
            return _metrics_result(model, lambda m: [])
        state = dict(
            zip(
                (id(v) for v in variables),
                _global_metric_state(variables, strategy),
            )
        )
        return _metrics_result(
            model, lambda m: [state[id(v)] for v in m.variables]
        )
    # A custom `train_step`'s outputs: upstream's "auto" reduction (a mean over
    # replicas), with `axis=None` so scalars work.
    return tf.nest.map_structure(
        lambda v: strategy.reduce(tf.distribute.ReduceOp.MEAN, v, axis=None),
        outputs,
    )


# --- 3. Exact loss and gradient over the global batch -------------------------


def _global_batch_weight(local_batch_size, dtype):
    """`num_replicas * local / global` batch size, as a loss multiplier.

    Keras scales each replica's mean loss by 1/num_replicas; multiplying by
    this turns that into the replica's share of the mean over the global
    batch. Exactly 1.0 when all replicas hold equally many samples.
    """
    strategy = tf.distribute.get_strategy()
    if not _is_mwms(strategy):
        return None
    local = tf.cast(local_batch_size, tf.float32)
    total = tf.distribute.get_replica_context().all_reduce(
        tf.distribute.ReduceOp.SUM, local
    )
    weight = tf.math.divide_no_nan(
        local * float(strategy.num_replicas_in_sync), total
    )
    return tf.cast(weight, dtype)


def train_step_gradients(model, data):
    """This replica's gradients and metric logs for one batch: the default
    `train_step` without the update.

    For code that applies gradients itself (`keras_comm.callbacks`): the loss
    carries the global-batch weight (see `_global_batch_weight`) and the
    optimizer's loss scale, so summing the returned gradients over replicas
    gives what stock Keras would apply (before unscaling). Nothing is reduced
    here.

    Args:
        model: a compiled Keras model (TensorFlow backend).
        data: one batch as `fit` passes it to `train_step`.

    Returns:
        ``(grads, logs)``: one gradient (or None) per
        `model.trainable_weights`, and `model.compute_metrics`'s logs.
    """
    # Imported here: private Keras modules, resolved once the version guard
    # has accepted this Keras.
    from keras.src.trainers.data_adapters import data_adapter_utils

    x, y, sample_weight = data_adapter_utils.unpack_x_y_sample_weight(data)
    # The step's fusion groups are packed when the scope closes, before the
    # gradients are used (see keras_comm.ops.fusion_scope).
    with fusion_scope():
        return _gradients_and_logs(model, x, y, sample_weight)


def _gradients_and_logs(model, x, y, sample_weight):
    from keras.src import tree
    from keras.src.losses import loss as loss_module

    # Forward pass
    with tf.GradientTape() as tape:
        if model._call_has_training_arg:
            y_pred = model(x, training=True)
        else:
            y_pred = model(x)
        loss = model._compute_loss(
            x=x,
            y=y,
            y_pred=y_pred,
            sample_weight=sample_weight,
            training=True,
        )
        batch_size = tf.shape(
            next(i for i in tree.flatten(x) if i is not None)
        )[0]
        model._loss_tracker.update_state(
            loss_module.unscale_loss_for_distribution(loss),
            sample_weight=batch_size,
        )
        weight = _global_batch_weight(batch_size, loss.dtype)
        if weight is not None:
            loss = loss * weight
        if model.optimizer is not None:
            loss = model.optimizer.scale_loss(loss)

    grads = []
    if model.trainable_weights:
        grads = tape.gradient(loss, model.trainable_weights)
    logs = model.compute_metrics(x, y, y_pred, sample_weight=sample_weight)
    return grads, logs


def _train_step(self, data):
    """Replaces `TensorFlowTrainer.train_step`: upstream's step, plus the
    global-batch loss weight before the gradient (see `_global_batch_weight`).
    """
    grads, logs = train_step_gradients(self, data)
    if self.trainable_weights:
        self.optimizer.apply_gradients(zip(grads, self.trainable_weights))
    else:
        import warnings

        # Upstream's warning, kept so behaviour matches stock Keras.
        warnings.warn("The model does not have any trainable weights.")
    return logs


# --- 4. Per-variable gradient reduction (sharded weights) -------------------
#
# `TFOptimizer._all_reduce_sum_gradients` sums every gradient over all
# replicas. A per-replica (sharded) weight from `keras_comm.parallel` must be
# reduced only over the replicas holding the same shard, so a variable may
# carry `_keras_comm_reduce_gradient(grad) -> grad`, called in replica context
# instead of the world all-reduce. Variables without it are reduced exactly as
# upstream (one batched all-reduce). Covered by tests/test_parallel_sharded.py.

_GRADIENT_HOOK_ATTR = "_keras_comm_reduce_gradient"
_OPTIMIZER_ORIGINAL_ATTR = "_keras_comm_compat_all_reduce_sum_gradients"


def mark_gradient_reduced(variable):
    """Marks `variable` as having its gradient reduced inside the model.

    The rule "every gradient is reduced exactly once": a comm layer whose
    backward already sums a weight's gradient over the replicas (e.g. a
    `MirrorOperator` on the weight's path, the reference's data-parallel
    mirror) makes a second, world-wide sum by the optimizer (or by
    `ParallelOptimizer`) count every replica's contribution N times. The
    layer cannot tell which variable a tensor came from, so the model marks
    the variable: its gradient then passes through unchanged, and the
    optimizer updates it with what the layer produced.

    Args:
        variable: a Keras variable (or tf.Variable).

    Returns:
        `variable`, marked.
    """
    setattr(_tf_variable(variable), _GRADIENT_HOOK_ATTR, _already_reduced)
    return variable


def gradient_hook(variable):
    """The reduction `variable` carries (see section 4), or None."""
    return getattr(_tf_variable(variable), _GRADIENT_HOOK_ATTR, None)


def _tf_variable(variable):
    # The hook lives on the tf.Variable, which is what TFOptimizer passes to
    # `_all_reduce_sum_gradients`.
    return variable._value if isinstance(variable, keras.Variable) else variable


def _already_reduced(grad):
    return grad


def _optimizer_class():
    from keras.src.backend.tensorflow.optimizer import TFOptimizer

    return TFOptimizer


def _all_reduce_sum_gradients(self, grads_and_vars):
    """Replaces `TFOptimizer._all_reduce_sum_gradients` (see section 4)."""
    original = getattr(_optimizer_class(), _OPTIMIZER_ORIGINAL_ATTR)
    grads_and_vars = list(grads_and_vars)
    hooks = [getattr(v, _GRADIENT_HOOK_ATTR, None) for _, v in grads_and_vars]
    if tf.distribute.get_replica_context() is None or not any(hooks):
        return original(self, grads_and_vars)
    plain = [gv for gv, h in zip(grads_and_vars, hooks) if h is None]
    reduced = iter(original(self, plain) if plain else [])
    return [
        (h(g), v) if h is not None else next(reduced)
        for (g, v), h in zip(grads_and_vars, hooks)
    ]


def _apply_gradient_hook():
    cls = _optimizer_class()
    if not hasattr(cls, _OPTIMIZER_ORIGINAL_ATTR):
        setattr(cls, _OPTIMIZER_ORIGINAL_ATTR, cls.__dict__["_all_reduce_sum_gradients"])
        cls._all_reduce_sum_gradients = _all_reduce_sum_gradients


def _revert_gradient_hook():
    cls = _optimizer_class()
    original = cls.__dict__.get(_OPTIMIZER_ORIGINAL_ATTR)
    if original is not None:
        cls._all_reduce_sum_gradients = original
        delattr(cls, _OPTIMIZER_ORIGINAL_ATTR)
