"""The sharded optimizer state behind the accumulate/shard step.

State lives in plain (non-distributed) TensorFlow variables, one set per
local replica device, created outside any strategy scope so that
MultiWorkerMirroredStrategy neither mirrors nor broadcasts them: each
replica keeps its own shard, and a mirrored variable would force every
replica to hold (and the strategy to keep in sync) the same full value.

* ``masters``: this replica's flat float32 shard of every trainable variable
  (the whole variable for zero_stage 0). They are refreshed from the model's
  weights at each update, so `set_weights`/`load_weights` between steps are
  honoured and the model's (float32) weights stay the source of truth.
* ``inner``: a clone of the user's optimizer built on the masters, so its
  slots (Adam moments, momentum, ...) are shard-sized. Only its
  ``update_step`` maths is used; learning rate, iterations, weight decay,
  clipping and loss scaling are taken from the user's optimizer, whose own
  state (iterations, loss scale) advances exactly as without the callback.
* ``acc``: the gradient accumulation buffers, one per communication bucket
  (`accumulate_plan.buckets`): the bucket's packed full gradient
  (zero_stage 0/1) or this replica's reduce-scattered shard of it
  (zero_stage 2); empty when nothing is accumulated. One variable per
  bucket lets a step add to, reduce and clear the buffers a bucket at a
  time: no full-size temporary beside them.

Variables that carry their own gradient reduction
(`keras_comm.training.reduction`: sharded weights of `keras_comm.parallel`,
or weights marked with `mark_gradient_reduced` because a comm layer already
reduced their gradient) are left out of the world-wide reduction and out of
the sharding: their gradient goes through their hook once per update and
they are updated whole, each replica on its own value (``hooked_masters``,
``hooked_acc``).

Memory: between steps a replica holds the model's weights, the clone's
slots (1/N of the optimizer state for zero_stage >= 1) and ``acc`` -- nothing
else of the optimizer:

* the user optimizer's full-size slots of the plain variables are
  *released* (their buffers replaced by empty ones, `release`) once this
  state holds their values (`AccumulateStep.take_user_slots` at the first
  step, one slot at a time), and stay
  released while this state lives: the clone's slots are the optimizer
  state. A save still writes standard Keras files: `keras_comm.parallel.
  _checkpoint` asks this state (`ExternalSlots`) for each released slot's
  full value, all-gathered one variable at a time, so the transient is one
  variable's slot, and a load cuts each replica's shard out of the file's
  full value (any worker count). Slots are matched by name: the clone's
  slot ``kc_master_<i>_<slot>`` is the user's ``<path of variable i>_<slot>``;
* the masters are scratch: they are refreshed from the model's weights at
  every update anyway, so they are filled (`fill`) at the update and
  released at its end, in the same step (`release_in_step`). A master costs
  its bytes only while the update runs (for float16/bfloat16 variables too:
  the weights stay the source of truth).

Slots of hooked variables (whole, per replica) are not released: the
user's slot and the clone's are both held (counted by `nbytes`).

*Group-sharded* variables: a hooked variable whose hook is one sum over a
group of replicas (its *data group*, declared with `set_data_group`: a
`keras_comm.parallel.Pipeline` stage buffer, summed over the replicas
running the same stage) is, for zero_stage >= 1, sharded over that group
instead of kept whole: its gradient is reduce-scattered over the group
(in place of the hook), each replica updates its 1/d shard (``grouped_masters``
and the clone's slots of that size, ``group_acc`` for accumulation) and the
group all-gathers the new value. Its user slots are released and served to
checkpoints like the plain ones (gathered over the data group, then over
the variable's own `ShardSpec` model group).
"""

import concurrent.futures

import keras
import tensorflow as tf

from keras_comm._private import keras_api
from keras_comm._private import tf_api
from keras_comm.training import accumulate_plan
from keras_comm.variables import annotations
from keras_comm.variables import packing
from keras_comm.variables.annotations import DATA_GROUP_ATTR  # noqa: F401
from keras_comm.variables.annotations import data_group
from keras_comm.variables.annotations import set_data_group  # noqa: F401


