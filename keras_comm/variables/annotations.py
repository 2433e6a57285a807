"""Per-variable declarations: written by the layers, read by the training step.

A layer that owns a variable declares here what the rest of keras_comm must
know about it; the training step, the checkpoint code and the per-step sync
read the declarations back. Each declaration lives on the tf.Variable (what
an optimizer's gradient reduction receives) or in a registry keyed by the
variable's identity:

| declaration | written by | read by |
| --- | --- | --- |
| gradient hook (`set_gradient_hook`) | sharded weights, `mark_gradient_reduced` | the optimizer's gradient reduction, `ParallelOptimizer` |
| data group (`set_data_group`) | `Pipeline`'s stage buffer | `ParallelOptimizer` (ZeRO over the group) |
| kept per replica (`keep_per_replica`) | per-replica state | the per-step non-trainable sync |
| shard spec (`register_spec`, `register_deferred`) | sharded weights, `FullyShard`, `Pipeline` | checkpoints, `full_weights`, the sync |
| composite (`register_composite`) | `Pipeline`'s buffers | `full_weights`, `set_full_weights` |
| external slots (`register_external_slots`) | `ParallelOptimizer` | checkpoints of the optimizer |
"""

import weakref

from keras_comm._private import keras_api

__all__ = [
    "composite",
    "data_group",
    "deferred_shard",
    "external_slots",
    "gradient_hook",
    "is_kept_per_replica",
    "is_sharded",
    "keep_per_replica",
    "register_composite",
    "register_deferred",
    "register_external_slots",
    "register_spec",
    "set_data_group",
    "set_gradient_hook",
    "shard_spec",
]

#: Attribute of the tf.Variable holding its own gradient reduction.
GRADIENT_HOOK_ATTR = "_keras_comm_reduce_gradient"
#: Attribute of the tf.Variable holding its data group (see `set_data_group`).
DATA_GROUP_ATTR = "_keras_comm_data_group"
#: Attribute of the tf.Variable marking it as per-replica state (`keep_per_replica`).
PER_REPLICA_ATTR = "_keras_comm_per_replica"


class ByIdentity:
    """Values attached to live objects, keyed by identity.

    [Note: identity keys] Variables hash by identity only through `id()`,
    and an id is reused as soon as its object is gone: a plain
    ``{id(v): spec}`` would let a new variable created at a dead sharded
    one's address read as sharded. A weak reference kept beside each entry
    tells the two apart, and drops the entry with its object.
    """

    def __init__(self):
        self._entries = {}

    def __setitem__(self, obj, value):
        key = id(obj)

        def forget(ref, key=key):
            if self._entries.get(key, (None,))[0] is ref:
                del self._entries[key]

        self._entries[key] = (weakref.ref(obj, forget), value)

    def get(self, obj):
        entry = self._entries.get(id(obj))
        if entry is None or entry[0]() is not obj:
            return None
        return entry[1]


# --- Gradient hook -------------------------------------------------------------


def set_gradient_hook(variable, reduce):
    """Makes `reduce(grad) -> grad` the gradient reduction of `variable`.

    The hook lives on the tf.Variable, which is what the optimizer's
    reduction receives. Every gradient is reduced exactly once: a hooked
    variable's gradient goes through its hook instead of the world-wide sum.
    """
    setattr(keras_api.tf_variable(variable), GRADIENT_HOOK_ATTR, reduce)


def gradient_hook(variable):
    """The reduction `variable` carries, or None (the world-wide sum)."""
    return getattr(keras_api.tf_variable(variable), GRADIENT_HOOK_ATTR, None)


# --- Data group ----------------------------------------------------------------


def set_data_group(variable, group_of):
    """Declares that `variable`'s gradient hook is one SUM over a group.

    `group_of(rank)` returns the `topology.Group` of replicas whose
    gradients the hook sums for replica `rank` (or None when the hook is
    not one such sum). `ParallelOptimizer` with zero_stage >= 1 then shards
    the variable's optimizer state over that group.
    """
    setattr(keras_api.tf_variable(variable), DATA_GROUP_ATTR, group_of)


