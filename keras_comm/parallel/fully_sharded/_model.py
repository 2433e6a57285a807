"""Whole models with `FullyShard` layers: wrapping them, their full weights, their memory.

`fully_shard(model)` wraps every layer with weights (FSDP2's
`fully_shard`); `full_weights` / `set_full_weights` convert between a
model's shards and the unwrapped model's full weights.
"""


import re
import types

import contextlib

import keras

from keras_comm._private import keras_api
from keras_comm.parallel import sharded_weights
from keras_comm.parallel.fully_sharded._layer import FullyShard


def fully_sharded_layers(model_or_layer):
    """The `FullyShard` layers of a model or layer, nested in any depth."""
    if isinstance(model_or_layer, FullyShard):
        return [model_or_layer]
    if not isinstance(model_or_layer, keras.layers.Layer):
        return []
    return [l for l in keras_api.sublayers(model_or_layer) if isinstance(l, FullyShard)]


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


def _is_plain(model):
    """A model `keras.models.clone_model` copies: a `keras.Sequential` or a
    Functional model made by `keras.Model(inputs, outputs)`, not a subclass."""
    return type(model).__name__ in ("Sequential", "Functional") and type(
        model
    ).__module__.startswith("keras.")


def fully_shard(
    model, mesh=None, axis="data", accumulation="sharded", accumulation_steps=1, seed=None,
    prefetch=True,
):
    """Wraps every layer with weights of a built model in `FullyShard`.

    A `keras.Sequential` or a Functional model from `keras.Model(inputs,
    outputs)` is copied: each layer with weights is wrapped whole (nested
    Sequential/Functional models are entered), and the copy is returned.

    Any other model -- a subclassed model, a subclass of Functional such as
    a KerasHub backbone or task (`keras_hub.models.GPT2CausalLM`) -- is
    sharded **in place** (FSDP2's `fully_shard`) and returned: each layer
    that owns weights itself (Dense, EinsumDense, LayerNormalization,
    embeddings) is replaced, wherever the model refers to it (its graph,
    its attributes), by a `FullyShard` holding that layer, whose full-size
    storage is freed. Layers that only contain other layers (a transformer
    block, an attention layer) stay as they are and call the wrappers. The
    model's weight order, saved files and `generate()` stay the unwrapped
    model's: `.weights.h5` files load into each other; outside a replica
    step (`generate()`) the wrappers compute on full weights (with several
    workers, inside `keras_comm.parallel.gathered(model)`).

    Either way the shards start from `model`'s current weights (worker 0's).
    Call it inside the strategy's scope; compile the result.

    Args:
        model: a built Keras model.
        mesh, axis, accumulation, accumulation_steps, seed, prefetch: as
            for `FullyShard`.

    Returns:
        The copy, or `model` itself sharded in place (same layer names and
        weight order as `model` had).

    Raises:
        ValueError: `model` is not a built Keras model; in place, a layer
            that owns weights and also contains layers with weights, or
            one that `FullyShard` refuses (the error names it).
    """
    if not isinstance(model, keras.Model) or not model.built:
        raise ValueError(
            "fully_shard takes a built Keras model (give a Sequential its "
            f"keras.Input, call a subclassed model once). Received: model={model!r}"
        )
    options = dict(
        mesh=mesh,
        axis=axis,
        accumulation=accumulation,
        accumulation_steps=accumulation_steps,
        seed=seed,
        prefetch=prefetch,
    )
    if keras_api.deferring_variables():
        raise ValueError(
            "fully_shard creates each weight's shards, which `deferred_weights()` "
            "would leave unallocated: call it after the `deferred_weights()` "
            f"block, inside the strategy's scope. Received: model={model.name!r} "
            "inside deferred_weights()"
        )
    if keras_api.in_stateless_scope():
        raise ValueError(
            "fully_shard creates the shards as variables, so it must be called "
            "outside any keras.StatelessScope, inside the strategy's scope. "
            f"Received: model={model.name!r} inside a stateless scope"
        )
    if not _is_plain(model):
        return _shard_in_place(model, options)

    def clone(layer):
        if _has_weights(layer) and not isinstance(layer, (FullyShard, keras.Model)):
            return FullyShard(layer, **options)
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


