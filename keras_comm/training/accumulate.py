"""The accumulate/shard step: gradient accumulation and ZeRO-1/2 (`ParallelOptimizer`).

The replica steps `ParallelOptimizer` compiles through
`keras_comm.training.step`. A gradient's path, top to bottom:

1. `forward` (`keras_comm.training.replicated.forward`): this replica's
   gradients, float32, zeros for None.
2. `_contribution`: packed shard-major (`keras_comm.training.accumulate_plan`);
   zero_stage 2 reduce-scatters it at once. A micro step adds it to the
   accumulation buffer and stops there.
3. `_update` (apply step, or flush at an epoch end): the accumulated sum
   reduced over the replicas -- all-reduce (zero_stage 0), reduce-scatter
   (zero_stage 1) or already done (zero_stage 2) -- scaled by 1/k for a mean
   over k micro-batches; hooked variables through their own reduction
   (`keras_comm.training.reduction`), group-sharded ones (a pipeline stage
   buffer under zero_stage >= 1, see `optimizer_shards`) reduce-scattered over
   their data group instead.
4. `apply_update`: unscale and check the loss scale, clip, decay, and the
   optimizer maths on this replica's shard of the masters. No collectives.
5. The full weights back on every replica (one all-gather when sharded).

State (masters, slots, buffers) lives in `optimizer_shards.ShardedState`; the
masters are filled at step 2 and released at the end of the update, and
`ExternalSlots` serves the (released) user optimizer's slots to
checkpoints.
Collectives are keras_comm primitives named ``parallel_optimizer_*``, so a
traced graph shows which are the callback's. Per update: zero_stage 0 one all-reduce of
the packed gradient; zero_stage 1 one reduce-scatter plus one all-gather
(together the bytes of one all-reduce); zero_stage 2 one reduce-scatter per
micro-step plus one all-gather per update. Loss scaling with a sharded
gradient adds one scalar all-reduce (the global "all finite" flag).
"""

import numpy as np
import tensorflow as tf

from keras_comm._private import keras_api
from keras_comm.ops import _collective
from keras_comm.training import nontrainable
from keras_comm.training import pipeline
from keras_comm.training import replicated
from keras_comm.training import optimizer_shards
from keras_comm.training import step
from keras_comm.training.optimizer_shards import ShardedState
from keras_comm.training.optimizer_shards import fill
from keras_comm.training.optimizer_shards import local_variable
from keras_comm.training.optimizer_shards import prod
from keras_comm.training.optimizer_shards import release_in_step
from keras_comm.parallel import _collectives
from keras_comm.variables import annotations
from keras_comm.variables import packing

COLLECTIVE_NAME = "parallel_optimizer"


def forward(model, data):
    """Per-replica gradients (float32, zeros for None) and metric logs: the
    default train step without the reduction and the update."""
    # A model ending in a 1F1B Pipeline: its step's forward runs the interleaved table.
    result = (pipeline.forward if pipeline.applies(model) else replicated.forward)(model, data)
    grads = [
        tf.zeros(v.shape, tf.float32)
        if g is None
        else tf.cast(tf.convert_to_tensor(g), tf.float32)
        for g, v in zip(result.grads, model.trainable_variables)
    ]
    return grads, result