def local_variable(variable):
    """The tf.Variable of `variable` (a Keras variable) on the current device."""
    return tf_api.local_component(keras_api.tf_variable(variable))


def outside_strategy(fn):
    """Runs `fn()` with no tf.distribute strategy in scope.

    The strategy stack is thread-local, so a fresh thread has none: variables
    it creates are plain, per-device ones even if the caller is inside
    ``strategy.scope()``.
    """
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        return pool.submit(fn).result()


def user_optimizers(optimizer):
    """``(loss_scale_optimizer_or_None, optimizer_doing_the_maths)``."""
    if isinstance(optimizer, keras.optimizers.LossScaleOptimizer):
        return optimizer, optimizer.inner_optimizer
    return None, optimizer


def prod(shape):
    out = 1
    for d in shape:
        out *= int(d)
    return out


def _nbytes(v):
    return prod(v.shape) * tf.as_dtype(v.dtype).size


def local_components(variable):
    """Every local component of a (Keras or tf) variable, distributed or not."""
    v = keras_api.tf_variable(variable)
    values = getattr(v, "values", None)
    return list(values) if isinstance(values, (tuple, list)) else [v]


def release(variable):
    """Frees `variable`'s buffer on every local component (host side).

    The variable keeps its Python shape (Keras's bookkeeping, names and
    checkpoint order are untouched) but holds an empty tensor, so its memory
    goes back to TensorFlow's allocator. Read it only after `fill`.
    """
    for component in local_components(variable):
        with tf.device(component.device):
            tf.raw_ops.AssignVariableOp(
                resource=component.handle,
                value=tf.zeros([0], component.dtype),
                validate_shape=False,
            )


def fill(variable, value):
    """Gives a released (local, tf) `variable` the buffer `value`, in a step."""
    return tf.raw_ops.AssignVariableOp(
        resource=variable.handle, value=tf.cast(value, variable.dtype), validate_shape=False
    )


def release_in_step(variable):
    """`release` of a (local, tf) `variable` of rank >= 1 inside a step; read
    it only after `fill`.

    The empty value keeps the variable's rank and trailing dimensions, with
    a first dimension of 0 that is unknown statically: at trace time the
    assign checks a known one against the variable's, also with
    validate_shape=False. Grappler infers one shape for all of a variable's
    values, here the variable's with an unknown first dimension; an empty
    value of another rank would make it take a reshape of the variable's
    value for a no-op and drop it.
    """
    trailing = variable.shape.as_list()[1:]
    empty = tf.compat.v1.placeholder_with_default(
        tf.zeros([0] + trailing, variable.dtype), [None] + trailing
    )
    return fill(variable, empty)