def data_group(variable):
    """The `group_of` `variable` declared with `set_data_group`, or None."""
    return getattr(keras_api.tf_variable(variable), DATA_GROUP_ATTR, None)


# --- Kept per replica ----------------------------------------------------------


def keep_per_replica(variable):
    """Marks `variable` as state each replica keeps for itself.

    The per-step sync (`keras_comm.training.nontrainable.sync`) then leaves
    it alone, whatever its kind: for state that must differ between replicas
    (a per-replica buffer, a shard, a replica's own statistics kept on
    purpose).

    Args:
        variable: a Keras variable (or tf.Variable).

    Returns:
        `variable`, marked.
    """
    setattr(keras_api.tf_variable(variable), PER_REPLICA_ATTR, True)
    return variable


def is_kept_per_replica(variable):
    """Whether `variable` is marked with `keep_per_replica`."""
    # Not getattr: a distributed variable forwards unknown attributes to its
    # value, and reading an on-read one outside the replicas may fail.
    return bool(vars(keras_api.tf_variable(variable)).get(PER_REPLICA_ATTR, False))


# --- Shard specs ---------------------------------------------------------------

_specs = ByIdentity()
_deferred = ByIdentity()


def register_spec(variable, spec):
    """Declares `variable` per replica, split as `spec` says.

    `spec` is a `keras_comm.parallel.ShardSpec` (or a subclass): checkpoints
    save the variable and its optimizer slots gathered full-size and load
    each replica's slice, and the per-step sync leaves it alone.
    """
    _specs[keras_api.tf_variable(variable)] = spec


def register_deferred(variable, deferred):
    """Declares a Keras variable created without a value as a shard.

    `deferred` has a ``spec`` (the `ShardSpec`) and the initial value's
    recipe; the owner of the values (a `Pipeline`'s stage buffer) computes
    each replica's shard from it.
    """
    _deferred[variable] = deferred


def deferred_shard(variable):
    """What `register_deferred` recorded for `variable`, or None."""
    return _deferred.get(variable)


def shard_spec(variable):
    """The shard spec of `variable` (registered or deferred), or None."""
    spec = _specs.get(keras_api.tf_variable(variable))
    if spec is None:
        deferred = _deferred.get(variable)
        if deferred is not None:
            spec = deferred.spec
    return spec


def is_sharded(variable):
    """Whether `variable` holds a different shard on each replica."""
    return shard_spec(variable) is not None


# --- Composite weights ---------------------------------------------------------

# Weights that stand for several full weights: a `Pipeline`'s per-replica
# stage buffer is its stages' weights. id(tf.Variable) -> the owner, with
# `full_values()` / `set_full_values(values)` / `full_value_count()`.
_composites = {}


def register_composite(variable, owner):
    """Makes `full_weights` expand `variable` into ``owner.full_values()``."""
    _composites[id(keras_api.tf_variable(variable))] = owner


def composite(variable):
    """The owner registered with `register_composite`, or None."""
    return _composites.get(id(keras_api.tf_variable(variable)))


# --- External optimizer slots ---------------------------------------------------

# Per optimizer: the store that holds some of its variables elsewhere.
_external = weakref.WeakKeyDictionary()


def register_external_slots(optimizer, store):
    """Saves and loads the variables ``store.owns`` through `store` (None: stop).

    `store` has ``owns(variable)``, ``value(variable)`` (the full value, asked
    one variable at a time) and ``assign(variable, full_value)``.
    """
    if store is None:
        _external.pop(optimizer, None)
    else:
        _external[optimizer] = store


def external_slots(optimizer):
    """The store registered for `optimizer`, or None."""
    return _external.get(optimizer)