def apply_update(user, inner, masters, grads, variables, whole_gradients):
    """One optimizer update of `masters` by `grads`: the user's optimizer's rules.

    Learning rate, iterations, clipping and weight decay come from `user`
    (the user's optimizer); the slot maths from `inner` (its clone on the
    masters). No collectives: `grads` are already reduced.

    Args:
        user: the optimizer doing the maths (inside any LossScaleOptimizer).
        inner: its clone built on `masters`.
        masters: float32 master variables, one per gradient.
        grads: float32 gradients (or gradient shards), already reduced.
        variables: the model variable of each master (for weight decay's
            exclusion rules).
        whole_gradients: whether `grads` are whole gradients (norm clipping
            needs them; with shards only clipvalue applies).
    """
    lr = tf.cast(keras_api.current_learning_rate(user), tf.float32)
    inner.iterations.assign(tf.cast(user.iterations, inner.iterations.dtype))
    if whole_gradients:
        grads = keras_api.clip_gradients(user, grads)
    elif user.clipvalue:
        grads = [tf.clip_by_value(g, -user.clipvalue, user.clipvalue) for g in grads]
    if user.weight_decay:
        wd = tf.cast(user.weight_decay, tf.float32)
        for master, v in zip(masters, variables):
            if keras_api.uses_weight_decay(user, v):
                master.assign_sub(master.value * wd * lr)
    for g, master in zip(grads, masters):
        inner.update_step(g, master, lr)
    local_variable(user.iterations).assign_add(1)
    return tf.constant(True)


def clear(buffer, zero):
    """Sets `buffer`, a tf.Variable, to zeros made when the step runs.

    [Note: clearing a buffer] ``v.assign(tf.zeros_like(v))`` in a compiled
    step clears `v` with a constant: Grappler folds the zeros of a fully
    known shape into a `Const` node, whose tensor the function keeps for its
    lifetime, and the assigned variable shares that tensor's buffer. The
    next ``assign_add`` cannot update a shared buffer in place and copies
    it, so a cleared buffer is held twice from the next micro step on (the
    constant and the variable's copy). A fill of `zero`, a scalar variable
    holding 0, cannot be folded (its value is read when the step runs): the
    zeros are made at run time, the variable adopts their buffer, and later
    adds update it in place. (A strided-slice assignment of a scalar zero
    would write in place, but it puts the variable in copy-on-read mode:
    every later read and add copies it. `Empty` is stateful: automatic
    control dependencies chain it with the step's other stateful ops that
    take no resource, such as a pipeline's sends and receives, and a
    pipeline step under this callback then waits forever.)
    """
    value = tf.cast(zero.read_value(), buffer.dtype)
    return buffer.assign(tf.fill(buffer.shape.as_list(), value))


def grow_loss_scale(lso):
    """A finite step of dynamic loss scaling: count, and double every N steps."""
    counter = local_variable(lso.step_counter)
    scale = local_variable(lso.dynamic_scale)
    grow = tf.equal(counter, lso.dynamic_growth_steps - 1)
    counter.assign(tf.where(grow, tf.zeros_like(counter), counter + 1))
    scale.assign(tf.where(grow, scale * 2.0, scale))


def shrink_loss_scale(lso):
    """A non-finite step of dynamic loss scaling: reset the count, halve the scale."""
    counter = local_variable(lso.step_counter)
    scale = local_variable(lso.dynamic_scale)
    counter.assign(tf.zeros_like(counter))
    scale.assign(scale * 0.5)
    return tf.constant(False)


