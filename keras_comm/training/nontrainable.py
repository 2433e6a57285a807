"""Replicas agree on non-trainable state: the mean over replicas, once per step.

Keras 3 creates the non-trainable state its layers update in `fit`
(`BatchNormalization`'s moving mean and variance, a user layer's running
average) with ``aggregation="none"``: under a multi-replica strategy each
replica's update changes only its own copy, so the replicas drift apart --
`evaluate` and `predict` then differ by worker, and the chief's
checkpoint keeps only its own statistics. tf-keras created the moving
statistics per replica (``synchronization=ON_READ``, MEAN aggregation): each
replica updated its own copy, and a read outside the replicas (saving,
`get_weights`) returned their mean.

Here the step averages that state once, after the update and before the
metrics (step 3.5 of the `keras_comm.training` contract): one packed
all-reduce of every such variable per step (none at all when the model has
none). With identical values at the step's start -- which this sync keeps --
and an update linear in the replica's data with replica-independent
coefficients, the mean of the updated values is the update with the mean
batch statistic, i.e. the mean tf-keras reads, up to round-off:
BatchNormalization's ``moving = m * moving + (1 - m) * batch_stat`` is such
an update, also when a shared layer updates it several times per step.
For an update that is not linear (``moving = max(moving, x)``, two
data-dependent updates composed non-linearly) the mean of the step's final
values is still identical on every replica, but not the mean of the
replicas' own trajectories: declare such a variable with
``aggregation="mean"`` and TensorFlow averages each write (one collective
per write).

Which variables (`agreement_rule`): the model's non-trainable variables with
``aggregation="none"`` whose floating dtype has a mean, that are distributed
(one copy per replica) and written on update (not ``synchronization=
"on_read"``). Left alone, each for a reason:

* ``aggregation`` "mean", "sum" or "only_first_replica": TensorFlow already
  aggregates each write in replica context, so they never drift. (Keras's
  ``assign_add(d)`` is ``assign(v + d)``, which "sum" then sums over the
  replicas, old value included: a global count is better kept as
  ``synchronization="on_read", aggregation="sum"``, as metrics are.)
* ``synchronization="on_read"``: per replica by design (keras_comm's
  per-replica gradient accumulators and step counters in
  `keras_comm.layers`, metric state).
* Integer and boolean state: it has no mean. Keras's own integer state, the
  `SeedGenerator` states of `Dropout` and other random layers, advances by the
  same increment on every replica, so it stays identical without any sync;
  an integer that replicas update differently (a sample count) should be
  per replica, summed on read (above).
* Sharded weights of `keras_comm.parallel` (each replica holds a different
  shard) and variables marked with `keep_per_replica`.
* `keras.layers.Normalization`'s adapted mean and variance: `fit` never
  writes them, and the layer computes with constants it froze when `adapt`
  finished, so averaging the variables would only make them disagree with
  what the layer computes (and with what a checkpoint restores). A model
  adapted on each worker's own shard makes its workers agree once, before
  `fit`, with `agree_adapted` (the statistics of the union of the shards).

`keras_comm.callbacks.ParallelOptimizer`'s state (masters, accumulators,
optimizer-slot shards) is not model state: plain per-device variables,
never seen here. Optimizer variables (slots, ``use_ema=True`` averages,
iterations) are updated from the all-reduced gradient in cross-replica
context and so are identical on every replica already.

A model that overrides `train_step` gets no sync unless its step calls
`sync(model)` (in replica context, after its update).
"""

import keras
import tensorflow as tf

from keras_comm._private import keras_api
from keras_comm._private import tf_api
from keras_comm.variables import annotations
from keras_comm.variables import packing
from keras_comm.variables.annotations import PER_REPLICA_ATTR  # noqa: F401
from keras_comm.variables.annotations import is_kept_per_replica
from keras_comm.variables.annotations import keep_per_replica  # noqa: F401

__all__ = [
    "agree_adapted",
    "agreement_rule",
    "is_kept_per_replica",
    "keep_per_replica",
    "sync",
    "variables_to_agree",
]

