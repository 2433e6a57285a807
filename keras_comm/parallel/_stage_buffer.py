"""A `Pipeline`'s stage buffer: each replica's stage weights in one flat variable.

[Note: stage buffer] Replica s of the pipeline group holds only stage s's
trainable weights, concatenated flat in one per-replica variable
(``stage_weights``, sized to the largest stage), and stage s's
non-trainable float state in a second one (``stage_state``). This module
owns that layout: where each stage weight sits, how the buffer's gradient
is reduced (over the replicas running the same stage), the initial values
(worker 0's, the same on every worker), and the conversion to and from the
unsplit model's full weights (`full_values`, `set_full_values`), which
`full_weights` and checkpoints use.
"""


import dataclasses
import zlib

import keras
import numpy as np
import tensorflow as tf

from keras_comm import ops
from keras_comm import topology
from keras_comm._private import keras_api
from keras_comm._private import tf_api
from keras_comm.parallel import _initial
from keras_comm.parallel import mesh as mesh_lib
from keras_comm.parallel import sharded_weights
from keras_comm.variables import annotations


BUFFER_NAME = "stage_weights"


STATE_NAME = "stage_state"


class NoValues:
    """The composite owner of the state buffer: its values are saved with the weights'."""

    def full_values(self):
        return []

    def full_value_count(self):
        return 0

    def set_full_values(self, values):
        pass


def _seeded_initializer(initializer, seed):
    init = keras.initializers.get(initializer) if not callable(initializer) else initializer
    if isinstance(init, keras.initializers.Initializer):
        config = init.get_config()
        if "seed" in config and config["seed"] is None:
            config["seed"] = int(seed)
            init = init.__class__.from_config(config)
    return init


@dataclasses.dataclass(frozen=True)
class StageBufferSpec(sharded_weights.ShardSpec):
    """The stage buffer as a split weight, for checkpoints of its optimizer slots.

    Replica s's buffer holds stage s's `sizes[s]` values, zero-padded to the
    largest stage. The full value is the unsplit layout, the stages'
    values one after another (what the buffer of a one-replica pipeline
    holds), so a file loads on any split of the same stages.
    """

    sizes: tuple = ()
    owner: object = dataclasses.field(default=None, compare=False, repr=False)

    @property
    def shard_shape(self):
        return tuple(self.owner._buffer.shape)

    def model_group(self, rank=None):
        # The replicas holding the stages (and their tensor-parallel shards).
        return self.owner._gather_group(rank)

    def shard_index(self, rank):
        return rank  # `slice` cuts replica `rank`'s part

    def to_full(self, gathered):
        owner = self.owner
        comps = sharded_weights.components(owner._buffer)
        first = sharded_weights.local_ranks(len(comps), sharded_weights.strategy_of([owner._buffer]))[0]
        group = owner._gather_group(first)  # the checkpoint reads the first local replica's gather
        rows = np.reshape(np.asarray(gathered), (group.size, -1))
        return np.concatenate([np.ravel(v) for v in owner._unsplit(dict(zip(group.ranks, rows)))])

    def slice(self, full, index):
        owner = self.owner
        full, values = np.asarray(full), []
        start = 0
        for shape in owner._full_shapes():
            size = int(np.prod(shape))
            values.append(np.reshape(full[start : start + size], shape))
            start += size
        return owner._replica_flat(owner._by_stage(values), index)