class AccumulateStep:
    """The replica steps of the accumulate/shard policy, over a `ShardedState`.

    Args: those of `ShardedState`.
    """

    def __init__(self, model, zero_stage, accumulation_steps, dump_local_norm):
        self.state = ShardedState(model, zero_stage, accumulation_steps, dump_local_norm)
        # The `ExternalSlots` serving checkpoints once the state owns the slots.
        self.external = None

    def matches(self, *args):
        """Whether this step's state can serve a new fit (see `ShardedState.matches`)."""
        return self.state.matches(*args)

    # --- replica steps ------------------------------------------------------

    def micro_step(self, data):
        """Forward, backward and local accumulation: no gradient collective
        (except zero_stage 2's reduce-scatter)."""
        grads, result = forward(self.state.model, data)
        replica = self.state.current()
        self._record_norms(replica, grads)
        plain, flat, grouped = self._contribution(grads)
        added = self._accumulate(replica, plain)
        if flat is not None:
            replica.hooked_acc.assign_add(flat)
        if grouped is not None:
            replica.group_acc.assign_add(grouped)
        nontrainable.sync(self.state.model, after=added + [flat, grouped])
        return result.metrics(self.state.model)

    def apply_step(self, data):
        """Forward, backward, then reduce and apply the accumulated update."""
        grads, result = forward(self.state.model, data)
        replica = self.state.current()
        self._record_norms(replica, grads)
        plain, flat, grouped = self._contribution(grads)
        if replica.acc:
            # This micro-batch joins the buffers, each bucket in place; the
            # update then reads the buffers a bucket at a time.
            self._accumulate(replica, plain)
            plain = _Accumulated(replica.acc)
        if replica.hooked_acc is not None:
            flat = replica.hooked_acc.read_value() + flat
        if replica.group_acc is not None:
            grouped = replica.group_acc.read_value() + grouped
        self._update(replica, plain, flat, grouped)
        nontrainable.sync(self.state.model)
        return result.metrics(self.state.model)

    def flush_step(self):
        """Reduce and apply what is accumulated, with no new micro-batch."""
        replica = self.state.current()
        self._update(
            replica,
            _Accumulated(replica.acc) if replica.acc else None,
            replica.hooked_acc.read_value() if replica.hooked_acc is not None else None,
            replica.group_acc.read_value() if replica.group_acc is not None else None,
        )
        return tf.constant(0)

    # --- the gradient's path ------------------------------------------------

    def _call(self):
        return _collective.resolve(name=COLLECTIVE_NAME)

    def _reduce_scatter(self, packed):
        call = self._call()
        if call.trivial:
            return packed
        return _collective.run(lambda: _collective.reduce_scatter(packed, call))

    def _group_call(self, k):
        """The collective call over group-sharded variable k's data group."""
        s = self.state
        rank = self._call().replica.rank
        return _collective.resolve(group=s.group_of[k](rank), name=COLLECTIVE_NAME)

    def _record_norms(self, replica, grads):
        if replica.norms is not None:
            replica.norms.assign(
                tf.stack([tf.norm(tf.cast(g, tf.float32)) for g in grads])
            )

    def _contribution(self, grads):
        """What one micro-batch contributes: ``(plain, hooked, group-sharded)``,
        each None when there is none.

        Plain gradients: for zero_stage 2 their reduce-scattered shards, one
        per bucket, issued at once (`_reversed`); for zero_stage 0/1 the list
        of gradients itself, packed one bucket at a time where it is used
        (`_bucket`): no full-size packed copy. Hooked gradients are
        flattened; group-sharded ones flattened and padded to a multiple of
        their group's size d, and reduce-scattered over the group at once for
        zero_stage 2.
        """
        s = self.state
        plain = [grads[i] for i in s.plain_index]
        hooked = [grads[i] for i in s.hooked_index]
        if not plain:
            plain = None
        elif s.zero_stage == 2:
            # Issued last bucket first (see `_reversed`): each bucket's
            # full gradient is freed as soon as backward has made it.
            plain = _Shards(
                _reversed(s.buckets, lambda b: self._reduce_scatter(self._pack(plain, b)))
            )
        flat = None
        if hooked:
            flat = tf.concat([tf.reshape(g, [-1]) for g in hooked], 0)
        grouped = None
        if s.grouped:
            pieces = []
            for k, (i, layout) in enumerate(zip(s.grouped_index, s.group_layouts)):
                padded = packing.flatten_padded(
                    grads[i], layout.sizes[0], layout.num_shards, tf.float32
                )
                if s.zero_stage == 2:
                    call = self._group_call(k)
                    padded = _collective.run(
                        lambda padded=padded, call=call: _collective.reduce_scatter(padded, call)
                    )
                pieces.append(padded)
            grouped = tf.concat(pieces, 0)
        return plain, flat, grouped

    def _pack(self, grads, bucket):
        """Bucket `bucket`'s gradients (of the plain list `grads`), packed shard-major."""
        lo, hi = bucket
        return packing.pack(grads[lo:hi], self.state.layout.sub(lo, hi), tf.float32)

    def _bucket(self, plain, k):
        """Bucket k's part of `plain` (see `_contribution`): packed (zero_stage
        0/1) or its shard (zero_stage 2)."""
        if isinstance(plain, (_Shards, _Accumulated)):
            return plain.bucket(k)
        return self._pack(plain, self.state.buckets[k])

    def _accumulate(self, replica, plain):
        """Adds each bucket of `plain` to its buffer; returns what was added."""
        if plain is None:
            return []
        added = []
        for k in reversed(range(len(self.state.buckets))):
            piece = self._bucket(plain, k)
            replica.acc[k].assign_add(piece)
            added.append(piece)
        return added

    def _update(self, replica, contribution, hooked_contribution, grouped_contribution=None):
        s = self.state
        call = self._call()
        for acc, c in (
            (replica.hooked_acc, hooked_contribution),
            (replica.group_acc, grouped_contribution),
        ):
            if acc is not None:
                with tf.control_dependencies([c]):
                    clear(acc, replica.zero)
        scale = replica.scale.read_value()
        grads = []
        fills = []
        if s.variables:
            # 1. This replica's shard of the summed gradient, bucket by bucket
            # (the transient is a bucket's, not the model's): all-reduce
            # (zero_stage 0), reduce-scatter (1) or already reduced (2).
            def reduce(k):
                piece = self._bucket(contribution, k)
                if s.zero_stage == 1:
                    piece = self._reduce_scatter(piece)
                elif s.zero_stage == 0 and not call.trivial:
                    piece = _collective.run(lambda: _collective.all_reduce(piece, call))
                piece = piece * scale
                if isinstance(contribution, _Accumulated):
                    # The bucket's buffer is cleared once its read is used
                    # up, so that its fresh zeros (see `clear`) are made as
                    # the read is freed, not beside every bucket still
                    # waiting for its collective.
                    contribution.clear(k, after=piece, zero=replica.zero)
                return packing.split_shards(piece, s.layout.sub(*s.buckets[k]))

            # Last bucket first (see `_reversed`).
            for shards in _reversed(range(len(s.buckets)), reduce):
                grads += shards
            shard_index = call.replica.rank if s.num_shards > 1 else 0
            # 2. Masters from the current weights (released between updates).
            fills = [
                fill(local_variable(master), piece)
                for master, piece in zip(
                    replica.masters,
                    packing.local_shards(
                        [v.value for v in s.variables], s.layout, shard_index, tf.float32
                    ),
                )
            ]
        # Variables with their own reduction: each through its hook, whole.
        if s.hooked:
            pieces = tf.split(hooked_contribution, [prod(v.shape) for v in s.hooked])
            for piece, v, hook, master in zip(
                pieces, s.hooked, s.hooks, replica.hooked_masters
            ):
                reduced = hook(tf.reshape(piece, v.shape))
                grads.append(tf.reshape(tf.cast(reduced, tf.float32), [-1]) * scale)
                fill(
                    local_variable(master),
                    tf.reshape(tf.cast(local_variable(v).read_value(), tf.float32), [-1]),
                )
        # Group-sharded variables: reduce-scattered over their data group
        # (zero_stage 1; zero_stage 2 did it per micro-batch), the shard
        # updated here and all-gathered over the group after the update.
        group_calls = [self._group_call(k) for k in range(len(s.grouped))]
        if s.grouped:
            sizes = [
                gl.shard_total if s.zero_stage == 2 else gl.packed_size for gl in s.group_layouts
            ]
            pieces = tf.split(grouped_contribution, sizes)
            for piece, v, layout, gcall, master in zip(
                pieces, s.grouped, s.group_layouts, group_calls, replica.grouped_masters
            ):
                if s.zero_stage != 2:
                    piece = _collective.run(
                        lambda piece=piece, gcall=gcall: _collective.reduce_scatter(piece, gcall)
                    )
                grads.append(piece * scale)
                index = gcall.group.index(gcall.replica.rank)
                fill(
                    local_variable(master),
                    packing.local_shards(
                        [local_variable(v).read_value()], layout, index, tf.float32
                    )[0],
                )
        # 3. The optimizer update, on this replica's shard.
        lent = _lend_to_masters(s.variables, after=grads + fills) if s.num_shards == 1 else []
        with tf.control_dependencies(lent):
            if s.lso is not None:
                loss_scale = tf.cast(s.lso.dynamic_scale, tf.float32)
                grads = [g / loss_scale for g in grads]
                finite = tf.reduce_all([tf.reduce_all(tf.math.is_finite(g)) for g in grads])
                if (s.num_shards > 1 or s.hooked or s.grouped) and not call.trivial:
                    flag = tf.cast(finite, tf.float32)
                    flag = _collective.run(lambda: _collective.all_reduce(flag, call, op="min"))
                    finite = flag > 0.5
                tf.cond(
                    finite,
                    lambda: self._finite_update(replica, grads),
                    lambda: shrink_loss_scale(s.lso),
                )
            else:
                self._apply(replica, grads)
        # 4. Full weights back on every replica.
        if s.variables:
            if s.num_shards > 1:
                # One all-gather per bucket, each written back at once.
                for lo, hi in s.buckets:
                    shards = tf.concat([m.value for m in replica.masters[lo:hi]], 0)
                    gathered = _collective.run(
                        lambda shards=shards: _collective.all_gather(shards, call)
                    )
                    new = packing.unpack(
                        gathered, s.layout.sub(lo, hi), [v.shape for v in s.variables[lo:hi]]
                    )
                    for v, value in zip(s.variables[lo:hi], new):
                        _write(v, value)
            else:
                for m, v in zip(replica.masters, s.variables):
                    _write(v, tf.reshape(m.value, v.shape))
        for v, m in zip(s.hooked, replica.hooked_masters):
            _write(v, tf.reshape(m.value, v.shape))
        for v, m, layout, gcall in zip(s.grouped, replica.grouped_masters, s.group_layouts, group_calls):
            gathered = _collective.run(
                lambda m=m, gcall=gcall: _collective.all_gather(m.value, gcall)
            )
            _write(v, packing.unpack(gathered, layout, [v.shape])[0])
        # The masters are scratch: released once step 4 has read them.
        for m in replica.all_masters():
            release_in_step(local_variable(m))

    def _apply(self, replica, grads):
        s = self.state
        return apply_update(
            s.user_inner,
            replica.inner,
            replica.all_masters(),
            grads,
            s.variables + s.hooked + s.grouped,
            whole_gradients=s.num_shards == 1 and not s.hooked and not s.grouped,
        )

    def _finite_update(self, replica, grads):
        self._apply(replica, grads)
        grow_loss_scale(self.state.lso)
        return tf.constant(True)

    # --- the optimizer's slots -------------------------------------------

    def take_user_slots(self):
        """Host side, at a fit's first step while the user's slots hold the
        state (a fresh model, or one Keras loaded): each replica's slots get
        their shard of the user's, and each user slot is released as soon as
        it is cut, so the two never coexist beyond one slot. No collectives."""
        s = self.state
        ranks = self.ranks()
        for k, user in enumerate(s.user_slots()):
            components = optimizer_shards.local_components(user)
            layout = packing.Layout((prod(user.shape),), s.num_shards)
            for r, replica in enumerate(s.replicas):
                slot = s.slot_pairs[r][0][k][0]
                component = components[r if len(components) > 1 else 0]
                with tf.device(replica.device):
                    piece = packing.local_shards(
                        [component.read_value()], layout, ranks[r], tf.float32
                    )[0]
                    # A copy: the slice shares the full slot's buffer, which
                    # would stay alive through it after the release.
                    fill(local_variable(slot), tf.raw_ops.DeepCopy(x=piece))
            optimizer_shards.release(user)
        # Group-sharded: each replica's component is its own (a stage's);
        # its slot keeps the data-group shard of that component.
        for k, user in enumerate(s.grouped_user_slots()):
            components = optimizer_shards.local_components(user)
            for r, replica in enumerate(s.replicas):
                slot, _, i = s.slot_pairs[r][2][k]
                component = components[r if len(components) > 1 else 0]
                with tf.device(replica.device):
                    fill(local_variable(slot), tf.raw_ops.DeepCopy(
                        x=self._group_shard(i, ranks[r], component.read_value())))
            optimizer_shards.release(user)
        for r, replica in enumerate(s.replicas):
            for slot, user, _ in s.slot_pairs[r][1]:
                components = optimizer_shards.local_components(user)
                component = components[r if len(components) > 1 else 0]
                with tf.device(replica.device):
                    fill(local_variable(slot), tf.reshape(component.read_value(), [-1]))
        s.owns_slots = True

    def _group_shard(self, i, rank, full):
        """Replica `rank`'s data-group shard of group-sharded variable `i`'s
        (local, whole) value `full`."""
        s = self.state
        group = s.group_of[s.grouped_index.index(i)](rank)
        layout = s.group_layout_of(i)
        return packing.local_shards([full], layout, group.index(rank), tf.float32)[0]

    def gather_group_slot(self, k, across_model=True):
        """Group-sharded slot pair `k`: this replica's whole slot (an
        all-gather over the data group), then, with `across_model`, gathered
        over the variable's `ShardSpec` model group (the other stages)."""
        s = self.state
        slot, user, i = s.slot_pairs[s.current_index()][2][k]
        call = self._group_call(s.grouped_index.index(i))
        gathered = _collective.run(
            lambda: _collective.all_gather(tf.cast(slot.value, tf.float32), call)
        )
        whole = packing.unpack(gathered, s.group_layout_of(i), [user.shape])[0]
        spec = annotations.shard_spec(s.all_variables[i])
        if across_model and spec is not None and spec.num_shards > 1:
            whole = _collectives.gather_along(
                whole, spec.shard_axis, spec.model_group(), name=COLLECTIVE_NAME
            )
        return tf.cast(whole, user.dtype)

    def sync_hooked_slots(self):
        """Host side: the user's slots of hooked variables (not released, saved
        as they are) get the callback's whole slots, before a save."""
        s = self.state
        for r, replica in enumerate(s.replicas):
            for slot, user, _ in s.slot_pairs[r][1]:
                components = optimizer_shards.local_components(user)
                component = components[r if len(components) > 1 else 0]
                with tf.device(replica.device):
                    component.assign(tf.cast(tf.reshape(slot.value, user.shape), component.dtype))

    def ranks(self):
        """The shard index of each local replica (host side, cached)."""
        if getattr(self, "_ranks", None) is None:
            fn = step.compile_replica_call(
                self.state.strategy, self.replica_rank, "ParallelOptimizer's replica ranks"
            )
            self._ranks = [
                int(r) for r in self.state.strategy.experimental_local_results(fn())
            ]
        return self._ranks

    def gather_slot(self, k):
        """The full value of sharded slot pair `k` (one all-gather of its shards)."""
        s = self.state
        slot, user, i = s.slot_pairs[s.current_index()][0][k]
        local = tf.cast(slot.value, tf.float32)
        call = self._call()
        if s.num_shards > 1 and not call.trivial:
            local = _collective.run(lambda: _collective.all_gather(local, call))
        layout = packing.Layout((prod(user.shape),), s.num_shards)
        return tf.cast(packing.unpack(local, layout, [user.shape])[0], user.dtype)

    def replica_rank(self):
        return tf.constant(self._call().replica.rank if self.state.num_shards > 1 else 0)