# Strategies whose replicas each hold a copy of a mirrored variable and run
# keras_comm's train step: the multi-worker one (also in-process, over local
# devices) and the single-process MirroredStrategy.
_STRATEGIES = (tf.distribute.MultiWorkerMirroredStrategy, tf.distribute.MirroredStrategy)


def agreement_rule(variable):
    """How the per-step sync treats `variable`: "mean", or None (left alone).

    Pure: reads only the variable's declaration (dtype, aggregation,
    synchronization, whether it is distributed, marks). See the module
    docstring for the reason behind each None.
    """
    if getattr(variable, "trainable", False):
        return None
    if is_kept_per_replica(variable):
        return None
    tf_var = keras_api.tf_variable(variable)
    if not isinstance(tf_var, tf.distribute.DistributedValues):
        return None  # one copy shared by every replica: nothing to agree on
    if _aggregation(variable) != "none":
        return None  # TensorFlow aggregates each write
    if _synchronization(variable) == "on_read":
        return None  # per replica by design
    if not tf.as_dtype(variable.dtype).is_floating:
        return None  # no mean; Keras's integer state advances identically
    if annotations.is_sharded(variable):
        return None
    return "mean"


def _layers(model):
    """`model` and every layer reachable through `.layers` (nested models)."""
    stack, out = [model], []
    while stack:
        layer = stack.pop()
        if any(layer is o for o in out):
            continue
        out.append(layer)
        stack.extend(getattr(layer, "layers", None) or [])
    return out


def _adapted(model):
    """The model's `keras.layers.Normalization` layers that hold adapt variables."""
    return [
        layer
        for layer in _layers(model)
        if isinstance(layer, keras.layers.Normalization) and getattr(layer, "adapt_mean", None) is not None
    ]


def variables_to_agree(model):
    """The model's variables that `sync` averages, in a fixed order."""
    # Normalization's adapted statistics: not written by fit (module docstring).
    seen = {
        id(keras_api.tf_variable(v))
        for layer in _adapted(model)
        for v in (layer.adapt_mean, layer.adapt_variance)
    }
    out = []
    for v in model.non_trainable_variables:
        key = id(keras_api.tf_variable(v))
        if key in seen:
            continue
        seen.add(key)
        if agreement_rule(v) == "mean":
            out.append(v)
    return out


# The packed all-reduce's layout (kept under these names for callers).
pack = packing.concat_flat
unpack = packing.split_flat


def pack_dtype(dtypes):
    """The float dtype the mean is computed in: the widest, at least float32."""
    widest = tf.float32
    for d in dtypes:
        d = tf.as_dtype(d)
        if d.is_floating and d.size > widest.size:
            widest = d
    return widest


def sync(model, after=()):
    """Replica context: sets each of `variables_to_agree(model)` to its mean over replicas.

    One all-reduce of all of them, packed, per call; nothing (no collective)
    when there are none or the strategy has a single replica. Every replica
    writes the same value into its own copy (no merge_call).

    The all-reduce starts only after the step's update: after every write to
    the model's trainable variables and after the tensors in `after`. Left
    unordered, it could start before the update's own collectives on one
    replica and after them on another, and in-process replicas then wait on
    each other's collectives (a step taking seconds instead of milliseconds).

    Args:
        model: the Keras model whose step this is.
        after: tensors (None skipped) the sync must follow, e.g. a
            reduce-scattered gradient of a step that writes no weight.
    """
    context = tf.distribute.get_replica_context()
    if context is None:
        return
    strategy = context.strategy
    num_replicas = strategy.num_replicas_in_sync
    if num_replicas < 2 or not isinstance(strategy, _STRATEGIES):
        return
    variables = variables_to_agree(model)
    if not variables:
        return
    locals_ = [tf_api.local_component(keras_api.tf_variable(v)) for v in variables]
    dtype = pack_dtype([v.dtype for v in locals_])
    # Reading a variable follows its writes (automatic control dependencies).
    updated = [
        tf_api.local_component(keras_api.tf_variable(v)).read_value()
        for v in model.trainable_variables
    ]
    updated += [t for t in tf.nest.flatten(after) if t is not None]
    with tf.control_dependencies(updated):
        flat, sizes = packing.concat_flat([v.read_value() for v in locals_], dtype)
    total = context.all_reduce(tf.distribute.ReduceOp.SUM, flat)
    mean = total / tf.cast(num_replicas, dtype)
    values = packing.split_flat(mean, sizes, [v.shape for v in locals_], [v.dtype for v in locals_])
    for local, value in zip(locals_, values):
        local.assign(value)


