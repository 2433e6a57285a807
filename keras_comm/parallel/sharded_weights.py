"""Per-replica (sharded) weights: one slice of a full weight on each replica.

Under `tf.distribute.MultiWorkerMirroredStrategy` every Keras weight is a
MirroredVariable: one component per replica, initialised from worker 0, its
gradient summed over all replicas before the optimizer applies it. A sharded
weight keeps that variable type (so Keras, the optimizer and checkpoints
handle it as usual) and changes three things:

* **Value.** Each component holds its own shard: slice ``k`` of the full
  weight along `shard_axis`, where ``k`` is the replica's coordinate on the
  mesh axis the weight is split over. Shards are written right after the
  variable is created, component by component (MWMS broadcasts worker 0's
  initial value at creation, even to ON_READ variables, so the shards
  cannot be the initial value itself). The
  full weight is ``initializer(full_shape, seed)``, computed by worker 0 and
  broadcast to the other workers (as MWMS broadcasts a mirrored variable's
  initial value), and every replica keeps its slice; so the gathered weight
  equals an unsplit layer's weight with the same seeded initializer. (The
  full value exists transiently on the host at build; the variable holds 1/N.)
* **Gradient.** The variable carries its own gradient reduction
  (`keras_comm.variables.annotations.set_gradient_hook`), which the optimizer calls instead of
  its world all-reduce: a SUM over the weight's *data-parallel
  group* (the replicas holding the same shard; nothing when there are none).
  The optimizer then applies each replica's own gradient to its own
  component (`strategy.extended.update` updates components one by one), so
  the optimizer's slots (momentum, Adam moments) are per-shard too.
* **Export.** `gather_full` (in replica context) and `full_weights` /
  `set_full_weights` (host side) convert between shards and full tensors.

Limits: `global_clipnorm` sees only this replica's shards (its norm is
local, not global). `keras_comm.callbacks.ParallelOptimizer` honours the
reduction: sharded weights skip its world-wide reduction and ZeRO sharding,
go through their own reduction once per update and are updated whole.

Saving: `model.save_weights` / `model.save` write every sharded weight (and
the optimizer slots of one) FULL-size, gathered from the shards, and loading
gives each replica its slice (`keras_comm.parallel._checkpoint`). A file is
thus what the unsplit model holds and loads on any cluster size whose group
sizes divide the split dimensions. Saving gathers (a collective): under
MultiWorkerMirroredStrategy every worker saves, the chief to the real path
and the others to a path of their own. Per-replica access in one process:
`process_shards` / `assign_process_shards`, or `full_weights`.
"""

import dataclasses
import math
import weakref
import zlib

import keras
import numpy as np
import tensorflow as tf

from keras_comm import ops
from keras_comm import topology
from keras_comm._private import keras_api
from keras_comm._private import tf_api
from keras_comm.parallel import _collectives
from keras_comm.parallel import _initial
from keras_comm.parallel import mesh as mesh_lib
from keras_comm.variables import annotations

#: Attribute (on the tf.Variable) that the optimizer's gradient reduction reads.
REDUCE_GRADIENT_ATTR = annotations.GRADIENT_HOOK_ATTR


@dataclasses.dataclass(frozen=True)
class ShardSpec:
    """How a weight is split.

    Attributes:
        full_shape: shape of the whole weight.
        shard_axis: the weight axis that is split.
        mesh: the `Mesh`, or None for a 1-D mesh over the whole world.
        mesh_axis: the mesh axis whose groups hold the different shards.
        num_shards: the size of that mesh axis when the weight was created.
    """

    full_shape: tuple
    shard_axis: int
    mesh: object
    mesh_axis: str
    num_shards: int

    @property
    def shard_shape(self):
        shape = list(self.full_shape)
        shape[self.shard_axis] //= self.num_shards
        return tuple(shape)

    def runtime_mesh(self):
        return mesh_lib.runtime_mesh(self.mesh, self.mesh_axis)

    def shard_index(self, rank):
        m = self.runtime_mesh()
        return m.coordinates(rank)[m.axes.index(self.mesh_axis)]

    def model_group(self, rank=None):
        """The replicas holding the different shards (the calling one's)."""
        return self.runtime_mesh().group(self.mesh_axis, rank)

    def data_group(self, rank=None):
        """The replicas holding the same shard as `rank` (default: caller)."""
        return self.runtime_mesh().other_axes_group(self.mesh_axis, rank)

    def slice(self, full, index):
        """Shard `index` of the numpy array `full`."""
        size = self.shard_shape[self.shard_axis]
        sl = [slice(None)] * len(self.full_shape)
        sl[self.shard_axis] = slice(index * size, (index + 1) * size)
        return full[tuple(sl)]