class ExternalSlots:
    """The user optimizer's released slots, for `keras_comm.parallel._checkpoint`.

    A save asks `value` for each released slot: the clone's shards of that
    one variable, all-gathered (a collective: every worker saves, as with any
    MultiWorkerMirroredStrategy checkpoint), so the transient is one slot's
    full size. A load hands `assign` the file's full value; each local
    replica keeps its shard of it, whatever the worker count that saved it.

    Args:
        engine: the `AccumulateStep` whose state owns the slots.
    """

    def __init__(self, engine):
        s = engine.state
        self.engine = engine
        self._index = {id(user): k for k, user in enumerate(s.user_slots())}
        # Slots of group-sharded variables (a pipeline stage buffer).
        self._group_index = {id(user): k for k, user in enumerate(s.grouped_user_slots())}
        self._gathers = {}

    def owns(self, variable):
        return id(variable) in self._index or id(variable) in self._group_index

    def _strategy(self):
        return self.engine.state.strategy

    def _group_gather(self, k, across_model):
        key = ("group", k, across_model)
        fn = self._gathers.get(key)
        if fn is None:
            fn = step.compile_replica_call(
                self._strategy(),
                lambda: self.engine.gather_group_slot(k, across_model),
                "ParallelOptimizer's checkpoint gather",
            )
            self._gathers[key] = fn
        return [np.asarray(t) for t in self._strategy().experimental_local_results(fn())]

    def _group_value(self, variable):
        """The file's value of a group-sharded slot: the variable's full value
        (its `ShardSpec`'s, e.g. every stage's in the unsplit layout)."""
        s = self.engine.state
        k = self._group_index[id(variable)]
        i = s.slot_pairs[0][2][k][2]
        spec = annotations.shard_spec(s.all_variables[i])
        value = self._group_gather(k, True)[0]
        if spec is not None and spec.num_shards > 1 and hasattr(spec, "to_full"):
            value = spec.to_full(value)
        return value

    def value(self, variable):
        if id(variable) in self._group_index:
            return self._group_value(variable)
        k = self._index[id(variable)]
        fn = self._gathers.get(k)
        if fn is None:
            fn = step.compile_replica_call(
                self._strategy(),
                lambda: self.engine.gather_slot(k),
                "ParallelOptimizer's checkpoint gather",
            )
            self._gathers[k] = fn
        return np.asarray(self._strategy().experimental_local_results(fn())[0])

    def restore_user_slots(self):
        """Gives the user's released slots their full values back and stops
        serving them (host side; a collective per slot). For a new state
        replacing this one, which cuts its shards from them."""
        s = self.engine.state
        for user in s.user_slots():
            value = self.value(user)
            for component in optimizer_shards.local_components(user):
                with tf.device(component.device):
                    fill(component, tf.constant(value))
        for k, user in enumerate(s.grouped_user_slots()):
            # Each local replica's own whole slot (they differ by stage).
            values = self._group_gather(k, False)
            for component, value in zip(optimizer_shards.local_components(user), values):
                with tf.device(component.device):
                    fill(component, tf.constant(value))
        for opt in optimizer_shards.user_optimizers(s.optimizer):
            if opt is not None:
                annotations.register_external_slots(opt, None)
        s.owns_slots = False
        self.engine.external = None

    def _group_assign(self, variable, value):
        s = self.engine.state
        k = self._group_index[id(variable)]
        i = s.slot_pairs[0][2][k][2]
        spec = annotations.shard_spec(s.all_variables[i])
        value = np.asarray(value)
        want = tuple(spec.full_shape) if spec is not None else tuple(variable.shape)
        if tuple(value.shape) != want:
            raise ValueError(
                f"Optimizer slot {variable.path!r} holds a full value of shape {want} "
                "in a file. Received: value of shape "
                f"{tuple(value.shape)}"
            )
        for replica, pairs, rank in zip(s.replicas, s.slot_pairs, self.engine.ranks()):
            own = value if spec is None else spec.slice(value, spec.shard_index(rank))
            with tf.device(replica.device):
                piece = self.engine._group_shard(i, rank, tf.constant(np.ravel(own), tf.float32))
                fill(local_variable(pairs[2][k][0]), tf.raw_ops.DeepCopy(x=piece))

    def assign(self, variable, value):
        if id(variable) in self._group_index:
            return self._group_assign(variable, value)
        s = self.engine.state
        k = self._index[id(variable)]
        value = np.asarray(value)
        if tuple(value.shape) != tuple(variable.shape):
            raise ValueError(
                f"Optimizer slot {variable.path!r} has shape {tuple(variable.shape)} and "
                "the file must hold a value of that shape. Received: value of shape "
                f"{tuple(value.shape)}"
            )
        layout = packing.Layout((value.size,), s.num_shards)
        flat = tf.constant(value.reshape(-1), tf.float32)
        for replica, pairs, rank in zip(s.replicas, s.slot_pairs, self.engine.ranks()):
            slot = pairs[0][k][0]
            with tf.device(replica.device):
                piece = packing.local_shards([flat], layout, rank, tf.float32)[0]
                fill(local_variable(slot), tf.raw_ops.DeepCopy(x=piece))  # not a view of `flat`


