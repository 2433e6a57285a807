"""Weights a `keras.distribution` layout splits: stored as shards, gathered on use.

A weight whose layout splits it (`keras_comm.distribution._blocks`) is a
`ShardedVariable`: a Keras variable whose shape is the full weight's and
whose storage is a per-replica `tf.Variable` of the block's shape (under
`tf.distribute.MultiWorkerMirroredStrategy`, a mirrored variable whose
components hold different blocks). A Dense / EinsumDense / Embedding whose
kernel is split over a model axis does not read it whole: it computes on the
block (`keras_comm.distribution._split`). Reads give the full weight:

* **inside a replica step** (`fit`, `evaluate`, `predict`): the block,
  all-gathered over each split dimension's gather group. Backward: the
  all-gather's adjoint, a reduce-scatter (SUM), so the block's gradient
  arrives summed over those groups; the storage's gradient hook
  (`keras_comm.training.reduction`) then sums it over the data group (the
  replicas holding the same block), instead of the world-wide all-reduce.
  The optimizer applies it to the block, and its slots, created from the
  weight's layout (`add_variable_from_reference` passes ``layout=``), are
  blocks too.
* **on the host** (`get_weights`, `numpy()`, saving): the full value. With
  one worker every block is local and the blocks are joined in place;
  with several, one all-gather per weight, so every worker must read the
  same weights in the same order (as every worker saves).
* **inside the optimizer's update** (`strategy.extended.update`): the
  block, as any distributed variable reads there as its component; the
  optimizer's maths is elementwise.
* **inside `keras.StatelessScope`** (`stateless_call`, Keras's shape
  tracing): the scope's value, or a stand-in of the full shape.

[Note: gathered values live until the backward]
A layer's gathered weight is an input of its matmul's gradient, so it stays
alive from the forward to the backward of the step; the layer-level
recompute of `keras_comm.parallel.FullyShard` (gather again in the
backward) is not applied to these weights. Peak memory in a step is thus the
blocks plus the gathered weights of the layers whose backward has not yet
run.

Assigning a full value (`set_weights`, loading a file) writes each replica
its block.
"""

import dataclasses
import weakref

import keras
import numpy as np
import tensorflow as tf

from keras_comm import ops
from keras_comm import topology
from keras_comm._private import keras_api
from keras_comm._private import tf_api
from keras_comm.distribution import _blocks
from keras_comm.distribution import _mesh
from keras_comm.parallel import _collectives
from keras_comm.parallel import _initial
from keras_comm.variables import annotations

_AGGREGATION = {
    "none": tf.VariableAggregation.NONE,
    "sum": tf.VariableAggregation.SUM,
    "mean": tf.VariableAggregation.MEAN,
    "only_first_replica": tf.VariableAggregation.ONLY_FIRST_REPLICA,
}
_SYNCHRONIZATION = {
    "none": tf.VariableSynchronization.NONE,
    "on_read": tf.VariableSynchronization.ON_READ,
    "on_write": tf.VariableSynchronization.ON_WRITE,
    "auto": tf.VariableSynchronization.AUTO,
}

# Initializers whose block is computed directly (no full value, no broadcast).
_ELEMENTWISE = (keras.initializers.Zeros, keras.initializers.Ones, keras.initializers.Constant)


def _in_replica_step():
    return tf.distribute.has_strategy() and not tf.distribute.in_cross_replica_context()