class ReplicaState:
    """Variables one local replica holds (see the module docstring)."""

    def __init__(self, device, layout, plain_index, hooked, config, acc_sizes, num_norms,
                 grouped=(), group_acc_size=0, accumulates=False):
        self.device = device
        with tf.device(device):
            self.masters = [
                keras.Variable(
                    tf.zeros([s], tf.float32), trainable=False, name=f"kc_master_{i}"
                )
                for i, s in zip(plain_index, layout.shard_sizes)
            ]
            self.hooked_masters = [
                keras.Variable(
                    tf.zeros([prod(v.shape)], tf.float32),
                    trainable=False,
                    name=f"kc_master_{i}",
                )
                for i, v in hooked
            ]
            # Group-sharded variables: this replica's 1/d shard (`grouped`:
            # ``(index, variable, Layout over the data group)``).
            self.grouped_masters = [
                keras.Variable(
                    tf.zeros([glayout.shard_total], tf.float32),
                    trainable=False,
                    name=f"kc_master_{i}",
                )
                for i, _, glayout in grouped
            ]
        # Released before the clone is built on them (it reads their shapes
        # only), and its slots released before the buffers are made, so that
        # creating the state holds one of the three at a time, not their sum.
        self.release_masters()
        with tf.device(device):
            self.inner = config["class"].from_config(config["config"])
            self.inner.build(self.all_masters())
        # Filled from the user's slots (or a checkpoint) when the state takes
        # the slots over; until then they hold no memory.
        for v in self.slot_variables():
            release(v)
        with tf.device(device):
            self.acc = [
                tf.Variable(tf.zeros([size], tf.float32), trainable=False)
                for size in acc_sizes
            ]
            hooked_size = sum(prod(v.shape) for _, v in hooked)
            self.hooked_acc = (
                tf.Variable(tf.zeros([hooked_size], tf.float32), trainable=False)
                if accumulates and hooked_size
                else None
            )
            self.group_acc = (
                tf.Variable(tf.zeros([group_acc_size], tf.float32), trainable=False)
                if group_acc_size
                else None
            )
            self.norms = (
                tf.Variable(tf.zeros([num_norms], tf.float32), trainable=False)
                if num_norms
                else None
            )
            # Set by the host before an update: 1/k for a mean over k micro-batches.
            self.scale = tf.Variable(1.0, trainable=False)
            # Always 0: the buffers are cleared with fills of it, read when the
            # step runs (a constant zero would be folded, see `accumulate.clear`).
            self.zero = tf.Variable(0.0, trainable=False)

    def release_masters(self):
        """Host side, after an update: the masters' memory back to the allocator."""
        for m in self.all_masters():
            release(m)

    def all_masters(self):
        """Masters in update order: plain, hooked (whole), group-sharded."""
        return self.masters + self.hooked_masters + self.grouped_masters

    def slot_variables(self):
        skip = {id(self.inner.iterations)}
        lr = keras_api.learning_rate_variable(self.inner)
        if lr is not None:
            skip.add(id(lr))
        return [v for v in self.inner.variables if id(v) not in skip]

    def nbytes(self):
        """Bytes by kind: this replica's optimizer slots, masters (held while
        an update runs) and accumulation buffers."""
        return {
            "optimizer": sum(_nbytes(v) for v in self.slot_variables()),
            "master": sum(_nbytes(v) for v in self.all_masters()),
            "accumulation": sum(
                _nbytes(v)
                for v in self.acc + [self.hooked_acc, self.group_acc]
                if v is not None
            ),
        }