class _Shards:
    """zero_stage 2's contribution: this replica's reduce-scattered shard of
    each bucket."""

    def __init__(self, shards):
        self.shards = shards

    def bucket(self, k):
        return self.shards[k]


class _Accumulated:
    """The accumulation buffers (`ReplicaState.acc`) as a contribution: read
    one bucket at a time, each cleared after its read."""

    def __init__(self, buffers):
        self.buffers = buffers

    def bucket(self, k):
        return self.buffers[k].read_value()

    def clear(self, k, after, zero):
        with tf.control_dependencies([after]):
            clear(self.buffers[k], zero)


def _reversed(buckets, fn):
    """``[fn(b) for b in buckets]``, but called last bucket first.

    Backward makes the last layers' gradients first, and the collectives of
    a device run in the order they are issued (its ordering token). Issued
    in variable order, the first collective would wait for the first layer's
    gradient -- the last one backward makes -- so every full-size gradient
    of the model would be alive at once. Issued last bucket first, each
    bucket is packed and reduced as soon as backward has made it, and its
    full-size gradients are freed while backward goes on (the overlap of
    DDP's buckets): the gradients a replica holds at once are those of the
    layers backward is between, not the model's.
    """
    out = [None] * len(buckets)
    for k in reversed(range(len(buckets))):
        out[k] = fn(buckets[k])
    return out