def agree_adapted(model):
    """Outside the replicas, before `fit`: pools the adapted statistics of
    every `keras.layers.Normalization` in `model` over the replicas.

    For a model whose workers each called ``adapt`` on their own shard of the
    data: every replica's mean and variance become those of the union of the
    shards, as if each had adapted on all of it, and the layer recomputes the
    constants it normalizes with (``finalize_state``). With equal shards this
    is exact: ``mean = mean_r(m_r)`` and ``variance = mean_r(v_r + (m_r -
    mean)^2)`` (within-shard plus between-shard variance); with unequal shards
    each replica counts equally. Two all-reduces of all the layers' statistics,
    packed; nothing for a model with no adapted Normalization layer or a
    single replica.

    Args:
        model: a Keras model built under a multi-replica strategy's scope
            (MultiWorkerMirroredStrategy or MirroredStrategy).

    Returns:
        The list of Normalization layers pooled.

    Raises:
        ValueError: called inside a replica (e.g. in a train step).
    """
    if tf.distribute.in_cross_replica_context() is False and tf.distribute.has_strategy():
        raise ValueError(
            "`agree_adapted` runs outside the replicas (before `fit`), not inside "
            "a replica's step. Received: a call in replica context"
        )
    layers = _adapted(model)
    variables = [v for layer in layers for v in (layer.adapt_mean, layer.adapt_variance)]
    distributed = [
        keras_api.tf_variable(v)
        for v in variables
        if isinstance(keras_api.tf_variable(v), tf.distribute.DistributedValues)
    ]
    if not distributed:
        return []
    strategy = distributed[0].distribute_strategy
    if strategy.num_replicas_in_sync < 2 or not isinstance(strategy, _STRATEGIES):
        return []
    pairs = [
        (keras_api.tf_variable(layer.adapt_mean), keras_api.tf_variable(layer.adapt_variance))
        for layer in layers
    ]

    def pool():
        context = tf.distribute.get_replica_context()
        n = tf.constant(float(context.num_replicas_in_sync), tf.float64)
        means = [tf_api.local_component(m) for m, _ in pairs]
        variances = [tf_api.local_component(v) for _, v in pairs]
        flat, sizes = packing.concat_flat([m.read_value() for m in means], tf.float64)
        mean = context.all_reduce(tf.distribute.ReduceOp.SUM, flat) / n
        spread = packing.concat_flat([v.read_value() for v in variances], tf.float64)[0] + tf.square(flat - mean)
        variance = context.all_reduce(tf.distribute.ReduceOp.SUM, spread) / n
        shapes = [m.shape for m in means]
        dtypes = [m.dtype for m in means]
        for local, value in zip(means, packing.split_flat(mean, sizes, shapes, dtypes)):
            local.assign(value)
        for local, value in zip(variances, packing.split_flat(variance, sizes, shapes, [v.dtype for v in variances])):
            local.assign(value)

    with strategy.scope():
        tf.function(lambda: strategy.run(pool))()
    for layer in layers:
        layer.finalize_state()
    return layers


def _aggregation(variable):
    # A Keras variable states it as a string; a tf.Variable as an enum.
    if isinstance(variable, keras.Variable):
        return variable.aggregation
    agg = getattr(variable, "aggregation", tf.VariableAggregation.NONE)
    return {
        tf.VariableAggregation.NONE: "none",
        tf.VariableAggregation.SUM: "sum",
        tf.VariableAggregation.MEAN: "mean",
        tf.VariableAggregation.ONLY_FIRST_REPLICA: "only_first_replica",
    }.get(agg, "none")


def _synchronization(variable):
    if isinstance(variable, keras.Variable):
        return variable.synchronization
    sync_ = getattr(variable, "synchronization", tf.VariableSynchronization.AUTO)
    return "on_read" if sync_ == tf.VariableSynchronization.ON_READ else "on_write"
