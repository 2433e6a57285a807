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

    def __init__(self, device, variables, layout, config, acc_size, num_norms):
        self.device = device
        with tf.device(device):
            self.masters = [
                keras.Variable(
                    tf.zeros([s], tf.float32),
                    trainable=False,
                    name=f"kc_master_{i}",
                )
                for i, s in enumerate(layout.shard_sizes)
            ]
            self.inner = config["class"].from_config(config["config"])
            self.inner.build(self.masters)
            self.acc = (
                tf.Variable(tf.zeros([acc_size], tf.float32), trainable=False)
                if acc_size
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
            "master": sum(_nbytes(v) for v in self.masters),
            "accumulation": _nbytes(self.acc) if self.acc is not None else 0,
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
    """

    def __init__(self, model, zero_stage, accumulation_steps, dump_local_norm):
        self.model = model
        self.zero_stage = zero_stage
        self.accumulation_steps = accumulation_steps
        self.dump_local_norm = dump_local_norm
        self.strategy = model.distribute_strategy
        self.world = self.strategy.num_replicas_in_sync
        self.variables = list(model.trainable_variables)
        sizes = [_prod(v.shape) for v in self.variables]
        self.num_shards = self.world if zero_stage >= 1 else 1
        self.layout = _sharding.Layout(tuple(sizes), self.num_shards)
        # The layout the gradient travels in (stage 0: plain concatenation).
        self.lso, self.user_inner = user_optimizers(model.optimizer)
        inner = self.user_inner
        config = {"class": type(inner), "config": inner.get_config()}
        if zero_stage == 2:
            acc_size = self.layout.shard_total if accumulation_steps > 1 else 0
        else:
            acc_size = self.layout.packed_size if accumulation_steps > 1 else 0
        num_norms = len(self.variables) if dump_local_norm else 0
        self.devices = self._local_devices()

        def create():
            return [
                _ReplicaState(d, self.variables, self.layout, config, acc_size, num_norms)
                for d in self.devices
            ]

        self.states = outside_strategy(create)
        self._by_device = {
            device_util.canonicalize(d): s for d, s in zip(self.devices, self.states)
        }

    def _local_devices(self):
        if self.world == 1 and not tf.distribute.has_strategy():
            return [device_util.canonicalize(device_util.current() or "/cpu:0")]
        devices = getattr(self.strategy.extended, "worker_devices", None)
        try:
            devices = list(devices) if devices is not None else []
        except RuntimeError:
            devices = []
        return devices or [device_util.canonicalize("/cpu:0")]

    def matches(self, model, zero_stage, accumulation_steps, dump_local_norm):
        """Whether this engine's state can serve a new fit with these settings."""
        return (
            model is self.model
            and zero_stage == self.zero_stage
            and (accumulation_steps > 1) == (self.accumulation_steps > 1)
            and bool(dump_local_norm) == bool(self.dump_local_norm)
            and model.distribute_strategy.num_replicas_in_sync == self.world
            and [id(v) for v in model.trainable_variables]
            == [id(v) for v in self.variables]
        )

    # --- per replica ------------------------------------------------------

    def _state(self):
        if len(self.states) == 1:
            return self.states[0]
        return self._by_device[device_util.canonicalize(device_util.current())]

    def _call(self):
        return _collective.resolve(name=COLLECTIVE_NAME)

    def _forward(self, data):
        """Loss, gradients and metrics of one micro-batch on this replica."""
        return forward(self.model, data)

    def _packed(self, grads):
        return _sharding.pack(grads, self.layout, tf.float32)

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
        """What one micro-batch adds to the accumulation buffer."""
        packed = self._packed(grads)
        if self.zero_stage == 2:
            return self._reduce_scatter(packed)
        return packed

    def micro_step(self, data):
        """Forward, backward and local accumulation: no gradient collective
        (except zero_stage 2's reduce-scatter)."""
        grads, logs = self._forward(data)
        state = self._state()
        self._record_norms(state, grads)
        state.acc.assign_add(self._contribution(grads))
        return logs

    def apply_step(self, data):
        """Forward, backward, then reduce and apply the accumulated update."""
        grads, logs = self._forward(data)
        state = self._state()
        self._record_norms(state, grads)
        contribution = self._contribution(grads)
        if state.acc is not None:
            contribution = state.acc.read_value() + contribution
        self._update(state, contribution)
        return logs

    def flush_step(self):
        """Reduce and apply what is accumulated, with no new micro-batch."""
        state = self._state()
        self._update(state, state.acc.read_value())
        return tf.constant(0)

    def _update(self, state, contribution):
        call = self._call()
        rank = call.replica.rank
        if state.acc is not None:
            with tf.control_dependencies([contribution]):
                state.acc.assign(tf.zeros_like(state.acc))
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
        total = total * state.scale.read_value()
        shard_index = rank if self.num_shards > 1 else 0
        grads = _sharding.split_shards(total, self.layout)
        # 2. Masters from the current weights.
        for master, piece in zip(
            state.masters,
            _sharding.local_shards(
                [v.value for v in self.variables], self.layout, shard_index, tf.float32
            ),
        ):
            master.assign(piece)
        # 3. The optimizer update, on this replica's shard.
        if self.lso is not None:
            scale = tf.cast(self.lso.dynamic_scale, tf.float32)
            grads = [g / scale for g in grads]
            finite = tf.reduce_all([tf.reduce_all(tf.math.is_finite(g)) for g in grads])
            if self.num_shards > 1 and not call.trivial:
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
        if self.num_shards > 1:
            shards = tf.concat([m.value for m in state.masters], 0)
            gathered = _collective.run(lambda: _collective.all_gather(shards, call))
            new = _sharding.unpack(
                gathered, self.layout, [v.shape for v in self.variables]
            )
        else:
            new = [
                tf.reshape(m.value, v.shape) for m, v in zip(state.masters, self.variables)
            ]
        for v, value in zip(self.variables, new):
            value = tf.cast(value, v.dtype)
            if v.constraint is not None:
                value = v.constraint(value)
            local_variable(v).assign(value)

    def _apply(self, state, grads):
        user = self.user_inner
        lr = tf.cast(user._get_current_learning_rate(), tf.float32)
        state.inner.iterations.assign(tf.cast(user.iterations, state.inner.iterations.dtype))
        if self.num_shards == 1:
            grads = user._clip_gradients(grads)
        elif user.clipvalue:
            grads = [tf.clip_by_value(g, -user.clipvalue, user.clipvalue) for g in grads]
        if user.weight_decay:
            wd = tf.cast(user.weight_decay, tf.float32)
            for master, v in zip(state.masters, self.variables):
                if user._use_weight_decay(v):
                    master.assign_sub(master.value * wd * lr)
        for g, master in zip(grads, state.masters):
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

    # --- host side --------------------------------------------------------

    def set_scale(self, value):
        for s in self.states:
            s.scale.assign(value)

    def local_norms(self):
        """The first local replica's gradient norms, by variable path."""
        norms = self.states[0].norms.numpy()
        return {
            f"local_grad_norm/{v.path}": float(n) for v, n in zip(self.variables, norms)
        }

    def nbytes(self):
        return self.states[0].nbytes()


def forward(model, data):
    """Per-replica loss, gradients and metric logs; the default train step
    without the update (as keras_comm.compat's `train_step` computes them)."""
    from keras.src import tree
    from keras.src.losses import loss as loss_module
    from keras.src.trainers.data_adapters import data_adapter_utils

    from keras_comm import compat

    x, y, sample_weight = data_adapter_utils.unpack_x_y_sample_weight(data)
    with tf.GradientTape() as tape:
        if model._call_has_training_arg:
            y_pred = model(x, training=True)
        else:
            y_pred = model(x)
        loss = model._compute_loss(
            x=x, y=y, y_pred=y_pred, sample_weight=sample_weight, training=True
        )
        batch_size = tf.shape(next(i for i in tree.flatten(x) if i is not None))[0]
        model._loss_tracker.update_state(
            loss_module.unscale_loss_for_distribution(loss), sample_weight=batch_size
        )
        # The exact global-batch weight of keras_comm.compat, when present.
        global_batch_weight = getattr(compat, "_global_batch_weight", None)
        if global_batch_weight is not None and compat.is_applied():
            weight = global_batch_weight(batch_size, loss.dtype)
            if weight is not None:
                loss = loss * weight
        loss = model.optimizer.scale_loss(loss)
    variables = model.trainable_variables
    grads = tape.gradient(loss, variables)
    grads = [
        tf.zeros(v.shape, tf.float32) if g is None else tf.cast(tf.convert_to_tensor(g), tf.float32)
        for g, v in zip(grads, variables)
    ]
    logs = model.compute_metrics(x, y, y_pred, sample_weight=sample_weight)
    return grads, logs
