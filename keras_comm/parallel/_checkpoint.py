"""Sharded weights in Keras files: full-size on disk, one shard in memory.

Keras writes a layer's state with `Layer.save_own_variables(store)` and an
optimizer's with `Optimizer.save_own_variables(store)`, one array per
variable; under MultiWorkerMirroredStrategy that array is the calling
worker's component. For a sharded weight (and the optimizer slots of one,
which the optimizer updates shard by shard) that is one shard only, so a
file written by one worker silently gives every worker that worker's shard
when loaded. Here every sharded variable is written as its FULL value and
read back as the loading replica's slice:

* **Save** gathers the shards over the weight's model group (a collective:
  every worker must save -- the chief to the real path, the others to a path
  of their own, as with any MultiWorkerMirroredStrategy checkpoint).
* **Load** is local: each replica cuts its own slice out of the full value.

So a file holds exactly what an unsplit model holds: the same model built
without a strategy (one shard per weight) loads it, and a cluster of another
size loads it as long as its group sizes divide the split dimensions. A
file holding one shard per weight is refused with an error rather than
loaded into every replica.

`ParallelLayer` calls `save_layer` / `load_layer`; `apply` installs the
optimizer side on Keras's TensorFlow optimizer (called by
`keras_comm.compat.apply`).

An optimizer whose slots live elsewhere (`ParallelOptimizer` keeps them as
1/N shards and releases the optimizer's own, see
`keras_comm.training.optimizer_shards`) registers an external store with
`keras_comm.variables.annotations.register_external_slots`: a save writes each variable it owns as its
``value(variable)`` (full size, asked one variable at a time) and a load
hands it ``assign(variable, full_value)``. The file is the same.
"""

import numpy as np
import tensorflow as tf

from keras_comm._private import keras_api
from keras_comm.parallel import sharded_weights
from keras_comm.variables import annotations

_ORIGINALS_ATTR = "_keras_comm_checkpoint_originals"
register_external_slots = annotations.register_external_slots


def _external_flags(optimizer):
    store = annotations.external_slots(optimizer)
    if store is None:
        return None, [False] * len(optimizer.variables)
    return store, [store.owns(v) for v in optimizer.variables]


def _gather(pairs):
    """Full numpy values of `pairs` ``[(variable, spec or None)]``.

    A collective over every replica when any variable is split: all workers
    must call it with the same variables, in the same order. One all-gather
    per dtype and shard grouping serves all of them (see
    `sharded_weights.gather_values`).
    """
    out = [None] * len(pairs)
    for i, value in _iter_gather(pairs):
        out[i] = value
    return out


def _iter_gather(pairs):
    """`_gather`, one ``(index, full value)`` at a time: a save writes each
    value and drops it before the next batch is gathered
    (`sharded_weights.iter_gather_values`)."""
    for i, value in sharded_weights.iter_gather_values(pairs, name="checkpoint_gather"):
        yield i, _to_full(pairs[i][1], value)


def _to_full(spec, value):
    # Flat shards (keras_comm.parallel.FullyShard) gather to the padded flat
    # vector; the file holds the unwrapped weight's shape.
    value = np.asarray(value)
    to_full = getattr(spec, "to_full", None)
    return value if to_full is None else to_full(value)


def _assign(variable, spec, value, owner_name):
    if spec is None:
        variable.assign(value)
        return
    value = np.asarray(value)
    if tuple(value.shape) != spec.full_shape:
        hint = ""
        if tuple(value.shape) == spec.shard_shape:
            hint = (
                " The file holds one shard (written per worker). Files hold "
                "full-size weights: save them again from the cluster that "
                "wrote them (every worker calling save) or assign the shards "
                "with `keras_comm.parallel.assign_process_shards`."
            )
        raise ValueError(
            f"{owner_name}: variable {variable.path!r} is split into "
            f"{spec.num_shards} shards of a full weight of shape "
            f"{spec.full_shape}, and a file must hold the full weight.{hint} "
            f"Received: value of shape {tuple(value.shape)}"
        )
    comps = sharded_weights.components(variable)
    strategy = sharded_weights.strategy_of([variable])
    with tf.init_scope(), strategy.scope():
        for rank, comp in zip(sharded_weights.local_ranks(len(comps), strategy), comps):
            comp.assign(tf.cast(spec.slice(value, spec.shard_index(rank)), comp.dtype))