def _lend_to_masters(variables, after):
    """Releases, once `after` has run, each float32 weight whose master is a view of it.

    [Note: whole masters update in place] With one shard (zero_stage 0) a
    float32 weight's master is its whole value, and `fill` makes the master
    share the weight's buffer. An in-place update of a shared buffer copies
    it first, so the optimizer's first update of each master would copy
    every weight at every update, a copy plain `fit` (which updates the
    weights themselves) does not make. Released once the update's gradients
    are reduced, a weight leaves its master the only reference: the master
    is updated in place, and step 4's write hands the buffer back (an
    assign adopts its value's buffer). Nothing reads a weight in between.
    A weight of another dtype has a cast master, a buffer of its own, and
    scalars cannot be emptied (`release_in_step`): neither is released.

    Returns:
        The release ops, for the update to wait on.
    """
    with tf.control_dependencies(after):
        return [
            release_in_step(local_variable(v))
            for v in variables
            if local_variable(v).dtype == tf.float32 and len(v.shape)
        ]


def _write(v, value):
    value = tf.cast(value, v.dtype)
    if v.constraint is not None:
        value = v.constraint(value)
    # A fill, not an assign: `v` may be lent to its master (`_lend_to_masters`),
    # and an assign checks the value against the variable's current, empty shape.
    fill(local_variable(v), value)