class ShardedVariable(keras.Variable):
    """A Keras variable stored as this replica's block of the full weight.

    Its `shape` is the full weight's; `value` is the per-replica storage
    (what the optimizer updates); reading it as a tensor (`keras.ops`,
    TensorFlow ops, arithmetic, `numpy()`) gives the full weight, see the
    module docstring. Created by keras_comm when a `keras.distribution`
    layout splits a weight; not constructed directly.
    """

    @property
    def blocks(self):
        """The `Blocks`: how the weight is split over the mesh."""
        return self._keras_comm_blocks

    @property
    def batch_axis(self):
        """The distribution's `batch_dim_name` when the weight was created
        (None without one): dimensions split over it are gathered before use,
        dimensions split over other axes may split the compute."""
        return self._keras_comm_batch_axis

    def full_value(self):
        """The full weight as a tensor (see the module docstring for where)."""
        value = keras_api.stateless_value(self)
        if value is not None:
            return keras_api.autocast(self, value)
        blocks = self.blocks
        if keras_api.in_symbolic_scope() or keras_api.in_stateless_scope():
            # Keras traces for shapes only: a stand-in of the right shape.
            dtype = keras_api.variable_dtype(self)
            return keras_api.autocast(self, tf.zeros(blocks.full_shape, dtype))
        if tf_api.in_update_context():
            # The optimizer's maths (slots, updates) is elementwise on blocks.
            return keras_api.autocast(self, tf.convert_to_tensor(self.value))
        if _in_replica_step():
            return self._gather(keras_api.autocast(self, tf.convert_to_tensor(self.value)))
        full = getattr(self, "_keras_comm_full", None)
        if full is not None:
            return keras_api.autocast(self, full)
        return keras_api.autocast(self, self._host_full())

    def _gather(self, block):
        return _gather_block(self.blocks, block, name=f"{self.path}_gather")

    def _host_full(self):
        strategy = self._keras_comm_strategy
        comps = strategy.experimental_local_results(self.value)
        ranks = local_ranks(strategy, len(comps))
        blocks = self.blocks
        by_rank = dict(zip(ranks, comps))
        if topology.worker_count(strategy) == 1:

            def block_of(index):
                return tf.convert_to_tensor(by_rank[blocks.owner(index, ranks)])

            return blocks.assemble(block_of, _concat)
        if not tf.executing_eagerly():
            raise RuntimeError(
                f"Weight {self.path!r} is split over several workers and is read outside "
                "a replica step inside a tf.function (e.g. `generate()`): gather it "
                "first, `with keras_comm.distribution.gathered(model): ...`."
            )
        per_replica = strategy.experimental_distribute_values_from_function(
            lambda ctx: tf.convert_to_tensor(by_rank[ctx.replica_id_in_sync_group])
        )
        with strategy.scope():
            out = _host_gather(strategy, blocks, self.value.dtype)(per_replica)
        return strategy.experimental_local_results(out)[0]

    def numpy(self):
        return np.asarray(self.full_value())

    def __array__(self, dtype=None, copy=None):
        out = np.asarray(self.full_value())
        return out if dtype is None else out.astype(dtype)

    def __tf_tensor__(self, dtype=None, name=None):
        return tf.convert_to_tensor(self.full_value(), dtype=dtype, name=name)

    def __getitem__(self, idx):
        return self.full_value()[idx]

    def __int__(self):
        return int(self.numpy())

    def __float__(self):
        return float(self.numpy())

    def __neg__(self):
        return -self.full_value()

    def __pos__(self):
        return self.full_value()

    def __abs__(self):
        return keras.ops.abs(self.full_value())

    def __invert__(self):
        return keras.ops.logical_not(self.full_value())

    def __round__(self, ndigits=None):
        return keras.ops.round(self.full_value(), decimals=ndigits or 0)

    def assign(self, value):
        """Assigns the full `value`: each replica keeps its block."""
        if keras_api.in_stateless_scope():
            return super().assign(value)
        value = tf.convert_to_tensor(value, dtype=keras_api.variable_dtype(self))
        blocks = self.blocks
        if tuple(value.shape) != blocks.full_shape:
            raise ValueError(
                f"Weight {self.path!r} has shape {blocks.full_shape} (stored as blocks of "
                f"{blocks.block_shape}); assign its full value. Received: value.shape="
                f"{tuple(value.shape)}"
            )
        if _in_replica_step():
            local = tf_api.local_component(self.value)
            local.assign(tf_api.shard_value(blocks.slice(value, topology.rank()), local.dtype))
            return value
        strategy = self._keras_comm_strategy
        comps = strategy.experimental_local_results(self.value)
        with tf.init_scope(), strategy.scope():
            for rank, comp in zip(local_ranks(strategy, len(comps)), comps):
                comp.assign(tf_api.shard_value(blocks.slice(value, rank), comp.dtype))
        return value