class StageBuffer:
    """The stage-buffer half of `Pipeline` (a mixin: `Pipeline` holds the state)."""

    def _flat_layout(self, variables, dtype, what):
        """``(entries, size, dtype)``: where each of `variables` sits in one flat
        buffer of one dtype, entries ``(shape, offset, size)`` in order."""
        entries, offset = [], 0
        for v in variables:
            if dtype is None:
                dtype = v.dtype
            if v.dtype != dtype:
                raise ValueError(
                    f"Pipeline {self.name!r}: every {what} must have one dtype "
                    f"({dtype}), as they share one buffer. Received: {v.path} of dtype {v.dtype}"
                )
            size = int(np.prod(v.shape))
            entries.append((tuple(v.shape), offset, size))
            offset += size
        return entries, offset, dtype

    def _build_state_layout(self):
        # Non-trainable float state (BatchNormalization's moving statistics):
        # a second per-replica buffer, laid out like the weights.
        self._state_layout, self._order, dtype = [], [], None
        for s, stage in enumerate(self._holder.items):
            entries, offset, dtype = self._flat_layout(
                stage.non_trainable_variables, dtype, "non-trainable stage weight"
            )
            self._state_layout.append((entries, offset))
            # The unsplit model's weight order (Keras's `stage.weights`):
            # ("t", k) the k-th trainable, ("n", k) the k-th non-trainable.
            trainable = {id(v): k for k, v in enumerate(stage.trainable_variables)}
            state = {id(v): k for k, v in enumerate(stage.non_trainable_variables)}
            self._order.append(
                [("t", trainable[id(v)]) if id(v) in trainable else ("n", state[id(v)]) for v in stage.weights]
            )
        self._state_dtype = dtype or "float32"

    def _check_stage_weight(self, s, v):
        """Stage s's weight `v`: its `DeferredShard` if tensor-parallel, else None."""
        d = annotations.deferred_shard(v)
        if d is None and sharded_weights.is_sharded(v):
            raise ValueError(
                f"Pipeline {self.name!r}: stage {s} holds the sharded weight {v.path!r}, "
                "built before the pipeline. Pass tensor-parallel layers unbuilt: the "
                "pipeline builds them and holds each replica's shard. Received: a built "
                f"stage {s}"
            )
        if d is not None and (self.mesh is None or d.spec.mesh != self.mesh or d.spec.mesh_axis == self.axis):
            raise ValueError(
                f"Pipeline {self.name!r}: the tensor-parallel weight {v.path!r} of stage {s} "
                f"must be split over an axis of the pipeline's mesh other than {self.axis!r} "
                "(its members then run the same stage at the same time). Received: "
                f"mesh={d.spec.mesh!r}, axis={d.spec.mesh_axis!r} for the pipeline's "
                f"mesh={self.mesh!r}"
            )
        return d

    def _full_shapes(self):
        """Every stage weight's full (unsplit) shape, stage 0's first."""
        return [
            tuple(d.spec.full_shape) if d is not None else tuple(shape)
            for (entries, _), shards in zip(self._layout, self._weight_shards)
            for (shape, _, _), d in zip(entries, shards)
        ]

    def _coordinate(self, rank, axis):
        mesh = self._built_mesh
        return mesh.coordinates(rank)[mesh.axes.index(axis)]

    def _fixed_axes_group(self, rank, fixed):
        """The ranks sharing `rank`'s coordinates on the axes `fixed`."""
        mesh = self._built_mesh
        mine = mesh.coordinates(rank)
        idx = [mesh.axes.index(a) for a in fixed]
        return topology.Group(
            [r for r in range(mesh.size) if all(mesh.coordinates(r)[i] == mine[i] for i in idx)]
        )

    def _gather_group(self, rank=None):
        """The replicas that together hold every stage weight once, with `rank`.

        The pipeline axis and the stages' tensor-parallel axes vary; every
        other axis (data) is `rank`'s.
        """
        rank = topology.rank() if rank is None else rank
        varying = {self.axis, *self._tp_axes}
        return self._fixed_axes_group(rank, [a for a in self._built_mesh.axes if a not in varying])

    def _kind(self, state):
        """(layout, per-weight shards, buffer, dtype) of the weights or the state."""
        if state:
            return (self._state_layout, [[None] * len(e) for e, _ in self._state_layout],
                    self._state_buffer, self._state_dtype)
        return self._layout, self._weight_shards, self._buffer, self._weight_dtype

    def _stage_offset(self, s, rank, state=False):
        layout = self._kind(state)[0]
        return sum(layout[h][1] for h in self._held_stages(rank)[: self._held_stages(rank).index(s)])

    def _unsplit(self, rows, state=False):
        """Full stage weights (or state) from ``{rank: flat buffer}``, stage 0's first."""
        layout, all_shards, _, _ = self._kind(state)
        ranks = sorted(rows)
        out = []
        for s, ((entries, _), shards) in enumerate(zip(layout, all_shards)):
            holders = [r for r in ranks if s in self._held_stages(r)]

            def piece(r, off, size, shape):
                start = self._stage_offset(s, r, state) + off
                return np.reshape(rows[r][start : start + size], shape).copy()

            for (shape, off, size), d in zip(entries, shards):
                if d is None:
                    out.append(piece(holders[0], off, size, shape))
                    continue
                by_coordinate = {}
                for r in holders:
                    by_coordinate.setdefault(self._coordinate(r, d.spec.mesh_axis), r)
                out.append(np.concatenate(
                    [piece(by_coordinate[j], off, size, shape) for j in range(d.spec.num_shards)],
                    axis=d.spec.shard_axis,
                ))
        return out

    def _replica_flat(self, full_by_stage, rank, state=False):
        """Replica `rank`'s buffer from full stage weights ``{stage: [arrays]}``."""
        _, all_shards, buffer, dtype = self._kind(state)
        # One host array, written in place: the buffer can be a whole
        # stage (hundreds of MiB), so no concatenated, padded and cast copies.
        flat = np.zeros(int(buffer.shape[0]), dtype)
        start = 0
        for s in self._held_stages(rank):
            for value, d in zip(full_by_stage[s], all_shards[s]):
                if d is not None:
                    value = d.spec.slice(np.asarray(value), self._coordinate(rank, d.spec.mesh_axis))
                value = np.ravel(value)
                flat[start : start + value.size] = value
                start += value.size
        return flat

    def _by_stage(self, values, state=False):
        """``{stage: [arrays]}`` from a flat list in the unsplit order."""
        values, out = list(values), {}
        for s, (entries, _) in enumerate(self._kind(state)[0]):
            out[s], values = values[: len(entries)], values[len(entries) :]
        return out

    def _reduction_parts(self, rank):
        """``[(group, mask or None)]``: how `rank`'s buffer gradient is reduced.

        A plain stage weight's gradient is summed over every replica running
        the stage; a tensor-parallel shard's over the replicas running the
        stage with the same shard (its data group). One part (mask None)
        without tensor parallelism.
        """
        length = int(self._buffer.shape[0])
        masks = {}
        start = 0
        for s in self._held_stages(rank):
            entries, size = self._layout[s]
            for (shape, off, n), d in zip(entries, self._weight_shards[s]):
                key = (self.axis,) if d is None else (self.axis, d.spec.mesh_axis)
                masks.setdefault(key, np.zeros(length, np.bool_))[start + off : start + off + n] = True
            start += size
        plain = (self.axis,)
        if set(masks) <= {plain}:
            return [(self._fixed_axes_group(rank, plain), None)]
        covered = np.any(list(masks.values()), axis=0)
        masks.setdefault(plain, np.zeros(length, np.bool_))[~covered] = True  # the padding
        return [(self._fixed_axes_group(rank, key), masks[key]) for key in sorted(masks)]

    def _data_group(self, rank):
        """The replicas whose buffer gradients `_reduce_gradient` sums for
        `rank` when that is one sum (no tensor-parallel stage weights), else None."""
        parts = self._reduction_parts(rank)
        return parts[0][0] if len(parts) == 1 else None

    def _initial_stage_value(self, s, k, v):
        d = self._weight_shards[s][k]
        if d is not None:  # tensor-parallel: the full weight, sliced per replica
            return d.full_value(v.dtype)
        if keras_api.tf_variable(v) is not None:  # a stage built before
            return np.asarray(keras.ops.convert_to_numpy(v.value))
        # Not `v.path`: it holds the stage layers' automatic names
        # ("dense_7"), numbered by how many layers this process made
        # before. (With several workers only worker 0's values count:
        # `_chief_values`.)
        seed = (
            self.seed + 1000 * s + k
            if self.seed is not None
            else zlib.crc32(f"{self.name}/{s}/{k}/{v.name}".encode()) % (2**31)
        )
        init = _seeded_initializer(keras_api.deferred_initializer(v), seed)
        return np.asarray(keras.ops.convert_to_numpy(init(v.shape, dtype=v.dtype)))

    def _chief_values(self, strategy, needed, state=False):
        """``{stage: [arrays]}`` for the `needed` stages: worker 0's values.

        A worker that built other models first names this pipeline (and
        its stages' layers, hence the tensor-parallel weights' seeds)
        otherwise than the other workers do, so with several workers
        worker 0 computes every stage's weights, one at a time, and
        broadcasts each (as MWMS broadcasts a mirrored variable's initial
        value); each worker keeps its own stages'. Worker 0 thus computes
        every stage's values once, but holds at most one full weight of a
        stage it does not run.
        """
        items = (
            (lambda s: self._holder.items[s].non_trainable_variables)
            if state
            else (lambda s: self._holder.items[s].trainable_variables)
        )
        one = self._initial_state_value if state else self._initial_stage_value
        if not topology.is_multi_worker(strategy):
            return {s: [one(s, k, v) for k, v in enumerate(items(s))] for s in needed}
        values = {s: [] for s in needed}
        for s in range(self.num_stages):
            for k, v in enumerate(items(s)):
                d = None if state else self._weight_shards[s][k]
                shape = d.spec.full_shape if d is not None else tuple(v.shape)
                value = _initial.chief_value(
                    strategy, shape, v.dtype, lambda s=s, k=k, v=v: one(s, k, v)
                )
                if s in values:
                    values[s].append(value)
        return values

    def _held_stages(self, rank):
        """The stages replica `rank` holds, in buffer order."""
        mesh = self._built_mesh
        if mesh.axis_size(self.axis) == 1:
            return list(range(self.num_stages))
        return [mesh.coordinates(rank)[mesh.axes.index(self.axis)]]

    def _assign_initial_values(self):
        comps = sharded_weights.components(self._buffer)
        strategy = sharded_weights.strategy_of([self._buffer])
        ranks = sharded_weights.local_ranks(len(comps), strategy)
        needed = sorted({s for r in ranks for s in self._held_stages(r)})
        self._assign_components(self._chief_values(strategy, needed))
        if self._state_buffer is not None:
            self._assign_components(self._chief_values(strategy, needed, state=True), state=True)

    def _initial_state_value(self, s, k, v):
        if keras_api.tf_variable(v) is not None:  # a stage built before
            return np.asarray(keras.ops.convert_to_numpy(v.value))
        init = keras.initializers.get(keras_api.deferred_initializer(v))
        return np.asarray(keras.ops.convert_to_numpy(init(v.shape, dtype=v.dtype)))

    def _assign_components(self, values, state=False):
        buffer = self._kind(state)[2]
        comps = sharded_weights.components(buffer)
        strategy = sharded_weights.strategy_of([buffer])
        ranks = sharded_weights.local_ranks(len(comps), strategy)
        with tf.init_scope(), strategy.scope():
            for r, c in zip(ranks, comps):
                c.assign(self._replica_flat(values, r, state))

    def _reduce_gradient(self, grad):
        """Replica context: SUM over the replicas running the same stage.

        (A tensor-parallel shard's part: over those holding the same shard.)
        """
        if grad is None:
            return grad
        mesh_lib.runtime_mesh(self.mesh, self.axis)  # checks the world
        out = []
        for group, mask in self._reduction_parts(topology.rank()):
            part = grad if mask is None else grad * tf.constant(mask, grad.dtype)
            if group.size > 1:
                part = ops.all_reduce(part, group=group, timeout=self.timeout, name=f"{self.name}_grad")
            out.append(part)
        return tf.add_n(out) if len(out) > 1 else out[0]

    def _stage_values(self, flat, s, held, state=False):
        """Stage s's weights (or state) as tensors: slices of this replica's buffer."""
        if flat is None:
            return []
        layout = self._kind(state)[0]
        start = 0
        for h in held:
            if h == s:
                break
            start += layout[h][1]
        return [
            tf.reshape(flat[start + off : start + off + size], shape)
            for shape, off, size in layout[s][0]
        ]

    def _flat_gradient(self, grads, s, held, flat):
        """The buffer's gradient from stage s's weights' gradients `grads`:
        them flattened at their places, zeros elsewhere (the other held
        stages' parts and the padding), like `_stage_values` reads them.

        The zeros are padding of the first and last gradient (`tf.pad`), not
        zeros tensors of their own: TensorFlow's graph optimizer turns a
        zeros tensor of a static shape into a constant that the step
        function keeps for as long as it lives (on a stage smaller than the
        largest, the buffer's padding: up to a whole stage's size).
        """
        pieces = [tf.reshape(tf.cast(g, flat.dtype), [-1]) for g in grads]
        if not pieces:
            return tf.zeros_like(flat)
        before = sum(self._layout[h][1] for h in held[: held.index(s)])
        after = int(self._buffer.shape[0]) - before - self._layout[s][1]
        if before:
            pieces[0] = tf.pad(pieces[0], [[before, 0]])
        if after:
            pieces[-1] = tf.pad(pieces[-1], [[0, after]])
        return tf.concat(pieces, 0) if len(pieces) > 1 else pieces[0]

    def _state_tensor(self):
        if self._state_buffer is None:
            return None
        return tf.convert_to_tensor(keras_api.tf_variable(self._state_buffer))

    def _replace_state(self, state, s, held, new_values):
        """`state` with stage s's part replaced by `new_values`."""
        if not new_values:
            return state
        start = 0
        for h in held:
            if h == s:
                break
            start += self._state_layout[h][1]
        size = self._state_layout[s][1]
        piece = tf.concat([tf.reshape(tf.cast(v, state.dtype), [-1]) for v in new_values], 0)
        return tf.concat([state[:start], piece, state[start + size :]], 0)

    def _write_state(self, new_state, after=()):
        """Replica context: the state after this step's micro-batches, agreed.

        The mean over the replicas running the same stage (its data group;
        with a 1-D mesh, none): exact for BatchNormalization's update, which
        is linear in the batch statistics (see
        `keras_comm.training.nontrainable`).
        """
        distributed = tf.distribute.has_strategy() and tf.distribute.get_replica_context() is not None
        rank = topology.rank() if distributed else 0
        group = self._fixed_axes_group(rank, [self.axis]) if distributed else topology.Group([0])
        with tf.control_dependencies([t for t in after if t is not None]):
            new_state = tf.identity(new_state)
        if group.size > 1:
            total = ops.all_reduce(new_state, group=group, timeout=self.timeout, name=f"{self.name}_state")
            new_state = total / tf.cast(group.size, total.dtype)
        return tf_api.local_component(keras_api.tf_variable(self._state_buffer)).assign(new_state)

    def full_values(self):
        """Host side: every stage's weights, stage 0's first (numpy arrays).

        Gathers the stages from their replicas (a collective: under
        MultiWorkerMirroredStrategy every worker must call it).
        """
        weights = self._gathered_values(False)
        if self._state_buffer is None:
            return weights
        state = self._by_stage(self._gathered_values(True), True)
        weights = self._by_stage(weights)
        return [
            (weights if kind == "t" else state)[s][k]
            for s in range(self.num_stages)
            for kind, k in self._order[s]
        ]

    def _gathered_values(self, state):
        buffer = self._kind(state)[2]
        comps = sharded_weights.components(buffer)
        strategy = sharded_weights.strategy_of([buffer])
        ranks = sharded_weights.local_ranks(len(comps), strategy)
        if strategy.num_replicas_in_sync == 1 or self._gather_group(ranks[0]).size == 1:
            return self._unsplit({ranks[0]: comps[0].numpy()}, state)

        def replica_fn():
            value = tf.identity(keras_api.tf_variable(buffer))
            return ops.all_gather(value[None], group=self._gather_group(), name=f"{self.name}_full")

        with strategy.scope():
            out = tf.function(lambda: strategy.run(replica_fn))()
        gathered = np.asarray(strategy.experimental_local_results(out)[0])
        return self._unsplit(dict(zip(self._gather_group(ranks[0]).ranks, gathered)), state)

    def full_value_count(self):
        return sum(len(order) for order in self._order)

    def set_full_values(self, values):
        """Host side: assigns every stage's weights (the unsplit order)."""
        values = list(values)
        if len(values) != self.full_value_count():
            raise ValueError(
                f"Pipeline {self.name!r} holds {self.full_value_count()} stage weights. "
                f"Received: {len(values)} values"
            )
        shapes = self._by_stage(self._full_shapes())
        by_stage, state_by_stage, k = {}, {}, 0
        for s in range(self.num_stages):
            by_stage[s] = [None] * len(self._layout[s][0])
            state_by_stage[s] = [None] * len(self._state_layout[s][0])
            for j, (kind, i) in enumerate(self._order[s]):
                v = np.asarray(values[k])
                k += 1
                shape = shapes[s][i] if kind == "t" else self._state_layout[s][0][i][0]
                if tuple(v.shape) != tuple(shape):
                    raise ValueError(
                        f"Pipeline {self.name!r}: stage {s}'s weight {j} has "
                        f"shape {shape}. Received: value of shape {v.shape}"
                    )
                (by_stage if kind == "t" else state_by_stage)[s][i] = v
        self._assign_components(by_stage)
        if self._state_buffer is not None:
            self._assign_components(state_by_stage, state=True)

    def stage_nbytes(self, s):
        """Bytes of stage s's weights (what the replicas of stage s hold)."""
        return self._layout[s][1] * np.dtype(self._weight_dtype).itemsize