@dataclasses.dataclass(frozen=True)
class DeferredShard:
    """A sharded weight created without a value (inside a `keras.StatelessScope`).

    `keras_comm.parallel.Pipeline` builds its stages that way; a
    tensor-parallel layer in a stage then records here how its weight is
    split and initialised, and the pipeline's stage buffer holds each
    replica's shard (`full_value` sliced by `spec.slice`).
    """

    spec: ShardSpec
    initializer: object
    seed: int

    def full_value(self, dtype):
        """The full weight's initial value (numpy), the same on every worker."""
        init = seeded_initializer(self.initializer, self.seed)
        return np.asarray(keras.ops.convert_to_numpy(init(self.spec.full_shape, dtype=dtype)))


_tf_variable = keras_api.tf_variable
deferred_shard = annotations.deferred_shard
shard_spec = annotations.shard_spec
is_sharded = annotations.is_sharded
register_spec = annotations.register_spec


def components(variable):
    v = _tf_variable(variable)
    return list(v.values) if hasattr(v, "values") else [v]


def local_ranks(num_components, strategy=None):
    """Global ranks of this process's replicas, in component order."""
    strategy = strategy or tf.distribute.get_strategy()
    if strategy.num_replicas_in_sync == 1:
        return [0]
    task = topology.task_id(strategy)
    return [task * num_components + i for i in range(num_components)]


def seeded_initializer(initializer, seed):
    init = keras.initializers.get(initializer)
    config = init.get_config()
    if "seed" in config:
        config["seed"] = int(seed)
        init = init.__class__.from_config(config)
    return init


def add_sharded_weight(
    layer,
    name,
    full_shape,
    shard_axis,
    mesh,
    mesh_axis,
    initializer,
    seed=None,
    dtype=None,
    trainable=True,
):
    """Adds to `layer` a weight of which each replica holds one shard.

    Args:
        layer: the Keras layer that owns the weight (call from `build`).
        name: weight name.
        full_shape: the whole weight's shape.
        shard_axis: the axis split across the `mesh_axis` groups.
        mesh: a `Mesh` or None (a 1-D mesh over the whole world).
        mesh_axis: the mesh axis name.
        initializer: a Keras initializer (identifier, config or instance).
        seed: int; the full weight is ``initializer(full_shape)`` with this
            seed. None derives one from the weight's path. Either way, with
            more than one worker, worker 0 computes the full weight and
            broadcasts it (`keras_comm.parallel._initial`), so every worker
            slices the same value whatever its layer names.
        dtype: variable dtype (default: the layer's variable dtype).
        trainable: whether the optimizer trains it.

    Returns:
        The Keras variable (shard-shaped).

    Raises:
        ValueError: if ``full_shape[shard_axis]`` is not divisible by the
            number of shards.
    """
    full_shape = tuple(int(d) for d in full_shape)
    m = mesh_lib.runtime_mesh(mesh, mesh_axis)
    n = m.axis_size(mesh_axis)
    if full_shape[shard_axis] % n:
        raise ValueError(
            f"Layer {layer.name!r}: weight {name!r} of shape {full_shape} is "
            f"split along axis {shard_axis} into {n} shards (the {mesh_axis!r} "
            f"group size), so that dimension must be divisible by {n}. "
            f"Received: {name}.shape[{shard_axis}]={full_shape[shard_axis]}"
        )
    spec = ShardSpec(full_shape, shard_axis, mesh, mesh_axis, n)
    variable = layer.add_weight(
        name=name,
        shape=spec.shard_shape,
        initializer="zeros",
        dtype=dtype,
        trainable=trainable,
    )
    tf_var = _tf_variable(variable)
    if tf_var is None:
        # Created in a keras.StatelessScope (a `Pipeline` stage): no variable
        # to write; the owner of the values (the stage buffer) computes each
        # replica's shard from this record and reduces its gradient.
        if seed is None:
            seed = zlib.crc32(variable.path.encode()) % (2**31)
        annotations.register_deferred(variable, DeferredShard(spec, initializer, int(seed)))
        return variable
    annotations.register_spec(tf_var, spec)
    annotations.set_gradient_hook(tf_var, lambda g: _reduce_gradient(spec, g, layer.name))
    if seed is None:
        seed = zlib.crc32(variable.path.encode()) % (2**31)

    def compute():
        full = seeded_initializer(initializer, seed)(full_shape, dtype=variable.dtype)
        return np.asarray(keras.ops.convert_to_numpy(full))

    # Worker 0's full value on every worker: the path (hence the seed) can
    # differ between workers that made other layers before.
    strategy = strategy_of([variable])
    assign_full(variable, _initial.chief_value(strategy, full_shape, variable.dtype, compute))
    return variable