# Arithmetic and comparisons read the full weight (Keras's own read
# `variable.value`, which here is the storage block).
_BINARY = {
    "add": keras.ops.add, "sub": keras.ops.subtract, "mul": keras.ops.multiply,
    "truediv": keras.ops.true_divide, "floordiv": keras.ops.floor_divide,
    "mod": keras.ops.mod, "pow": keras.ops.power, "matmul": keras.ops.matmul,
    "and": keras.ops.logical_and, "or": keras.ops.logical_or, "xor": keras.ops.logical_xor,
}
_COMPARISONS = {
    "eq": keras.ops.equal, "ne": keras.ops.not_equal, "lt": keras.ops.less,
    "le": keras.ops.less_equal, "gt": keras.ops.greater, "ge": keras.ops.greater_equal,
}


def _operator(fn, reflected):
    def method(self, other):
        return fn(other, self.full_value()) if reflected else fn(self.full_value(), other)

    return method


for _name, _fn in _BINARY.items():
    setattr(ShardedVariable, f"__{_name}__", _operator(_fn, False))
    setattr(ShardedVariable, f"__r{_name}__", _operator(_fn, True))
for _name, _fn in _COMPARISONS.items():
    setattr(ShardedVariable, f"__{_name}__", _operator(_fn, False))
# Identity, not value, equality for hashing (as keras.Variable).
ShardedVariable.__hash__ = keras.Variable.__hash__


def _concat(parts, axis):
    return tf.concat(parts, axis)


def _gather_block(blocks, block, name):
    """Replica context: `block` all-gathered over each split dimension's group."""
    rank = _collectives.my_rank()
    shape = list(blocks.block_shape)
    for dim in range(len(shape)):
        if blocks.pieces(dim) > 1:
            block = _collectives.gather_along(block, dim, blocks.gather_group(dim, rank), name=name)
            # The gathers leave the gathered dimension unknown; layers
            # (and the next gather) read shapes.
            shape[dim] = blocks.full_shape[dim]
            block = tf.ensure_shape(block, shape)
    return block


# Per strategy, the host reads' gather functions, one per split (the Blocks
# without their path) and dtype: a model's weights of one shape and layout
# share one traced function instead of tracing one each.
_HOST_GATHERS = weakref.WeakKeyDictionary()


def _host_gather(strategy, blocks, dtype):
    """A `tf.function` taking every replica's block, returning the full weight."""
    split = dataclasses.replace(blocks, path="")
    functions = _HOST_GATHERS.setdefault(strategy, {})
    fn = functions.get((split, dtype))
    if fn is None:

        def replica_fn(block):
            return _gather_block(split, block, name="host_read_gather")

        @tf.function
        def gather_everywhere(per_replica):
            return strategy.run(replica_fn, args=(per_replica,))

        fn = functions[(split, dtype)] = gather_everywhere
    return fn


def local_ranks(strategy, num_components):
    """Global ranks of this process's replicas, in component order."""
    if strategy.num_replicas_in_sync == 1:
        return [0]
    return [topology.task_id(strategy) * num_components + i for i in range(num_components)]


def is_sharded(variable):
    """Whether a Keras variable is stored as blocks by a `keras.distribution` layout."""
    return isinstance(variable, ShardedVariable)


# --- Creation: the hook Keras's TensorFlow variables call -----------------------

def _distribution_layout(variable, strategy):
    """The layout of `variable` and its mesh, or (None, None)."""
    explicit = keras_api.variable_layout(variable)
    distribution = keras.distribution.distribution()
    if explicit is None and distribution is None:
        return None, None
    if distribution is not None:
        _mesh.check_distribution(distribution, strategy)
    if explicit is not None:
        layout = explicit
    elif isinstance(distribution, keras.distribution.ModelParallel):
        layout = distribution.get_tensor_layout(variable.path)
    else:
        layout = None
    if layout is None:
        return None, None
    if not isinstance(layout, keras.distribution.TensorLayout):
        layout = keras.distribution.TensorLayout(tuple(layout))
    mesh = layout.device_mesh or (distribution.device_mesh if distribution else None)
    if mesh is None:
        raise ValueError(
            f"Weight {variable.path!r}: its layout {layout.axes} has no device mesh. "
            f"Received: layout={layout!r}"
        )
    return layout, mesh


