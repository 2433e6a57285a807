"""Whole models with `FullyShard` layers: wrapping them, their full weights, their memory.

`fully_shard(model)` wraps every layer with weights (FSDP2's
`fully_shard`); `full_weights` / `set_full_weights` convert between a
model's shards and the unwrapped model's full weights.
"""


import re
import types

import keras

from keras_comm.parallel import sharded_weights
from keras_comm.parallel.fully_sharded._layer import FullyShard


def fully_sharded_layers(model_or_layer):
    """The `FullyShard` layers of a model or layer, nested models included."""
    if isinstance(model_or_layer, FullyShard):
        return [model_or_layer]
    out = []
    for layer in getattr(model_or_layer, "layers", []):
        out += [layer] if isinstance(layer, FullyShard) else fully_sharded_layers(layer)
    return out


_fully_sharded_layers = fully_sharded_layers


def _owners(model_or_layer):
    owners = {}
    for layer in _fully_sharded_layers(model_or_layer):
        for w in layer.weights:
            owners[id(w)] = layer
    return owners


def full_weights(model_or_layer):
    """Host side: every weight as a full numpy array, in the unwrapped order.

    `FullyShard` layers give their inner layer's weights (gathered);
    tensor-parallel sharded weights are gathered
    (`keras_comm.parallel.sharded_weights.full_weights`); plain weights are read.
    The order is the unwrapped model's ``model.weights``.
    """
    if isinstance(model_or_layer, FullyShard):
        return model_or_layer.full_weights()
    owners = _owners(model_or_layer)
    if not owners:
        return sharded_weights.full_weights(model_or_layer)
    weights = list(model_or_layer.weights)
    plain = sharded_weights.full_weights(
        types.SimpleNamespace(weights=[w for w in weights if id(w) not in owners])
    )
    plain = iter(plain)
    out, done = [], set()
    for w in weights:
        owner = owners.get(id(w))
        if owner is None:
            out.append(next(plain))
        elif id(owner) not in done:
            done.add(id(owner))
            out.extend(owner.full_weights())
    return out


def set_full_weights(model_or_layer, values):
    """Host side: assigns full values in the unwrapped model's weight order
    (e.g. the unwrapped model's `get_weights()`)."""
    if isinstance(model_or_layer, FullyShard):
        return model_or_layer.set_full_weights(values)
    owners = _owners(model_or_layer)
    if not owners:
        return sharded_weights.set_full_weights(model_or_layer, values)
    weights = list(model_or_layer.weights)
    expected, seen = 0, set()
    for w in weights:
        owner = owners.get(id(w))
        if owner is None:
            expected += 1
        elif id(owner) not in seen:
            seen.add(id(owner))
            expected += len(owner._order)
    if len(values) != expected:
        raise ValueError(
            f"`values` must hold one array per weight of the unwrapped model "
            f"({expected}). Received: len(values)={len(values)}"
        )
    values = iter(values)
    done = set()
    for w in weights:
        owner = owners.get(id(w))
        if owner is None:
            sharded_weights.set_full_weights(types.SimpleNamespace(weights=[w]), [next(values)])
        elif id(owner) not in done:
            done.add(id(owner))
            owner.set_full_weights([next(values) for _ in owner._order])


def _has_weights(layer):
    return isinstance(layer, keras.layers.Layer) and bool(layer.weights)