def _reduce_gradient(spec, grad, name):
    """Replica context: SUM over the data-parallel group only."""
    group = spec.data_group()
    if group.size == 1 or grad is None:
        return grad
    return ops.all_reduce(grad, group=group, name=f"{name}_shard_grad")


def process_shards(variable):
    """``{global rank: numpy shard}`` for this process's replicas (alias: `local_shards`)."""
    comps = components(variable)
    ranks = local_ranks(len(comps), strategy_of([variable]))
    return {r: c.numpy() for r, c in zip(ranks, comps)}


def assign_process_shards(variable, shards):
    """Writes ``{global rank: value}`` into this process's components (alias: `assign_local_shards`)."""
    comps = components(variable)
    with tf.init_scope():
        for r, c in zip(local_ranks(len(comps), strategy_of([variable])), comps):
            if r in shards:
                c.assign(tf_api.shard_value(shards[r], c.dtype))


# The names before `process_shards` / `assign_process_shards`: "local" also
# names one replica's slice of a packed buffer in the ZeRO sharding code.
local_shards = process_shards
assign_local_shards = assign_process_shards


def assign_full(variable, full):
    """Assigns a full value: each local replica takes its own slice.

    Works for plain (mirrored) variables too: every component gets `full`.
    Call outside `strategy.run` (host side).
    """
    spec = shard_spec(variable)
    full = np.asarray(full)
    comps = components(variable)
    strategy = strategy_of([variable])
    with tf.init_scope(), strategy.scope():
        for r, c in zip(local_ranks(len(comps), strategy), comps):
            value = full if spec is None else spec.slice(full, spec.shard_index(r))
            c.assign(tf.cast(value, c.dtype))


def gather_full(variable, name=None):
    """In replica context: the full value of a sharded weight (differentiable).

    Forward: all-gather of the shards over the weight's model group, along
    its shard axis. Backward: this replica's slice of the summed gradient.
    A plain weight is returned as its value.
    """
    spec = shard_spec(variable)
    value = tf.convert_to_tensor(_tf_variable(variable))
    if spec is None:
        return value
    return _collectives.gather_along(value, spec.shard_axis, spec.model_group(), name)


def strategy_of(weights):
    for w in weights:
        strategy = tf_api.variable_strategy(_tf_variable(w))
        if strategy is not None:
            return strategy
    return tf.distribute.get_strategy()


register_composite = annotations.register_composite
_composite = annotations.composite


def full_weights(model_or_layer):
    """Host side: every weight of a model/layer as a full numpy array.

    Sharded weights are gathered (one `strategy.run`); plain weights are read.
    The order is that of ``model.weights``, the order an unsplit model with
    the same layers would use.
    """
    weights = list(model_or_layer.weights)
    if any(_composite(w) is not None for w in weights):
        out = []
        for w in weights:
            owner = _composite(w)
            out += owner.full_values() if owner is not None else full_weights_of([w])
        return out
    return full_weights_of(weights)


def full_weights_of(weights):
    """`full_weights` of a list of weights (no composite among them)."""
    if not any(is_sharded(w) for w in weights) or strategy_of(weights).num_replicas_in_sync == 1:
        # Each weight's own host value: a weight split by a
        # `keras.distribution` layout reads as its full value this way.
        return [np.asarray(w.numpy()) for w in weights]
    values = iter(gather_values(
        [(w, shard_spec(w)) for w in weights if is_sharded(w)], name="full_weights"
    ))
    return [next(values) if is_sharded(w) else _plain_value(w) for w in weights]