def _layer_variables(layer):
    # Keras's order (Layer.save_own_variables).
    return keras_api.own_weights(layer)


def save_layer(layer, store):
    """`Layer.save_own_variables` for layers with sharded weights."""
    variables = _layer_variables(layer)
    pairs = [(v, sharded_weights.shard_spec(v)) for v in variables]
    for i, value in _iter_gather(pairs):
        store[str(i)] = value


def load_layer(layer, store):
    """`Layer.load_own_variables` for layers with sharded weights."""
    variables = _layer_variables(layer)
    if len(store.keys()) != len(variables):
        raise ValueError(
            f"Layer {layer.name!r} has {len(variables)} variables and the "
            "file must hold as many (was the file written by another "
            f"architecture, or the layer not built?). Received: "
            f"{len(store.keys())} saved variables"
        )
    for i, v in enumerate(variables):
        _assign(v, sharded_weights.shard_spec(v), store[str(i)], f"Layer {layer.name!r}")


def optimizer_slot_specs(optimizer):
    """``[spec or None]`` per `optimizer.variables`: slots of sharded weights.

    Keras names a slot after its weight (``add_variable_from_reference``:
    ``<weight path with _>_<slot>``) and gives it the weight's shape, so a
    slot of a sharded weight holds that weight's shard on each replica.
    """
    references = []
    for opt in (optimizer, getattr(optimizer, "inner_optimizer", None)):
        if opt is not None:
            references += keras_api.optimizer_references(opt)
    prefixes = [
        (v.path.replace("/", "_") + "_", sharded_weights.shard_spec(v))
        for v in references
        if sharded_weights.is_sharded(v)
    ]
    specs = []
    for variable in optimizer.variables:
        matches = [
            (len(prefix), spec)
            for prefix, spec in prefixes
            if variable.name.startswith(prefix) and tuple(variable.shape) == spec.shard_shape
        ]
        specs.append(max(matches, key=lambda m: m[0])[1] if matches else None)
    return specs


def _save_optimizer(self, store):
    specs = optimizer_slot_specs(self)
    external, owned = _external_flags(self)
    if not any(specs) and not any(owned):
        return _original("save_own_variables")(self, store)
    # Each value is written as it is gathered (in batches of
    # sharded_weights.GATHER_BYTES), an external one one variable at a time:
    # a save never holds the full optimizer state.
    indices = [i for i, own in enumerate(owned) if not own]
    pairs = [(self.variables[i], specs[i]) for i in indices]
    for j, value in _iter_gather(pairs):
        store[str(indices[j])] = value
    for i, (v, own) in enumerate(zip(self.variables, owned)):
        if own:
            store[str(i)] = external.value(v)


def _load_optimizer(self, store):
    specs = optimizer_slot_specs(self)
    external, owned = _external_flags(self)
    if not any(specs) and not any(owned) or len(store.keys()) != len(self.variables):
        # Keras's own handling, including its warning for a count mismatch.
        return _original("load_own_variables")(self, store)
    for i, (v, spec, own) in enumerate(zip(self.variables, specs, owned)):
        if own:
            external.assign(v, store[str(i)])
        else:
            _assign(v, spec, store[str(i)], f"Optimizer {self.name!r}")


def _optimizer_class():
    return keras_api.tf_optimizer_class()


def _original(name):
    return getattr(_optimizer_class(), _ORIGINALS_ATTR)[name][0]


def apply():
    """Makes Keras's TensorFlow optimizer save sharded slots full-size."""
    cls = _optimizer_class()
    if _ORIGINALS_ATTR in cls.__dict__:
        return
    # (the function to call, whether the class itself defined it)
    setattr(cls, _ORIGINALS_ATTR, {
        name: (getattr(cls, name), name in cls.__dict__)
        for name in ("save_own_variables", "load_own_variables")
    })
    cls.save_own_variables = _save_optimizer
    cls.load_own_variables = _load_optimizer


def revert():
    cls = _optimizer_class()
    originals = cls.__dict__.get(_ORIGINALS_ATTR)
    if originals is None:
        return
    for name, (function, own) in originals.items():
        if own:
            setattr(cls, name, function)
        else:
            delattr(cls, name)
    delattr(cls, _ORIGINALS_ATTR)
