"""The per-replica step pieces behind `ParallelOptimizer`.

State lives in plain (non-distributed) TensorFlow variables, one set per
local replica device, created outside any strategy scope so that
MultiWorkerMirroredStrategy neither mirrors nor broadcasts them (DESIGN §2):

* ``masters``: this replica's flat float32 shard of every trainable variable
  (the whole variable for zero_stage 0). They are refreshed from the model's
  weights at each update, so `set_weights`/`load_weights` between steps are
  honoured and the model's (float32) weights stay the source of truth.
* ``inner``: a clone of the user's optimizer built on the masters, so its
  slots (Adam moments, momentum, ...) are shard-sized. Only its
  ``update_step`` maths is used; learning rate, iterations, weight decay,
  clipping and loss scaling are taken from the user's optimizer, whose own
  state (iterations, loss scale) advances exactly as without the callback.
* ``acc``: the gradient accumulation buffer: the packed full gradient
  (zero_stage 0/1) or this replica's reduce-scattered shard (zero_stage 2);
  absent when nothing is accumulated.

Variables that carry their own gradient reduction (the
``_keras_comm_reduce_gradient`` hook of `keras_comm.compat`: sharded weights of
`keras_comm.parallel`, or weights marked with `compat.mark_gradient_reduced`
because a comm layer already reduced their gradient) are left out of the
world-wide reduction and out of the sharding: their gradient goes through
their hook once per update and they are updated whole, each replica on its
own value (``hooked_masters``, ``hooked_acc``).

Checkpoints: the user's optimizer, built by `fit` on the model's variables,
keeps full-size slots that the update never uses. They are the checkpoint
container: `gather_slots` all-gathers every replica's slot shards into them
(so `save_weights`, `ModelCheckpoint` and `BackupAndRestore` save the real
optimizer state in standard Keras format) and `reshard_slots` cuts this
replica's shard back out of them (after a restore, whatever the worker count
that saved it). Slots are matched by name: the clone's slot
``kc_master_<i>_<slot>`` is the user's ``<path of variable i>_<slot>``.

Collectives are keras_comm primitives named ``parallel_optimizer_*`` (tests
count them in the traced graphs). Per update: zero_stage 0 one all-reduce of
the packed gradient; zero_stage 1 one reduce-scatter plus one all-gather
(together the bytes of one all-reduce); zero_stage 2 one reduce-scatter per
micro-step plus one all-gather per update. Loss scaling with a sharded
gradient adds one scalar all-reduce (the global "all finite" flag).
"""

import concurrent.futures

import keras
import tensorflow as tf
from tensorflow.python.distribute import device_util

from keras_comm import topology
from keras_comm.callbacks import _sharding
from keras_comm.ops import _collective

COLLECTIVE_NAME = "parallel_optimizer"


def local_variable(variable):
    """The tf.Variable of `variable` (a Keras variable) on the current device.

    Under a strategy a Keras variable wraps a DistributedVariable; updating
    the current replica's component directly (every replica writes the same
    value) avoids a merge_call per variable.
    """
    v = variable.value if isinstance(variable, keras.Variable) else variable
    get_local = getattr(v, "_get_on_device_or_primary", None)
    return get_local() if get_local is not None else v


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


def _is_low_precision(dtype):
    return keras.backend.standardize_dtype(dtype) in ("float16", "bfloat16")