def _plain_value(weight):
    """Host side: a plain weight's value beside sharded ones.

    A weight stored smaller than its shape (split by a `keras.distribution`
    layout: its components are blocks) reads as its full value, `numpy()`;
    any other as its first local replica's value (a per-replica variable's
    own, not an aggregate).
    """
    first = components(weight)[0]
    if tuple(first.shape) != tuple(weight.shape):
        return np.asarray(weight.numpy())
    return np.asarray(first.numpy())


# [Note: host-side gathers] `gather_values` (full weights, saving) runs one
# all-gather per dtype and shard grouping for up to `GATHER_BYTES` of full
# values (so one for a small model): each replica flattens its shards (split
# axis first) into one vector, the vectors are gathered, and the host cuts
# every full value out of the result (pure data movement, so exact). A shard
# grouping is the partition of the world into the specs' model groups
# (`spec.model_group(rank)` for every rank), so a `ShardSpec` split over one
# mesh axis and a Pipeline's `StageBufferSpec` (the pipeline and
# tensor-parallel axes together) never share a gather, and every worker
# forms the same batches in the same order. The byte bound keeps a save's
# transient to one batch: one gather of everything would hold several full
# copies of the model's weights or optimizer slots at once (the flat vector,
# its host copy, the values cut out of it).
# The traced gather takes that vector as its argument and relaxes its
# length after the second one (`reduce_retracing`), so a few traces per
# dtype and grouping serve every layer and every later call (a layer saved
# after its `full_weights`); autograph is off, since converting the
# collectives' Python costs far more than gathering a small model.
_HOST_GATHERS = weakref.WeakKeyDictionary()  # strategy -> {(grouping, name): tf.function}


def _grouping(spec, world, memo):
    """The partition of ranks ``0..world-1`` into `spec`'s model groups."""
    key = (type(spec), id(spec.mesh), spec.mesh_axis, id(getattr(spec, "owner", None)))
    if key not in memo:
        memo[key] = tuple(sorted({spec.model_group(r).ranks for r in range(world)}))
    return memo[key]


def _host_gather_fn(strategy, grouping, name):
    functions = _HOST_GATHERS.setdefault(strategy, {})
    fn = functions.get((grouping, name))
    if fn is None:
        # Not the strategy itself: the cache must not keep it alive.
        strategy_ref = weakref.ref(strategy)

        def replica_fn(flat):
            rank = topology.rank()
            group = topology.Group(next(g for g in grouping if rank in g))
            return _collectives.gather_along(flat, 0, group, name=name)

        fn = tf.function(
            lambda flat: strategy_ref().run(replica_fn, args=(flat,)),
            autograph=False,
            reduce_retracing=True,
        )
        functions[(grouping, name)] = fn
    return fn


def _axis_first(shape, axis):
    shape = tuple(shape)
    return (shape[axis],) + shape[:axis] + shape[axis + 1:]


def gather_values(pairs, name="gather_values"):
    """Host side: ``[numpy value]`` per ``(variable, spec or None)`` pair.

    A variable with a spec of more than one shard gives its shards gathered
    over its model group (`spec.model_group`) along `spec.shard_axis`: the
    group's shards joined in rank order, as `gather_full` gives them (flat
    shards: the padded flat vector; a stage buffer: its replicas' rows
    whole, for `StageBufferSpec.to_full`). Any other gives its host value
    (`numpy()`). A collective over every replica when any variable is
    split: all workers must call it with the same variables, in the same
    order.
    """
    out = [None] * len(pairs)
    for i, value in iter_gather_values(pairs, name):
        out[i] = value
    return out


#: The most bytes of full values one host gather assembles (a variable larger
#: than this is gathered alone). Saving a model writes each value as it
#: arrives (`iter_gather_values`), so a save holds one such batch beside the
#: model, not a second full copy of every weight and optimizer slot.
GATHER_BYTES = 64 * 2**20