def initialize(variable, initializer, shape):
    """Creates `variable`'s storage as its block if its layout splits it.

    Called by Keras for every variable it creates (see
    `keras_api.install_variable_initialization`); returns None for a
    variable that stays whole. `initializer` is None for a variable created
    from a concrete value, which keras_comm does not split (it raises).

    Raises:
        ValueError: a layout or mesh keras_comm cannot honour (see
            `_blocks.resolve` and `_mesh.check_mesh`), or a split
            non-trainable weight.
    """
    strategy = tf.distribute.get_strategy()
    layout, mesh = _distribution_layout(variable, strategy)
    if layout is None:
        return None
    if mesh is not getattr(keras.distribution.distribution(), "device_mesh", None):
        _mesh.check_mesh(mesh, strategy, f"Weight {variable.path!r}")
    blocks = _blocks.resolve(
        variable.path, shape, layout.axes, tuple(mesh.shape), tuple(mesh.axis_names)
    )
    if not blocks.is_split:
        return None
    if initializer is None:
        raise ValueError(
            f"Weight {variable.path!r} is split by its layout {layout.axes} but created "
            "from a value; keras_comm creates split weights from an initializer "
            "(`add_weight(initializer=...)`). Received: a value of shape "
            f"{blocks.full_shape}"
        )
    explicit = keras_api.variable_layout(variable) is not None
    if not variable.trainable and not explicit:
        raise ValueError(
            f"Weight {variable.path!r} is not trainable, and keras_comm splits only "
            f"trainable weights (and their optimizer slots). Received: layout {layout.axes}"
        )
    storage = _create_storage(variable, blocks, initializer, strategy)
    keras_api.set_variable_layout(variable, layout)
    variable.__class__ = ShardedVariable
    variable._keras_comm_blocks = blocks
    variable._keras_comm_strategy = strategy
    variable._keras_comm_batch_axis = getattr(
        keras.distribution.distribution(), "batch_dim_name", None
    )
    annotations.set_gradient_hook(storage, lambda g: _reduce_gradient(blocks, g, variable.name))
    return storage


def _create_storage(variable, blocks, initializer, strategy):
    dtype = keras_api.variable_dtype(variable)
    with tf.init_scope():
        storage = tf.Variable(
            tf.zeros(blocks.block_shape, dtype),
            trainable=variable.trainable,
            name=variable.name,
            aggregation=_AGGREGATION[variable.aggregation],
            synchronization=_SYNCHRONIZATION[variable.synchronization],
        )
    comps = strategy.experimental_local_results(storage)
    ranks = local_ranks(strategy, len(comps))
    if isinstance(initializer, _ELEMENTWISE):
        block = initializer(blocks.block_shape, dtype=dtype)
        values = {r: block for r in ranks}
    else:

        def compute():
            return np.asarray(keras.ops.convert_to_numpy(initializer(blocks.full_shape, dtype=dtype)))

        # Worker 0's full value on every worker (as MWMS gives a mirrored
        # variable worker 0's initial value); each replica keeps its block.
        full = _initial.chief_value(strategy, blocks.full_shape, dtype, compute)
        values = {r: blocks.slice(full, r) for r in ranks}
        del full
    with tf.init_scope(), strategy.scope():
        for rank, comp in zip(ranks, comps):
            comp.assign(tf.cast(values[rank], comp.dtype))
    return storage


def _reduce_gradient(blocks, grad, name):
    """Replica context: the block's gradient summed over its data group.

    The gathers' backward already summed it over the gather groups.
    """
    group = blocks.data_group(topology.rank())
    if grad is None or group.size == 1:
        return grad
    return ops.all_reduce(grad, group=group, name=f"{name}_block_grad")