class ShardedState:
    """The sharded optimizer state of one model, one `ReplicaState` per local replica.

    Args:
        model: a compiled Keras model.
        zero_stage: 0, 1 or 2.
        accumulation_steps: micro-batches per update.
        dump_local_norm: keep each variable's local gradient norm.

    Raises:
        ValueError: if an optimizer slot has no same-size counterpart among
            the user optimizer's slots (checkpoints are written in their names).
    """

    def __init__(self, model, zero_stage, accumulation_steps, dump_local_norm):
        self.model = model
        self.zero_stage = zero_stage
        self.accumulation_steps = accumulation_steps
        self.dump_local_norm = dump_local_norm
        self.strategy = model.distribute_strategy
        self.world = self.strategy.num_replicas_in_sync
        self.all_variables = list(model.trainable_variables)
        hooks = [annotations.gradient_hook(v) for v in self.all_variables]
        self.plain_index = [i for i, h in enumerate(hooks) if h is None]
        self.num_shards = self.world if zero_stage >= 1 else 1
        # Hooked variables with a data group: sharded over it (zero_stage >= 1).
        self.grouped_index, self.group_of = [], []
        if self.num_shards > 1:
            for i, h in enumerate(hooks):
                group_of = data_group(self.all_variables[i]) if h is not None else None
                sizes = (
                    {(group_of(r).size if group_of(r) is not None else 1) for r in range(self.world)}
                    if group_of is not None
                    else set()
                )
                # Every replica's group of one size d > 1 (a mesh axis).
                if len(sizes) == 1 and min(sizes) > 1:
                    self.grouped_index.append(i)
                    self.group_of.append(group_of)
        self.hooked_index = [
            i for i, h in enumerate(hooks) if h is not None and i not in self.grouped_index
        ]
        self.variables = [self.all_variables[i] for i in self.plain_index]
        self.hooked = [self.all_variables[i] for i in self.hooked_index]
        self.hooks = [hooks[i] for i in self.hooked_index]
        self.grouped = [self.all_variables[i] for i in self.grouped_index]
        self.group_layouts = [
            packing.Layout((prod(v.shape),), g(0).size)
            for v, g in zip(self.grouped, self.group_of)
        ]
        self.layout = packing.Layout(
            tuple(prod(v.shape) for v in self.variables), self.num_shards
        )
        self.buckets = accumulate_plan.buckets(self.layout)
        self.optimizer = model.optimizer
        self.lso, self.user_inner = user_optimizers(model.optimizer)
        inner = self.user_inner
        if not inner.built:
            with self.strategy.scope():
                inner.build(self.all_variables)
        config = {"class": type(inner), "config": inner.get_config()}
        # One accumulation buffer per bucket: its packed gradient (zero_stage
        # 0/1) or this replica's shard of it (zero_stage 2).
        acc_sizes = []
        if accumulation_steps > 1:
            for lo, hi in self.buckets:
                sub = self.layout.sub(lo, hi)
                acc_sizes.append(sub.shard_total if zero_stage == 2 else sub.packed_size)
        num_norms = len(self.all_variables) if dump_local_norm else 0
        self.devices = self._local_devices()
        hooked = list(zip(self.hooked_index, self.hooked))
        grouped = list(zip(self.grouped_index, self.grouped, self.group_layouts))
        # zero_stage 1 accumulates the padded full gradient (reduce-scattered
        # at the update), zero_stage 2 the reduce-scattered shard.
        group_acc_size = 0
        if accumulation_steps > 1 and grouped:
            group_acc_size = sum(
                gl.shard_total if zero_stage == 2 else gl.packed_size
                for gl in self.group_layouts
            )

        def create():
            return [
                ReplicaState(d, self.layout, self.plain_index, hooked, config,
                             acc_sizes, num_norms, grouped, group_acc_size,
                             accumulates=accumulation_steps > 1)
                for d in self.devices
            ]

        self.replicas = outside_strategy(create)
        self._scale = 1.0  # what every replica's `scale` holds (see `set_scale`)
        self._by_device = {
            tf_api.canonicalize_device(d): s for d, s in zip(self.devices, self.replicas)
        }
        self._match_slots()
        # Whether the clone's slots hold the optimizer state (and the user's
        # slots of the plain variables are released): from the first step on.
        self.owns_slots = False

    def _local_devices(self):
        if self.world == 1 and not tf.distribute.has_strategy():
            return [tf_api.canonicalize_device(tf_api.current_device() or "/cpu:0")]
        devices = getattr(self.strategy.extended, "worker_devices", None)
        try:
            devices = list(devices) if devices is not None else []
        except RuntimeError:
            devices = []
        return devices or [tf_api.canonicalize_device("/cpu:0")]

    def _match_slots(self):
        """Pairs each clone slot with the user's full-size slot (by name).

        Sets ``self.slot_pairs``: per local replica, ``(sharded, hooked,
        group-sharded)`` lists of ``(clone_slot, user_slot, variable_index)``, and
        ``self.slot_layout``, the layout of the sharded slots.
        """
        user_slots = {}
        skip = {id(self.user_inner.iterations)}
        for v in self.user_inner.variables:
            if id(v) not in skip:
                user_slots[v.name] = v
        plain = set(self.plain_index)
        grouped_set = set(self.grouped_index)
        self.slot_pairs = []
        for state in self.replicas:
            sharded, whole, grouped = [], [], []
            for slot in state.slot_variables():
                prefix, _, rest = slot.name.partition("kc_master_")
                index_text, _, suffix = rest.partition("_")
                if prefix or not index_text.isdigit():
                    raise ValueError(
                        "ParallelOptimizer cannot tell which variable optimizer "
                        f"slot {slot.name!r} belongs to. Received: optimizer="
                        f"{type(self.user_inner).__name__}"
                    )
                i = int(index_text)
                var = self.all_variables[i]
                name = f"{var.path.replace('/', '_')}_{suffix}"
                user = user_slots.get(name)
                if user is None or tuple(user.shape) != tuple(var.shape):
                    raise ValueError(
                        "ParallelOptimizer keeps checkpoints in the optimizer's "
                        "own full-size slots, and needs one slot of the "
                        "variable's shape per slot it shards. Optimizer "
                        f"{type(self.user_inner).__name__} has no slot "
                        f"{name!r} of shape {tuple(var.shape)}. Received: "
                        f"optimizer={type(self.user_inner).__name__}"
                    )
                (sharded if i in plain else grouped if i in grouped_set else whole).append(
                    (slot, user, i)
                )
            self.slot_pairs.append((sharded, whole, grouped))
        sharded = self.slot_pairs[0][0]
        self.slot_layout = packing.Layout(
            tuple(prod(self.all_variables[i].shape) for _, _, i in sharded),
            self.num_shards,
        )

    def matches(self, model, zero_stage, accumulation_steps, dump_local_norm):
        """Whether this state can serve a new fit with these settings."""
        return (
            model is self.model
            and model.optimizer is self.optimizer
            and zero_stage == self.zero_stage
            and (accumulation_steps > 1) == (self.accumulation_steps > 1)
            and bool(dump_local_norm) == bool(self.dump_local_norm)
            and model.distribute_strategy.num_replicas_in_sync == self.world
            and [id(v) for v in model.trainable_variables]
            == [id(v) for v in self.all_variables]
            and [annotations.gradient_hook(v) is not None for v in model.trainable_variables]
            == [
                i in set(self.hooked_index + self.grouped_index)
                for i in range(len(self.all_variables))
            ]
        )

    # --- per replica (inside strategy.run) ----------------------------------

    def current(self):
        """The calling replica's `ReplicaState`."""
        if len(self.replicas) == 1:
            return self.replicas[0]
        return self._by_device[tf_api.canonicalize_device(tf_api.current_device())]

    def current_index(self):
        if len(self.replicas) == 1:
            return 0
        return self.replicas.index(self.current())

    # --- host side ----------------------------------------------------------

    def set_scale(self, value):
        # The factor changes only with a window's length: skipping an equal
        # one saves an eager assign per replica at every update.
        if value == self._scale:
            return
        for s in self.replicas:
            s.scale.assign(value)
        self._scale = value

    def local_norms(self):
        """The first local replica's gradient norms, by variable path."""
        norms = self.replicas[0].norms.numpy()
        return {
            f"local_grad_norm/{v.path}": float(n)
            for v, n in zip(self.all_variables, norms)
        }

    def user_slots(self):
        """The user optimizer's slots that this state shards (and releases)."""
        return [user for _, user, _ in self.slot_pairs[0][0]]

    def grouped_user_slots(self):
        """The user optimizer's slots of group-sharded variables (released too)."""
        return [user for _, user, _ in self.slot_pairs[0][2]]

    def group_layout_of(self, i):
        """The data-group `Layout` of group-sharded variable `i` (model index)."""
        return self.group_layouts[self.grouped_index.index(i)]

    def nbytes(self):
        """Bytes one replica holds for the optimizer, by kind.

        ``optimizer``: the clone's slots plus every slot of the user's
        optimizer that is not released (slots of hooked variables, and any
        slot no clone slot pairs with); ``master``: the float32 masters, held
        while an update runs; ``accumulation``: the gradient buffers. Scalars
        (iterations, learning rate, loss scale) are left out.
        """
        parts = dict(self.replicas[0].nbytes())
        skip = {id(self.user_inner.iterations)}
        lr = keras_api.learning_rate_variable(self.user_inner)
        if lr is not None:
            skip.add(id(lr))
        skip.update(id(u) for u in self.user_slots())
        skip.update(id(u) for u in self.grouped_user_slots())
        parts["optimizer"] += sum(
            _nbytes(v) for v in self.user_inner.variables if id(v) not in skip
        )
        return parts