def iter_gather_values(pairs, name="gather_values", max_bytes=None):
    """`gather_values`, one value at a time: yields ``(index, value)`` pairs.

    Unsplit variables come first, then the split ones batch by batch: the
    split variables of one dtype and shard grouping, in order, share an
    all-gather of at most `max_bytes` (default `GATHER_BYTES`) of full
    values. Each batch's values are yielded before the next is gathered, so
    a caller that writes and drops them holds one batch at a time. The
    same collective contract as `gather_values`.
    """
    max_bytes = GATHER_BYTES if max_bytes is None else max_bytes
    strategy = strategy_of([v for v, _ in pairs])
    world = strategy.num_replicas_in_sync
    split = []
    for i, (v, spec) in enumerate(pairs):
        if spec is None or spec.num_shards == 1 or world == 1:
            yield i, np.asarray(v.numpy())
        else:
            split.append(i)
    if not split:
        return
    first = local_ranks(len(components(pairs[split[0]][0])), strategy)[0]
    buckets, memo = {}, {}
    with strategy.scope():  # model groups are the strategy's ranks
        for i in split:
            grouping = _grouping(pairs[i][1], world, memo)
            buckets.setdefault((grouping, _tf_variable(pairs[i][0]).dtype), []).append(i)
    for (grouping, dtype), members in buckets.items():
        rows = len(next(g for g in grouping if first in g))
        batch, batch_bytes = [], 0
        for i in members:
            nbytes = rows * math.prod(components(pairs[i][0])[0].shape) * dtype.size
            if batch and batch_bytes + nbytes > max_bytes:
                yield from _gather_batch(strategy, grouping, rows, batch, pairs, name)
                batch, batch_bytes = [], 0
            batch.append(i)
            batch_bytes += nbytes
        yield from _gather_batch(strategy, grouping, rows, batch, pairs, name)


def _gather_batch(strategy, grouping, rows, members, pairs, name):
    """Yields ``(index, full value)`` of `members` (indices into `pairs`:
    split variables of one shard grouping and dtype) from one all-gather;
    `rows`: the first local replica's group size."""
    comps = [components(pairs[i][0]) for i in members]
    axes = [pairs[i][1].shard_axis for i in members]
    with strategy.scope():
        flats = []
        for r in range(len(comps[0])):
            with tf.device(comps[0][r].device):
                flats.append(tf.concat([
                    tf.reshape(tf.experimental.numpy.moveaxis(c[r], axis, 0), [-1])
                    for c, axis in zip(comps, axes)
                ], 0))
        fn = _host_gather_fn(strategy, grouping, name)
        gathered = fn(tf_api.per_replica(flats))
        del flats
        # The first local replica's gather: rows are its group's members
        # in rank order, each holding every variable's flattened shard.
        gathered = np.asarray(strategy.experimental_local_results(gathered)[0])
    gathered = gathered.reshape(rows, -1)
    start = 0
    for c, axis, i in zip(comps, axes, members):
        moved = _axis_first(c[0].shape, axis)
        size = math.prod(moved)
        piece = gathered[:, start:start + size]
        start += size
        piece = piece.reshape((rows * moved[0],) + moved[1:])
        yield i, np.moveaxis(piece, 0, axis)


def set_full_weights(model_or_layer, values):
    """Host side: assigns full values (e.g. an unsplit model's `get_weights()`)."""
    weights = list(model_or_layer.weights)
    if any(_composite(w) is not None for w in weights):
        values, out = list(values), []
        expected = sum(
            _composite(w).full_value_count() if _composite(w) is not None else 1 for w in weights
        )
        if len(values) != expected:
            raise ValueError(
                f"`values` must hold one array per weight of the unsplit model ({expected}). "
                f"Received: len(values)={len(values)}"
            )
        for w in weights:
            owner = _composite(w)
            if owner is None:
                set_full_weights_of([w], [values.pop(0)])
            else:
                k = owner.full_value_count()
                owner.set_full_values(values[:k])
                del values[:k]
        return
    set_full_weights_of(weights, values)


def set_full_weights_of(weights, values):
    """`set_full_weights` of a list of weights (no composite among them)."""
    if len(weights) != len(values):
        raise ValueError(
            f"`values` must hold one array per weight ({len(weights)}). "
            f"Received: len(values)={len(values)}"
        )
    for w, v in zip(weights, values):
        spec = shard_spec(w)
        if spec is not None and tuple(np.shape(v)) != spec.full_shape:
            raise ValueError(
                f"Weight {w.path!r} has full shape {spec.full_shape}. "
                f"Received: value of shape {np.shape(v)}"
            )
        assign_full(w, v)


def shard_nbytes(variable):
    """Bytes each local replica holds for `variable`: ``{rank: bytes}``."""
    comps = components(variable)
    return {
        r: int(np.prod(c.shape)) * c.dtype.size
        for r, c in zip(local_ranks(len(comps), strategy_of([variable])), comps)
    }