class _ReplicaState:
    """Variables one local replica holds (see the module docstring)."""

    def __init__(self, device, layout, plain_index, hooked, config, acc_size, num_norms):
        self.device = device
        with tf.device(device):
            self.masters = [
                keras.Variable(
                    tf.zeros([s], tf.float32),
                    trainable=False,
                    name=f"kc_master_{i}",
                )
                for i, s in zip(plain_index, layout.shard_sizes)
            ]
            self.hooked_masters = [
                keras.Variable(
                    tf.zeros([_prod(v.shape)], tf.float32),
                    trainable=False,
                    name=f"kc_master_{i}",
                )
                for i, v in hooked
            ]
            self.inner = config["class"].from_config(config["config"])
            self.inner.build(self.masters + self.hooked_masters)
            self.acc = (
                tf.Variable(tf.zeros([acc_size], tf.float32), trainable=False)
                if acc_size and layout.sizes
                else None
            )
            hooked_size = sum(_prod(v.shape) for _, v in hooked)
            self.hooked_acc = (
                tf.Variable(tf.zeros([hooked_size], tf.float32), trainable=False)
                if acc_size and hooked_size
                else None
            )
            self.norms = (
                tf.Variable(tf.zeros([num_norms], tf.float32), trainable=False)
                if num_norms
                else None
            )
            # Set by the host before an update: 1/k for a mean over k micro-batches.
            self.scale = tf.Variable(1.0, trainable=False)

    def slot_variables(self):
        skip = {id(self.inner.iterations)}
        lr = getattr(self.inner, "_learning_rate", None)
        if isinstance(lr, keras.Variable):
            skip.add(id(lr))
        return [v for v in self.inner.variables if id(v) not in skip]

    def nbytes(self):
        """Bytes by kind: optimizer slots, masters and accumulation buffer."""

        return {
            "optimizer": sum(_nbytes(v) for v in self.slot_variables()),
            "master": sum(_nbytes(v) for v in self.masters + self.hooked_masters),
            "accumulation": sum(
                _nbytes(v) for v in (self.acc, self.hooked_acc) if v is not None
            ),
        }


def _nbytes(v):
    return _prod(v.shape) * tf.as_dtype(v.dtype).size


def _prod(shape):
    out = 1
    for d in shape:
        out *= int(d)
    return out