def fully_shard(
    model, mesh=None, axis="data", accumulation="sharded", accumulation_steps=1, seed=None,
    prefetch=True,
):
    """A copy of a built Sequential/Functional model with every weighted layer
    wrapped in `FullyShard` (nested Sequential/Functional models are
    entered, other layers with weights wrapped whole).

    The copy starts from `model`'s current weights. Call it inside the
    strategy's scope; compile the copy.

    Args:
        model: a built `keras.Sequential` or Functional model.
        mesh, axis, accumulation, accumulation_steps, seed, prefetch: as
            for `FullyShard`.

    Returns:
        The copy (same layer names and weight order as `model`).

    Raises:
        ValueError: `model` is not built, or not Sequential/Functional.
    """
    if not isinstance(model, keras.Model) or not model.built:
        raise ValueError(
            "fully_shard copies a built Sequential or Functional model (give "
            f"a Sequential its keras.Input). Received: model={model!r}"
        )

    def clone(layer):
        if _has_weights(layer) and not isinstance(layer, (FullyShard, keras.Model)):
            return FullyShard(
                layer,
                mesh=mesh,
                axis=axis,
                accumulation=accumulation,
                accumulation_steps=accumulation_steps,
                seed=seed,
                prefetch=prefetch,
            )
        if not isinstance(layer, keras.layers.Layer):
            return layer
        return layer.__class__.from_config(layer.get_config())

    try:
        copy = keras.models.clone_model(model, clone_function=clone, recursive=True)
    except ValueError as e:
        if "subclass" in str(e).lower():
            raise ValueError(
                "fully_shard copies Sequential and Functional models; wrap the "
                f"layers of a subclassed model with FullyShard. Received: model={type(model).__name__}"
            ) from e
        raise
    _set_checkpoint_names(copy)
    return copy


def replica_state_bytes(model):
    """``{global rank: bytes}`` each local replica holds for the model's
    weights and its optimizer's variables (what sharding makes 1/N)."""
    out = {}
    variables = list(model.weights)
    if model.optimizer is not None:
        variables += list(model.optimizer.variables)
    for v in variables:
        for rank, b in sharded_weights.shard_nbytes(v).items():
            out[rank] = out.get(rank, 0) + b
    return out


def _snake_case(name):
    # keras.src.utils.naming.to_snake_case, which names a file's entries.
    name = re.sub(r"\W+", "", name)
    name = re.sub("(.)([A-Z][a-z]+)", r"\1_\2", name)
    name = re.sub("([a-z])([A-Z])", r"\1_\2", name).lower()
    return name


def _is_layer_list_model(model):
    """Sequential or Functional (subclasses too): Keras saves their `layers`
    as one list, each entry named after its class (public names only: the
    type's MRO, as Keras's `_obj_type`)."""
    return isinstance(model, keras.Model) and any(
        c.__name__ in ("Sequential", "Functional") for c in type(model).__mro__
    )


def set_checkpoint_names(model):
    """Names every `FullyShard`'s file entry as the unwrapped model's.

    Keras names the entries of a Sequential/Functional model's layer list
    after each layer's class, numbered per class in list order ("dense",
    "dense_1", ...; never the layer's `name`, which differs between two
    instances of one model). A wrapper is listed under its own class
    ("fully_shard", "fully_shard_1"), so a model with hand-placed wrappers
    writes files the unwrapped model cannot load (Keras raises: its layers
    find no entry) and cannot load the unwrapped model's. This gives each
    wrapper, as its `checkpoint_name`, the entry its inner layer has in the
    unwrapped model; afterwards each model loads the other's `.keras` /
    `.weights.h5` files. `fully_shard` calls it on its copy.

    Nested Sequential/Functional models are entered. Layers a subclassed
    model tracks as attributes are saved under the attribute's name, which
    the unwrapped model shares, so they need (and get) no name.

    Args:
        model: a Keras model holding `FullyShard` layers.

    Returns:
        `model`.

    Raises:
        TypeError: `model` is not a Keras model.
    """
    if not isinstance(model, keras.Model):
        raise TypeError(
            f"set_checkpoint_names takes a Keras model. Received: model={model!r}"
        )
    _set_checkpoint_names(model)
    return model


def _set_checkpoint_names(model):
    """Gives every FullyShard in `model`'s layer list (Sequential and
    Functional) the entry name Keras's saving gives its inner layer in the
    unwrapped model: the snake case of the class, made unique per container
    in the order of `layers`."""
    listed = _is_layer_list_model(model)
    used = {}
    for layer in getattr(model, "layers", []):
        if isinstance(layer, keras.Model):
            _set_checkpoint_names(layer)
        if not listed:
            continue
        unwrapped = layer.inner_layer() if isinstance(layer, FullyShard) else layer
        base = _snake_case(type(unwrapped).__name__)
        if base in used:
            used[base] += 1
            name = f"{base}_{used[base]}"
        else:
            used[base] = 0
            name = base
        if isinstance(layer, FullyShard):
            layer.checkpoint_name = name