def _shard_in_place(model, options):
    """`fully_shard` on a model it cannot copy: see its docstring."""
    if fully_sharded_layers(model):
        raise ValueError(
            f"fully_shard: model {model.name!r} holds FullyShard layers already "
            "(it was sharded before). Received: "
            f"{len(fully_sharded_layers(model))} FullyShard layers"
        )
    layers = [model] + keras_api.sublayers(model)
    owners = [l for l in layers if keras_api.own_weights(l)]
    for layer in owners:
        nested = [w for l in keras_api.sublayers(layer) for w in keras_api.own_weights(l)]
        if nested or isinstance(layer, keras.Model):
            raise ValueError(
                f"fully_shard: layer {layer.name!r} owns weights "
                f"({keras_api.own_weights(layer)[0].path!r}) and also "
                "contains layers with weights (or is a model), so neither it "
                "nor its sublayers can be wrapped alone; create its own "
                "weights in a sublayer. Received: "
                f"layer={type(layer).__name__}"
            )
    replacements = {}
    # One layer at a time, in Keras's walk (the same on every worker): each
    # wrapper broadcasts worker 0's values and frees the layer's storage
    # before the next, so one layer's full weights are held at a time.
    for layer in owners:
        wrapper = FullyShard._in_place(layer, **options)
        keras_api.share_nodes(layer, wrapper)
        replacements[id(layer)] = wrapper
    for container in layers:
        keras_api.replace_layers(container, replacements)
    _set_checkpoint_names(model)
    # State that is no weight (a Dropout's seed generator), made under
    # `deferred_weights`, is small: it is allocated whole.
    left = list(model.variables) + [v for l in keras_api.sublayers(model) for v in l.variables]
    if getattr(model, "optimizer", None) is not None:
        left += list(model.optimizer.variables)
    keras_api.allocate(left)
    return model


@contextlib.contextmanager
def deferred_weights():
    """Builds models inside it without allocating their weights (DeepSpeed's
    `zero.Init`, FSDP's meta-device init).

    Every Keras variable created inside keeps its shape, dtype and
    initializer but no value. `fully_shard(model)` (called after the block,
    inside the strategy's scope) then creates each weight directly as its
    shards: worker 0 calls the weight's initializer once, sends the value,
    every replica keeps its piece, and the full value is dropped before the
    next weight. Peak memory while building is the shards plus one full
    weight (two on a receiving worker: the broadcast's input and output).
    The initial values are those the model built outside this block gets
    from the same seed: Keras seeds each initializer when its layer is made,
    not when it is called.

    A model built inside must be passed to `fully_shard` before it is used:
    its weights have no values until then.

    Example:

    ```python
    with strategy.scope():
        with keras_comm.parallel.deferred_weights():
            model = keras_hub.models.GPT2CausalLM(backbone=..., preprocessor=None)
        keras_comm.parallel.fully_shard(model)
        model.compile(...)
    ```
    """
    with keras_api.deferred_variables():
        yield


@contextlib.contextmanager
def gathered(model_or_layer):
    """Holds every `FullyShard` weight of `model_or_layer` whole while the
    block runs (FSDP's `summon_full_params`).

    Outside a replica step (KerasHub's `generate()`, a model called on the
    host) a wrapper cannot gather its shards: with one worker it gathers
    them on the host when called, with several it reads the values
    gathered here. Every worker must enter it (entering gathers). A
    function traced inside the context keeps the values it read: on exit
    a KerasHub model's compiled `generate` is dropped (traced again next
    time).

    Example:

    ```python
    with keras_comm.parallel.gathered(causal_lm):
        out = causal_lm.generate(prompts, max_length=16)
    ```
    """
    layers = fully_sharded_layers(model_or_layer)
    for layer in layers:
        layer._hidden.gathered = None
        layer._hidden.gathered = layer._gather_on_host()
    try:
        yield
    finally:
        for layer in layers:
            layer._hidden.gathered = None
        if getattr(model_or_layer, "generate_function", None) is not None:
            model_or_layer.generate_function = None


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


def _set_checkpoint_names(model, named=None):
    """Gives every FullyShard in `model`'s layer list (Sequential and
    Functional) the entry name Keras's saving gives its inner layer in the
    unwrapped model: the snake case of the class, made unique per container
    in the order of `layers`. A layer two lists share (a KerasHub task's
    token embedding, in its backbone's list and its own) is saved once,
    where Keras's walk meets it first, and keeps that name."""
    named = set() if named is None else named
    listed = _is_layer_list_model(model)
    used = {}
    for layer in getattr(model, "layers", []):
        if isinstance(layer, keras.Model):
            _set_checkpoint_names(layer, named)
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
        if isinstance(layer, FullyShard) and id(layer) not in named:
            named.add(id(layer))
            layer.checkpoint_name = name