class Engine:
    """Sharded optimizer state of one model and the per-replica step maths.

    Args:
        model: a compiled Keras model.
        zero_stage: 0, 1 or 2.
        accumulation_steps: micro-batches per update.
        dump_local_norm: keep each variable's local gradient norm.

    Raises:
        ValueError: if an optimizer slot has no same-size counterpart among
            the user optimizer's slots (the checkpoint container).
    """

    def __init__(self, model, zero_stage, accumulation_steps, dump_local_norm):
        from keras_comm import compat

        self.model = model
        self.zero_stage = zero_stage
        self.accumulation_steps = accumulation_steps
        self.dump_local_norm = dump_local_norm
        self.strategy = model.distribute_strategy
        self.world = self.strategy.num_replicas_in_sync
        self.all_variables = list(model.trainable_variables)
        hooks = [compat.gradient_hook(v) for v in self.all_variables]
        self.plain_index = [i for i, h in enumerate(hooks) if h is None]
        self.hooked_index = [i for i, h in enumerate(hooks) if h is not None]
        self.variables = [self.all_variables[i] for i in self.plain_index]
        self.hooked = [self.all_variables[i] for i in self.hooked_index]
        self.hooks = [hooks[i] for i in self.hooked_index]
        sizes = [_prod(v.shape) for v in self.variables]
        self.num_shards = self.world if zero_stage >= 1 else 1
        self.layout = _sharding.Layout(tuple(sizes), self.num_shards)
        self.lso, self.user_inner = user_optimizers(model.optimizer)
        inner = self.user_inner
        if not inner.built:
            with self.strategy.scope():
                inner.build(self.all_variables)
        config = {"class": type(inner), "config": inner.get_config()}
        if zero_stage == 2:
            acc_size = self.layout.shard_total if accumulation_steps > 1 else 0
        else:
            acc_size = self.layout.packed_size if accumulation_steps > 1 else 0
        num_norms = len(self.all_variables) if dump_local_norm else 0
        self.devices = self._local_devices()
        hooked = list(zip(self.hooked_index, self.hooked))

        def create():
            return [
                _ReplicaState(d, self.layout, self.plain_index, hooked, config,
                              acc_size, num_norms)
                for d in self.devices
            ]

        self.states = outside_strategy(create)
        self._by_device = {
            device_util.canonicalize(d): s for d, s in zip(self.devices, self.states)
        }
        self._match_slots()

    def _local_devices(self):
        if self.world == 1 and not tf.distribute.has_strategy():
            return [device_util.canonicalize(device_util.current() or "/cpu:0")]
        devices = getattr(self.strategy.extended, "worker_devices", None)
        try:
            devices = list(devices) if devices is not None else []
        except RuntimeError:
            devices = []
        return devices or [device_util.canonicalize("/cpu:0")]

    def _match_slots(self):
        """Pairs each clone slot with the user's full-size slot (by name).

        Sets ``self.slot_pairs``: per local replica, ``(sharded, hooked)``
        lists of ``(clone_slot, user_slot, variable_index)``, and
        ``self.slot_layout``, the layout of the sharded slots.
        """
        user_slots = {}
        skip = {id(self.user_inner.iterations)}
        for v in self.user_inner.variables:
            if id(v) not in skip:
                user_slots[v.name] = v
        plain = set(self.plain_index)
        self.slot_pairs = []
        for state in self.states:
            sharded, whole = [], []
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
                (sharded if i in plain else whole).append((slot, user, i))
            self.slot_pairs.append((sharded, whole))
        sharded = self.slot_pairs[0][0]
        self.slot_layout = _sharding.Layout(
            tuple(_prod(self.all_variables[i].shape) for _, _, i in sharded),
            self.num_shards,
        )

    def matches(self, model, zero_stage, accumulation_steps, dump_local_norm):
        """Whether this engine's state can serve a new fit with these settings."""
        from keras_comm import compat

        return (
            model is self.model
            and zero_stage == self.zero_stage
            and (accumulation_steps > 1) == (self.accumulation_steps > 1)
            and bool(dump_local_norm) == bool(self.dump_local_norm)
            and model.distribute_strategy.num_replicas_in_sync == self.world
            and [id(v) for v in model.trainable_variables]
            == [id(v) for v in self.all_variables]
            and [compat.gradient_hook(v) is not None for v in model.trainable_variables]
            == [i in set(self.hooked_index) for i in range(len(self.all_variables))]
        )

    # --- per replica ------------------------------------------------------

    def _state(self):
        if len(self.states) == 1:
            return self.states[0]
        return self._by_device[device_util.canonicalize(device_util.current())]

    def _state_index(self):
        if len(self.states) == 1:
            return 0
        return self.states.index(self._state())

    def _call(self):
        return _collective.resolve(name=COLLECTIVE_NAME)

    def _forward(self, data):
        """Loss, gradients and metrics of one micro-batch on this replica."""
        return forward(self.model, data)

    def _split(self, grads):
        """``(plain, hooked)`` gradient lists, in variable order."""
        return [grads[i] for i in self.plain_index], [grads[i] for i in self.hooked_index]

    def _reduce_scatter(self, packed):
        call = self._call()
        if call.trivial:
            return packed
        return _collective.run(lambda: _collective.reduce_scatter(packed, call))

    def _record_norms(self, state, grads):
        if state.norms is not None:
            state.norms.assign(
                tf.stack([tf.norm(tf.cast(g, tf.float32)) for g in grads])
            )

    def _contribution(self, grads):
        """What one micro-batch adds to the accumulation buffers:
        ``(plain or None, hooked or None)``."""
        plain, hooked = self._split(grads)
        packed = None
        if plain:
            packed = _sharding.pack(plain, self.layout, tf.float32)
            if self.zero_stage == 2:
                packed = self._reduce_scatter(packed)
        flat = None
        if hooked:
            flat = tf.concat([tf.reshape(g, [-1]) for g in hooked], 0)
        return packed, flat

    def micro_step(self, data):
        """Forward, backward and local accumulation: no gradient collective
        (except zero_stage 2's reduce-scatter)."""
        grads, logs = self._forward(data)
        state = self._state()
        self._record_norms(state, grads)
        packed, flat = self._contribution(grads)
        if packed is not None:
            state.acc.assign_add(packed)
        if flat is not None:
            state.hooked_acc.assign_add(flat)
        return logs

    def apply_step(self, data):
        """Forward, backward, then reduce and apply the accumulated update."""
        grads, logs = self._forward(data)
        state = self._state()
        self._record_norms(state, grads)
        packed, flat = self._contribution(grads)
        if state.acc is not None:
            packed = state.acc.read_value() + packed
        if state.hooked_acc is not None:
            flat = state.hooked_acc.read_value() + flat
        self._update(state, packed, flat)
        return logs

    def flush_step(self):
        """Reduce and apply what is accumulated, with no new micro-batch."""
        state = self._state()
        self._update(
            state,
            state.acc.read_value() if state.acc is not None else None,
            state.hooked_acc.read_value() if state.hooked_acc is not None else None,
        )
        return tf.constant(0)

    def _update(self, state, contribution, hooked_contribution):
        call = self._call()
        rank = call.replica.rank
        for acc, c in ((state.acc, contribution), (state.hooked_acc, hooked_contribution)):
            if acc is not None:
                with tf.control_dependencies([c]):
                    acc.assign(tf.zeros_like(acc))
        scale = state.scale.read_value()
        grads = []
        if self.variables:
            # 1. The summed gradient, this replica's shard of it.
            if self.zero_stage == 0:
                if call.trivial:
                    total = contribution
                else:
                    total = _collective.run(
                        lambda: _collective.all_reduce(contribution, call)
                    )
            elif self.zero_stage == 1:
                total = self._reduce_scatter(contribution)
            else:
                total = contribution
            shard_index = rank if self.num_shards > 1 else 0
            grads = _sharding.split_shards(total * scale, self.layout)
            # 2. Masters from the current weights.
            for master, piece in zip(
                state.masters,
                _sharding.local_shards(
                    [v.value for v in self.variables], self.layout, shard_index, tf.float32
                ),
            ):
                master.assign(piece)
        # Variables with their own reduction: each through its hook, whole.
        if self.hooked:
            pieces = tf.split(hooked_contribution, [_prod(v.shape) for v in self.hooked])
            for piece, v, hook, master in zip(
                pieces, self.hooked, self.hooks, state.hooked_masters
            ):
                reduced = hook(tf.reshape(piece, v.shape))
                grads.append(tf.reshape(tf.cast(reduced, tf.float32), [-1]) * scale)
                master.assign(
                    tf.reshape(tf.cast(local_variable(v).read_value(), tf.float32), [-1])
                )
        # 3. The optimizer update, on this replica's shard.
        if self.lso is not None:
            loss_scale = tf.cast(self.lso.dynamic_scale, tf.float32)
            grads = [g / loss_scale for g in grads]
            finite = tf.reduce_all([tf.reduce_all(tf.math.is_finite(g)) for g in grads])
            if (self.num_shards > 1 or self.hooked) and not call.trivial:
                flag = tf.cast(finite, tf.float32)
                flag = _collective.run(
                    lambda: _collective.all_reduce(flag, call, op="min")
                )
                finite = flag > 0.5
            tf.cond(
                finite,
                lambda: self._finite_update(state, grads),
                lambda: self._non_finite_update(),
            )
        else:
            self._apply(state, grads)
        # 4. Full weights back on every replica.
        if self.variables:
            if self.num_shards > 1:
                shards = tf.concat([m.value for m in state.masters], 0)
                gathered = _collective.run(lambda: _collective.all_gather(shards, call))
                new = _sharding.unpack(
                    gathered, self.layout, [v.shape for v in self.variables]
                )
            else:
                new = [
                    tf.reshape(m.value, v.shape)
                    for m, v in zip(state.masters, self.variables)
                ]
            for v, value in zip(self.variables, new):
                self._write(v, value)
        for v, m in zip(self.hooked, state.hooked_masters):
            self._write(v, tf.reshape(m.value, v.shape))

    @staticmethod
    def _write(v, value):
        value = tf.cast(value, v.dtype)
        if v.constraint is not None:
            value = v.constraint(value)
        local_variable(v).assign(value)

    def _apply(self, state, grads):
        user = self.user_inner
        masters = state.masters + state.hooked_masters
        lr = tf.cast(user._get_current_learning_rate(), tf.float32)
        state.inner.iterations.assign(tf.cast(user.iterations, state.inner.iterations.dtype))
        if self.num_shards == 1 and not self.hooked:
            grads = user._clip_gradients(grads)
        elif user.clipvalue:
            grads = [tf.clip_by_value(g, -user.clipvalue, user.clipvalue) for g in grads]
        if user.weight_decay:
            wd = tf.cast(user.weight_decay, tf.float32)
            for master, v in zip(masters, self.variables + self.hooked):
                if user._use_weight_decay(v):
                    master.assign_sub(master.value * wd * lr)
        for g, master in zip(grads, masters):
            state.inner.update_step(g, master, lr)
        local_variable(user.iterations).assign_add(1)
        return tf.constant(True)

    def _finite_update(self, state, grads):
        self._apply(state, grads)
        counter = local_variable(self.lso.step_counter)
        scale = local_variable(self.lso.dynamic_scale)
        grow = tf.equal(counter, self.lso.dynamic_growth_steps - 1)
        counter.assign(tf.where(grow, tf.zeros_like(counter), counter + 1))
        scale.assign(tf.where(grow, scale * 2.0, scale))
        return tf.constant(True)

    def _non_finite_update(self):
        counter = local_variable(self.lso.step_counter)
        scale = local_variable(self.lso.dynamic_scale)
        counter.assign(tf.zeros_like(counter))
        scale.assign(scale * 0.5)
        return tf.constant(False)

    # --- checkpoint container ---------------------------------------------

    def gather_slots(self):
        """Writes every replica's slot shards into the user's full-size slots.

        One all-gather (zero_stage >= 1 with several replicas); identical
        full values on every replica afterwards. Slots of hooked variables
        are copied whole, each replica its own.
        """
        sharded, whole = self.slot_pairs[self._state_index()]
        if sharded:
            local = tf.concat([tf.cast(s.value, tf.float32) for s, _, _ in sharded], 0)
            call = self._call()
            if self.num_shards > 1 and not call.trivial:
                packed = _collective.run(lambda: _collective.all_gather(local, call))
            else:
                packed = local
            full = _sharding.unpack(
                packed, self.slot_layout, [u.shape for _, u, _ in sharded]
            )
            for (_, user, _), value in zip(sharded, full):
                local_variable(user).assign(tf.cast(value, user.dtype))
        for slot, user, _ in whole:
            local_variable(user).assign(tf.cast(tf.reshape(slot.value, user.shape), user.dtype))
        return tf.constant(0)

    def reshard_slots(self):
        """Cuts this replica's slot shards out of the user's full-size slots
        (the inverse of `gather_slots`; no communication)."""
        sharded, whole = self.slot_pairs[self._state_index()]
        shard_index = self._call().replica.rank if self.num_shards > 1 else 0
        if sharded:
            pieces = _sharding.local_shards(
                [local_variable(u).read_value() for _, u, _ in sharded],
                self.slot_layout,
                shard_index,
                tf.float32,
            )
            for (slot, _, _), piece in zip(sharded, pieces):
                slot.assign(tf.cast(piece, slot.dtype))
        for slot, user, _ in whole:
            slot.assign(tf.cast(tf.reshape(local_variable(user).read_value(), [-1]), slot.dtype))
        return tf.constant(0)

    # --- host side --------------------------------------------------------

    def set_scale(self, value):
        for s in self.states:
            s.scale.assign(value)

    def local_norms(self):
        """The first local replica's gradient norms, by variable path."""
        norms = self.states[0].norms.numpy()
        return {
            f"local_grad_norm/{v.path}": float(n)
            for v, n in zip(self.all_variables, norms)
        }

    def nbytes(self):
        return self.states[0].nbytes()


def forward(model, data):
    """Per-replica gradients (float32, zeros for None) and metric logs: the
    default train step without the reduction and the update."""
    from keras_comm import compat

    grads, logs = compat.train_step_gradients(model, data)
    grads = [
        tf.zeros(v.shape, tf.float32)
        if g is None
        else tf.cast(tf.convert_to_tensor(g), tf.float32)
        for g, v in zip(grads, model.trainable_variables)
    ]
    return grads, logs
