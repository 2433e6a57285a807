"""Pipeline parallelism: `Pipeline` (p stages, per-replica stage weights,
GPipe / 1F1B schedules) and the older two-stage `PipelineStage`.

`PipelineStage` keeps both stages' weights on both replicas; `Pipeline`
replaces it (see docs/model_parallel.md for the migration).
"""

import dataclasses
import zlib

import keras
import numpy as np
import tensorflow as tf

from keras_comm import _validation
from keras_comm import ops
from keras_comm import topology
from keras_comm._private import keras_api
from keras_comm._private import tf_api
from keras_comm.layers._base import CollectiveLayer
from keras_comm.ops import point_to_point as p2p
from keras_comm.parallel import _collectives
from keras_comm.parallel import _common
from keras_comm.parallel import _initial
from keras_comm.parallel import mesh as mesh_lib
from keras_comm.parallel import schedules
from keras_comm.parallel import sharded
from keras_comm.variables import annotations


@keras.saving.register_keras_serializable(package="keras_comm")
class PipelineStage(CollectiveLayer):
    """Runs `first` on one replica and `second` on the other, micro-batch by micro-batch.

    Forward, in a world of two replicas (ranks ``stages[0]``, ``stages[1]``):
    the two replicas' batches are all-gathered and split into
    `num_micro_batches` micro-batches; the first-stage replica computes
    ``first(mb)`` and sends it (Send, one tag per micro-batch); the second
    receives it and computes ``second(.)``. TensorFlow runs each op when its
    input arrives, so the first stage works on micro-batch m+1 while the
    second works on m. The second-stage replica sends the first replica's
    rows of the output back; each replica returns its own samples' outputs,
    so Keras's loss and metrics are per replica as usual.
    Backward: Send/Receive reversed, micro-batch by micro-batch; each
    stage's weights get their full gradient on their own replica and zeros
    on the other, so the ordinary all-replica SUM of gradients is exact.

    Both stages' weights exist (mirrored) on both replicas; only the owner
    computes with them. This saves compute per replica, not weight memory.
    With one replica (or outside a strategy) the layer is ``second(first(x))``.

    Args:
        first, second: Keras layers or models (the two stages).
        num_micro_batches: micro-batches per step; must divide twice the
            per-replica batch size.
        stages: the (first, second) global ranks.
        timeout: seconds; None for `keras_comm.get_timeout()`.

    Input shape: ``first``'s. Output shape: ``second``'s.

    Raises:
        ValueError: bad `num_micro_batches` or `stages`; a world other
            than 1 or 2 replicas (at call).
    """

    def __init__(self, first, second, num_micro_batches=1, stages=(0, 1), timeout=None, **kwargs):
        super().__init__(timeout=timeout, **kwargs)
        self.num_micro_batches = _validation.positive_int(num_micro_batches, "num_micro_batches")
        stages = tuple(stages)
        if len(stages) != 2 or sorted(stages) != [0, 1]:
            raise ValueError(
                "`stages` must be the two ranks (0, 1) in stage order. "
                f"Received: stages={stages!r}"
            )
        if isinstance(first, dict):
            first = keras.saving.deserialize_keras_object(first)
        if isinstance(second, dict):
            second = keras.saving.deserialize_keras_object(second)
        self.first = first
        self.second = second
        self.stages = stages

    # The output is the second stage's, in the layer's compute dtype.
    compute_output_spec = keras.layers.Layer.compute_output_spec

    def build(self, input_shape):
        self.first.build(input_shape)
        mid = self.first.compute_output_shape(input_shape)
        self.second.build(mid)
        self._mid_shape = tuple(mid)
        self._out_shape = tuple(self.second.compute_output_shape(mid))

    def _touch(self, layer):
        # Zero-valued use of every weight: the other replica's gradients are
        # then zeros, not None, so both replicas reduce the same list.
        return tf.add_n([tf.zeros([])] + [tf.reduce_sum(w) * 0.0 for w in layer.trainable_weights])

    def call(self, inputs):
        world = topology.world_size()
        if world == 1 or _collectives.shape_only():
            return self.second(self.first(inputs))
        if world != 2:
            raise ValueError(
                f"PipelineStage {self.name!r} runs on exactly 2 replicas. "
                f"Received: world size {world}"
            )
        rank = topology.rank()
        s0, s1 = self.stages
        # A zero that depends on every weight. Placeholders (what the idle
        # replica passes through Send/Receive) carry it so that the gradient
        # tape, which only runs backward functions leading to watched
        # variables, runs the Receive backward that the peer waits for.
        anchor = self._touch(self.first) + self._touch(self.second)
        b = tf.shape(inputs)[0]
        x = ops.all_gather(inputs, timeout=self.timeout, name=self.name)  # rank 0's rows first
        m = self.num_micro_batches
        mb = tf.shape(x)[0] // m
        sent = []
        outs = []
        for i in range(m):
            xm = x[i * mb : (i + 1) * mb]
            if rank == s0:
                h = self.first(xm)
            else:
                h = tf.zeros(tf.concat([[mb], self._mid_shape[1:]], 0), self.compute_dtype)
                h = h + tf.cast(anchor, h.dtype)
            h = ops.send(h, dest=s1, src=s0, tag=i, timeout=self.timeout, name=self.name)
            sent.append(h)
            h = ops.receive(h, src=s0, dest=s1, tag=i, timeout=self.timeout, name=self.name)
            if rank == s1:
                outs.append(self.second(h))
        dtype = self.compute_dtype
        if rank == s1:
            full = tf.concat(outs, 0)
        else:
            full = tf.zeros(tf.concat([[2 * b], self._out_shape[1:]], 0), dtype)
            full = full + tf.cast(anchor, dtype)
        rows = [full[:b], full[b:]]  # rows[r]: rank r's samples
        back = ops.send(rows[s0], dest=s0, src=s1, tag=m, timeout=self.timeout, name=self.name)
        back = ops.receive(back, src=s1, dest=s0, tag=m, timeout=self.timeout, name=self.name)
        if rank == s0:
            out = back
            anchor += tf.add_n([tf.reduce_sum(h) * 0.0 for h in sent])
        else:
            out = rows[s1]
            anchor += tf.reduce_sum(back) * 0.0
        return out + tf.cast(anchor, out.dtype)

    def compute_output_shape(self, input_shape):
        mid = self.first.compute_output_shape(input_shape)
        return self.second.compute_output_shape(mid)

    def get_config(self):
        config = super().get_config()
        config.update(
            first=keras.saving.serialize_keras_object(self.first),
            second=keras.saving.serialize_keras_object(self.second),
            num_micro_batches=self.num_micro_batches,
            stages=list(self.stages),
        )
        return config


# ---------------------------------------------------------------------------
# Pipeline: p stages, each replica holding only its own stage's weights.
# ---------------------------------------------------------------------------

_BUFFER_NAME = "stage_weights"
_STATE_NAME = "stage_state"


class _NoValues:
    """The composite owner of the state buffer: its values are saved with the weights'."""

    def full_values(self):
        return []

    def full_value_count(self):
        return 0

    def set_full_values(self, values):
        pass


def _act_tag(i):
    return 2 * i


def _grad_tag(i):
    return 2 * i + 1


def _seeded_initializer(initializer, seed):
    init = keras.initializers.get(initializer) if not callable(initializer) else initializer
    if isinstance(init, keras.initializers.Initializer):
        config = init.get_config()
        if "seed" in config and config["seed"] is None:
            config["seed"] = int(seed)
            init = init.__class__.from_config(config)
    return init


@keras.saving.register_keras_serializable(package="keras_comm")
class Pipeline(_common.ParallelLayer):
    """Runs `stages` as a pipeline: stage s on the replicas of stage s only.

    The replicas of one group of the mesh axis `axis` (the whole world when
    `mesh` is None) are the pipeline's stages, in group order: the group's
    member i runs ``stages[i]``. Each replica holds only its own stage's
    trainable weights, in one flat per-replica buffer (the layer's only
    weight, ``stage_weights``, sized to the largest stage), and traces only
    its own stage's computation (`layer.stateless_call` on slices of the
    buffer). The stage layers themselves are built without allocating
    their weights (inside a `keras.StatelessScope`).

    Forward: the group's batches are all-gathered (stage 0 needs the
    group's samples) and split into `num_micro_batches` micro-batches;
    stage s receives micro-batch i's activation from stage s-1 (Receive),
    runs, and sends it to stage s+1 (Send), in the order of the schedule's
    table (`keras_comm.parallel.schedules`), each instruction chained to the
    previous one by a control dependency. The last stage's outputs are
    summed over the group (the others contribute zeros) and each replica
    keeps its own samples' rows, so layers after the pipeline, the loss and
    the metrics are per replica as usual.
    Backward: the output gradient is summed over the group; the last stage
    backpropagates each micro-batch through its stage and sends the input
    gradient to stage s-1, and so on down to stage 0 (the schedule's
    backward instructions); the buffer's gradient is the sum over
    micro-batches of this stage's weight gradients, reduced over the
    stage's data-parallel group only (the replicas running the same stage;
    none on a 1-D mesh). The input gradient is stage 0's, scattered back to
    each replica's rows. This equals the full-batch gradient.

    Schedules: the layer runs the table's forward instructions in its
    forward pass and its backward instructions in its backward pass, since
    Keras computes the loss (after every layer) between the two: this is
    GPipe's order for either table. `schedule="1f1b"` interleaves forwards
    and backwards (at most p micro-batches in flight per stage) when the
    model is trained through the pipeline training step
    (`keras_comm.training.pipeline`), which `model.fit` uses for a model
    whose last layer is a `Pipeline`, with or without `ParallelOptimizer`
    (see docs/model_parallel.md).

    With one replica per group (a 1-D mesh of size 1, or no strategy) the
    replica holds every stage and the layer is the unsplit model
    ``stages[-1](... stages[0](x))``: it builds, trains and saves in one
    process like the model it distributes.

    Args:
        stages: a list of p >= 2 Keras layers or models (unbuilt, or built
            for the shapes they receive). Stage weights share one dtype. A
            stage may hold tensor-parallel layers (unbuilt, split over
            another axis of `mesh`: the buffer then holds this replica's
            shard) and non-trainable float state such as
            BatchNormalization's moving statistics (a second per-replica
            buffer, ``stage_state``, advanced micro-batch by micro-batch
            and averaged over the replicas running the stage after each
            step).
        num_micro_batches: m >= 1; must divide the group's batch (the sum
            of the group members' batch sizes).
        schedule: "1f1b" or "gpipe".
        mesh: a `Mesh` with an `axis` axis of size p (or 1), or None (the
            whole world is one pipeline: the world size must be p).
        axis: the mesh axis holding the stages.
        seed: int base seed for stage weights whose initializer has no seed
            (None: derived from the pipeline's name, the stage, and each
            weight's index and name in it -- not from the stage layers'
            automatic names, which count the layers a process made before --
            so replicas of one stage agree as long as every worker gives the
            pipeline the same name, as it does when all build the same
            model). Stages built before the pipeline keep their values:
            build them from the same seed on every worker.
        timeout: seconds; None for `keras_comm.get_timeout()`.

    Input shape: ``stages[0]``'s. Output shape: ``stages[-1]``'s.

    Raises:
        ValueError: fewer than 2 stages, a bad `num_micro_batches` or
            `schedule`; at build: a stage count that does not fit the axis,
            consecutive stages whose shapes do not match, a known batch not
            divisible into micro-batches, stages with integer non-trainable
            state (Dropout's seed) or mixed dtypes, tensor-parallel layers
            on another mesh or built before.
    """

    def __init__(
        self,
        stages,
        num_micro_batches=1,
        schedule="1f1b",
        mesh=None,
        axis="pipeline",
        seed=None,
        timeout=None,
        **kwargs,
    ):
        super().__init__(mesh=mesh, axis=axis, seed=seed, timeout=timeout, **kwargs)
        if not isinstance(stages, (list, tuple)) or len(stages) < 2:
            raise ValueError(
                "`stages` must be a list of at least 2 Keras layers or models. "
                f"Received: stages={stages!r}"
            )
        # A saved stage may be built by Keras's deserialization (its build
        # config): without allocating its weights, as `build` would.
        with keras.StatelessScope(initialize_variables=False):
            stages = [
                keras.saving.deserialize_keras_object(s) if isinstance(s, dict) else s
                for s in stages
            ]
        for i, s in enumerate(stages):
            if not isinstance(s, keras.layers.Layer):
                raise TypeError(
                    f"`stages[{i}]` must be a Keras layer or model. Received: stages[{i}]={s!r}"
                )
        self.num_micro_batches = _validation.positive_int(num_micro_batches, "num_micro_batches")
        self.schedule = schedules.check_schedule(schedule)
        static = self.static_group_size()
        if static is not None and static not in (1, len(stages)):
            raise ValueError(self._fit_message(static, len(stages)))
        # Hidden from Keras's tracking and from the saving walk (which visits
        # every attribute, lists included): the stages' own (uninitialised)
        # variables must not become the model's weights nor be saved; the
        # buffer holds their values and is saved as the stages' weights.
        object.__setattr__(self, "_holder", _Hidden(list(stages)))
        object.__setattr__(self, "_traced_instructions", {})

    def stage_layers(self):
        """The stage layers (built without weights of their own)."""
        return list(self._holder.items)

    @property
    def num_stages(self):
        return len(self._holder.items)

    def _fit_message(self, size, p):
        return (
            f"Pipeline {self.name!r} has {p} stages, so its {self.axis!r} axis "
            f"must have {p} replicas (one per stage), or 1 (every stage on one "
            f"replica). Received: {self.axis!r} axis of size {size} for len(stages)={p}"
        )

    # -- build -----------------------------------------------------------------

    def build(self, input_shape):
        input_shape = tuple(input_shape)
        p = self.num_stages
        n = self.group_size()
        # The mesh at build: host-side calls (full weights, loading) run
        # outside the strategy scope, where the world size is not known.
        self._built_mesh = mesh_lib.runtime_mesh(self.mesh, self.axis)
        if n not in (1, p):
            raise ValueError(self._fit_message(n, p))
        batch = input_shape[0]
        if batch is not None and (batch * n) % self.num_micro_batches:
            raise ValueError(
                f"Pipeline {self.name!r}: the group's batch ({n} x {batch}) must be "
                f"divisible into `num_micro_batches` equal micro-batches. "
                f"Received: num_micro_batches={self.num_micro_batches}"
            )
        shapes = [input_shape]
        dtypes = []
        with keras.StatelessScope(initialize_variables=False):
            for s, stage in enumerate(self._holder.items):
                shape = shapes[-1]
                if not stage.built:
                    stage.build(shape)
                spec = self._output_spec(s, stage, shape, dtypes[-1] if dtypes else self.input_dtype)
                shapes.append(tuple(spec.shape))
                dtypes.append(spec.dtype)
        for s, shape in enumerate(shapes[1:-1], start=1):
            if any(d is None for d in shape[1:]):
                raise ValueError(
                    f"Pipeline {self.name!r}: the activation between stages {s - 1} and {s} "
                    f"must have a static shape apart from the batch (it is received "
                    f"into a buffer of that shape). Received: shape {shape}"
                )
        self._shapes = shapes
        self._dtypes = dtypes
        self._layout = []
        self._weight_shards = []  # per stage: a DeferredShard (tensor-parallel) or None per weight
        dtype = None
        for s, stage in enumerate(self._holder.items):
            bad = [v.path for v in stage.non_trainable_variables if not tf.as_dtype(v.dtype).is_floating]
            if bad:
                raise ValueError(
                    f"Pipeline {self.name!r}: stage {s} ({stage.name!r}) has non-trainable "
                    "state that is not floating point (e.g. the seed state of Dropout or "
                    "another random layer), which pipeline stages do not support yet: "
                    "the stage's state buffer holds float state (moving statistics, "
                    f"averaged over the stage's replicas) only. Received: {bad}"
                )
            entries, offset = [], 0
            self._weight_shards.append([self._check_stage_weight(s, v) for v in stage.trainable_variables])
            for v in stage.trainable_variables:
                if dtype is None:
                    dtype = v.dtype
                if v.dtype != dtype:
                    raise ValueError(
                        f"Pipeline {self.name!r}: every stage weight must have one dtype "
                        f"({dtype}), as they share one buffer. Received: {v.path} of dtype {v.dtype}"
                    )
                size = int(np.prod(v.shape))
                entries.append((tuple(v.shape), offset, size))
                offset += size
            self._layout.append((entries, offset))
        self._weight_dtype = dtype or "float32"
        self._build_state_layout()
        sizes = [size for _, size in self._layout]
        length = sum(sizes) if n == 1 else max(sizes)
        self._tp_axes = sorted({d.spec.mesh_axis for ws in self._weight_shards for d in ws if d is not None})
        self._buffer = self.add_weight(
            name=_BUFFER_NAME,
            shape=(max(length, 1),),
            initializer="zeros",
            dtype=self._weight_dtype,
            trainable=True,
        )
        annotations.set_gradient_hook(self._buffer, self._reduce_gradient)
        # The hook is one sum over the stage's data group (no tensor-parallel
        # stage weights): ParallelOptimizer(zero_stage>=1) shards the
        # buffer's optimizer state over that group.
        annotations.set_data_group(self._buffer, self._data_group)
        annotations.register_composite(self._buffer, self)
        if n > 1 or self._tp_axes:
            # The buffer's optimizer slots (momentum, Adam moments) differ by
            # stage (and tensor-parallel shard) like the buffer: saved
            # gathered over the pipeline (and tensor) axes in the unsplit
            # layout and loaded as each replica's own part, never the
            # chief's part for all.
            full_size = sum(int(np.prod(shape)) for shape in self._full_shapes())
            annotations.register_spec(
                self._buffer,
                _StageBufferSpec(
                    (full_size,), 0, self.mesh, self.axis, self._gather_group(0).size,
                    tuple(sizes), owner=self,
                ),
            )
        self._state_buffer = None
        if any(size for _, size in self._state_layout):
            state_sizes = [size for _, size in self._state_layout]
            self._state_buffer = self.add_weight(
                name=_STATE_NAME,
                shape=(sum(state_sizes) if n == 1 else max(state_sizes),),
                initializer="zeros",
                dtype=self._state_dtype,
                trainable=False,
            )
            # Stage s's statistics live on stage s's replicas: the step
            # averages them over those replicas only (`_write_state`), not
            # over the world as `keras_comm.training.nontrainable` would.
            annotations.keep_per_replica(self._state_buffer)
            # Saved and loaded through the trainable buffer's full values.
            annotations.register_composite(self._state_buffer, _NoValues())
        self._assign_initial_values()
        self.built = True

    def _build_state_layout(self):
        # Non-trainable float state (BatchNormalization's moving statistics):
        # a second per-replica buffer, laid out like the weights.
        self._state_layout, self._order, dtype = [], [], None
        for s, stage in enumerate(self._holder.items):
            entries, offset = [], 0
            for v in stage.non_trainable_variables:
                if dtype is None:
                    dtype = v.dtype
                if v.dtype != dtype:
                    raise ValueError(
                        f"Pipeline {self.name!r}: every non-trainable stage weight must have "
                        f"one dtype ({dtype}), as they share one buffer. Received: {v.path} "
                        f"of dtype {v.dtype}"
                    )
                size = int(np.prod(v.shape))
                entries.append((tuple(v.shape), offset, size))
                offset += size
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
        if d is None and sharded.is_sharded(v):
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
        length = int(buffer.shape[0])
        parts = []
        for s in self._held_stages(rank):
            for value, d in zip(full_by_stage[s], all_shards[s]):
                if d is not None:
                    value = d.spec.slice(np.asarray(value), self._coordinate(rank, d.spec.mesh_axis))
                parts.append(np.ravel(value))
        flat = np.concatenate(parts) if parts else np.zeros([0])
        return np.pad(flat, (0, length - flat.size)).astype(dtype)

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

    def _output_spec(self, s, stage, shape, dtype):
        try:
            # A symbolic call: checks the stage's input spec (a stage built
            # for another shape) and infers the output without computing.
            spec = stage(keras.KerasTensor(shape, dtype=dtype))
        except Exception as e:  # the stage's own error says what mismatched
            raise ValueError(
                f"Pipeline {self.name!r}: stage {s} ({stage.name!r}) cannot take "
                + ("the pipeline's input" if s == 0 else f"stage {s - 1}'s output")
                + f" of shape {shape}: {e}. Received: input shape {shape} for stage {s}"
            ) from None
        if not isinstance(spec, keras.KerasTensor):
            raise ValueError(
                f"Pipeline {self.name!r}: stage {s} ({stage.name!r}) must return one "
                f"tensor. Received: {spec!r}"
            )
        return spec

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
        comps = sharded._components(self._buffer)
        strategy = sharded._strategy_of([self._buffer])
        ranks = sharded._local_ranks(len(comps), strategy)
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
        comps = sharded._components(buffer)
        strategy = sharded._strategy_of([buffer])
        ranks = sharded._local_ranks(len(comps), strategy)
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

    # -- computing a stage ---------------------------------------------------------

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

    def _run_stage(self, s, values, x, training, state_values=()):
        """Stage s on `x`: ``(output, the stage's new non-trainable values)``."""
        stage = self._holder.items[s]
        kwargs = {}
        if training is not None and keras_api.call_has_training_arg(stage):
            kwargs["training"] = training
        out, new_state = stage.stateless_call(values, list(state_values), x, **kwargs)
        return out, list(new_state)

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

    def _sequential(self, inputs, training):
        flat = tf.convert_to_tensor(keras_api.tf_variable(self._buffer))
        state = self._state_tensor()
        held = list(range(self.num_stages))
        x = inputs
        for s in held:
            x, new = self._run_stage(
                s, self._stage_values(flat, s, held), x, training, self._stage_values(state, s, held, True)
            )
            if state is not None:
                state = self._replace_state(state, s, held, new)
        return x, state

    # -- call ----------------------------------------------------------------------

    def compute_output_shape(self, input_shape):
        shape = tuple(input_shape)
        for stage in self._holder.items:
            shape = tuple(stage.compute_output_shape(shape))
        return shape

    def compute_output_spec(self, inputs, training=None):
        shape = self.compute_output_shape(inputs.shape)
        dtype = self._dtypes[-1] if getattr(self, "_dtypes", None) else self.compute_dtype
        return keras.KerasTensor(shape, dtype=dtype)

    def call(self, inputs, training=None):
        if _collectives.shape_only():
            b = tf.shape(inputs)[0]
            return tf.zeros(tf.concat([[b], self._shapes[-1][1:]], 0), self._dtypes[-1])
        group = self.group()
        if group.size == 1:
            y, new_state = self._sequential(inputs, training)
        else:
            x = _collectives.gather_batch(inputs, group, self.name, self.timeout)
            flat = tf.convert_to_tensor(keras_api.tf_variable(self._buffer))
            y, new_state = self._pipelined(x, flat, self._state_tensor(), group, training)
            y = ops.all_reduce(y, group=group, timeout=self.timeout, name=f"{self.name}_output")
            y = _collectives.own_rows(y, group)
        if training and self._state_buffer is not None:
            write = self._write_state(new_state, after=[y])
            with tf.control_dependencies([write]):
                y = tf.identity(y)
        return y

    def _check_batch(self, x):
        m = self.num_micro_batches
        g = x.shape[0]
        if g is not None:
            if g % m:
                raise ValueError(
                    f"Pipeline {self.name!r}: the group's batch of {g} samples must be "
                    f"divisible into `num_micro_batches` equal micro-batches. "
                    f"Received: num_micro_batches={m}"
                )
            return x
        check = tf.debugging.assert_equal(
            tf.shape(x)[0] % m, 0,
            message=f"Pipeline {self.name!r}: the group's batch is not divisible by "
            f"num_micro_batches={m}",
        )
        with tf.control_dependencies([check]):
            return tf.identity(x)

    def _pipelined(self, x, flat, state, group, training):
        """``(output, new state or None)``: the schedule's forward, its backward as the gradient."""
        x = self._check_batch(x)
        rank = topology.rank()
        s = group.index(rank)
        table = schedules.train_schedule(self.schedule, self.num_stages, self.num_micro_batches)[s]
        holder = {}

        @tf.custom_gradient
        def run(x, flat):
            ex = _Executor(self, s, group, x, flat, training, state=state)
            ex.run(schedules.forward_only(table))
            y = ex.output()
            holder["state"] = ex.state

            def grad(dy):
                ex.output_gradient(dy)
                ex.run(schedules.backward_only(table))
                return ex.input_gradient(), ex.weight_gradient()

            return y, grad

        y = run(x, flat)
        new_state = holder["state"]
        return y, (None if new_state is None else tf.stop_gradient(new_state))

    # -- the training step's plug-in -------------------------------------------------

    @property
    def computes_loss_in_schedule(self):
        """Whether `model.fit` hands this layer the loss (`run_training_schedule`).

        1F1B starts micro-batch i's backward before later micro-batches'
        forwards, so it needs micro-batch i's loss while the schedule runs;
        GPipe runs every forward first and takes the gradient Keras computes.
        """
        return self.schedule == "1f1b"

    def run_training_schedule(self, inputs, loss_fn):
        """In replica context: the whole training table, forward and backward.

        The plug-in of `keras_comm.training.pipeline` for a model whose
        output is this layer (with `computes_loss_in_schedule`): the last
        stage computes micro-batch i's loss right after its forward and
        backpropagates it at once.

        Args:
            inputs: the pipeline group's batch (gathered over `group()`).
            loss_fn: ``loss_fn(i, y_pred) -> loss``, micro-batch i's loss,
                scaled as the optimizer will unscale it.

        Returns:
            A `ScheduleResult`.
        """
        group = self.group()
        x = self._check_batch(inputs)
        flat = tf.convert_to_tensor(keras_api.tf_variable(self._buffer))
        s = group.index(topology.rank())
        table = schedules.train_schedule(self.schedule, self.num_stages, self.num_micro_batches)[s]
        ex = _Executor(self, s, group, x, flat, True, loss_fn=loss_fn, state=self._state_tensor())
        ex.run(table)
        dflat = ex.weight_gradient()
        if ex.state is not None:
            # The stages' moving statistics after every micro-batch, averaged
            # over the stage's replicas (not the world: the per-step sync
            # leaves the per-stage buffer alone).
            dflat = p2p._after(dflat, [self._write_state(ex.state, after=[dflat])])
        y = ops.all_reduce(ex.output(), group=group, timeout=self.timeout, name=f"{self.name}_output")

        def input_gradient():
            dx = ex.input_gradient()
            return ops.reduce_scatter(dx, group=group, timeout=self.timeout, name=f"{self.name}_input_grad")

        return ScheduleResult(_collectives.own_rows(y, group), [(self._buffer, dflat)], input_gradient)

    # -- weights in the unsplit order ------------------------------------------------

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
        comps = sharded._components(buffer)
        strategy = sharded._strategy_of([buffer])
        ranks = sharded._local_ranks(len(comps), strategy)
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

    # Saved as the unsplit stages' weights (gathered), loaded as each
    # replica's own stage: a file loads on any split of the same stages.
    def save_own_variables(self, store):
        for i, value in enumerate(self.full_values()):
            store[str(i)] = value

    def load_own_variables(self, store):
        self.set_full_values([np.asarray(store[str(i)]) for i in range(len(store.keys()))])

    def get_config(self):
        config = super().get_config()
        config.update(
            stages=[keras.saving.serialize_keras_object(s) for s in self._holder.items],
            num_micro_batches=self.num_micro_batches,
            schedule=self.schedule,
        )
        return config


@dataclasses.dataclass(frozen=True)
class ScheduleResult:
    """What `Pipeline.run_training_schedule` computed on one replica.

    Attributes:
        output: this replica's rows of the last stage's output.
        gradients: ``[(variable, gradient)]`` of the layer's weights (this
            stage's, not yet reduced over its data group).
        input_gradient: ``input_gradient() -> tensor``, this replica's rows
            of the gradient of the layer's input (a reduce-scatter, issued
            when called).
    """

    output: object
    gradients: list
    input_gradient: object


@dataclasses.dataclass(frozen=True)
class _StageBufferSpec(sharded.ShardSpec):
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
        comps = sharded._components(owner._buffer)
        first = sharded._local_ranks(len(comps), sharded._strategy_of([owner._buffer]))[0]
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


class _Hidden:
    """A plain holder: neither Keras's trackers nor its saving walk look inside."""

    def __init__(self, items):
        self.items = items


class _Executor:
    """Runs one stage's instruction list (`keras_comm.parallel.schedules`).

    One instance per traced step on one replica. Each instruction's ops are
    created after the previous instruction's (a control dependency), so the
    stage runs the table's order, not just what the data allows; transfers
    are ordered besides by the device's ordering token.

    Micro-batch i's forward records a tape (the stage's input and this
    replica's buffer watched); its backward consumes it. With `loss_fn`
    (the pipeline training step), the last stage's forward also computes the
    loss of micro-batch i and its backward starts from that loss instead of
    a received gradient.
    """

    def __init__(self, layer, stage, group, x, flat, training, loss_fn=None, state=None):
        self.layer = layer
        self.s = stage
        self.p = layer.num_stages
        self.ranks = group.ranks
        self.rank = self.ranks[stage]
        self.x = x
        self.flat = flat
        self.training = training
        self.loss_fn = loss_fn
        # This replica's non-trainable state (None: the stages have none),
        # advanced by each micro-batch's forward in order, as the unsplit
        # model updates it once per micro-batch.
        self.state = state
        m = layer.num_micro_batches
        self.m = m
        self.mb = tf.shape(x)[0] // m
        self.h_in, self.h_out, self.tapes, self.g_out, self.dx = {}, {}, {}, {}, {}
        self.losses = {}
        self.dflat = None
        self.pending = []  # sends, kept alive through the outputs
        self.last = None

    def _shape(self, k):
        return tf.concat([[self.mb], list(self.layer._shapes[k][1:])], 0)

    def run(self, instructions):
        # What this replica traced, in order (tests check the interleaving).
        self.layer._traced_instructions.setdefault(self.rank, []).append(list(instructions))
        for op in instructions:
            deps = [self.last] if self.last is not None else []
            with tf.control_dependencies(deps):
                self.last = getattr(self, "_" + op.kind)(op.micro_batch)

    def _recv_act(self, i):
        template = tf.zeros(self._shape(self.s), self.layer._dtypes[self.s - 1])
        prev = self.ranks[self.s - 1]
        h = ops.receive(template, {self.rank: prev}, tag=_act_tag(i), timeout=self.layer.timeout, name=self.layer.name)
        self.h_in[i] = h
        return h

    def _forward(self, i):
        if self.s == 0:
            x = self.x[i * self.mb : (i + 1) * self.mb]
        else:
            x = self.h_in.pop(i)
        with tf.GradientTape() as tape:
            if x.dtype.is_floating:
                tape.watch(x)
            tape.watch(self.flat)
            held = self.layer._held_stages(self.rank)
            values = self.layer._stage_values(self.flat, self.s, held)
            state_values = self.layer._stage_values(self.state, self.s, held, True)
            y, new_state = self.layer._run_stage(self.s, values, x, self.training, state_values)
            if self.state is not None and self.training:
                self.state = self.layer._replace_state(self.state, self.s, held, new_state)
            if self.loss_fn is not None and self.s == self.p - 1:
                self.losses[i] = self.loss_fn(i, y)
        self.tapes[i] = (tape, x, y)
        self.h_out[i] = y
        return y

    def _send_act(self, i):
        nxt = self.ranks[self.s + 1]
        y = self.h_out.pop(i)
        sent = ops.send(y, {self.rank: nxt}, tag=_act_tag(i), timeout=self.layer.timeout, name=self.layer.name)
        self.pending.append(sent)
        self.h_out[i] = None  # the last stage keeps outputs; others need not
        return sent

    def output(self):
        """The last stage's outputs for the group's batch; zeros elsewhere."""
        if self.s == self.p - 1:
            y = tf.concat([self.h_out[i] for i in range(self.m)], 0)
        else:
            shape = tf.concat([[tf.shape(self.x)[0]], list(self.layer._shapes[-1][1:])], 0)
            y = tf.zeros(shape, self.layer._dtypes[-1])
        return p2p._after(y, self.pending + [self.last])

    def output_gradient(self, dy):
        if self.s == self.p - 1:
            for i in range(self.m):
                self.g_out[i] = dy[i * self.mb : (i + 1) * self.mb]

    def _recv_grad(self, i):
        nxt = self.ranks[self.s + 1]
        template = tf.zeros(self._shape(self.s + 1), self.layer._dtypes[self.s])
        g = ops.receive(template, {self.rank: nxt}, tag=_grad_tag(i), timeout=self.layer.timeout, name=self.layer.name)
        self.g_out[i] = g
        return g

    def _backward(self, i):
        tape, x, y = self.tapes.pop(i)
        if self.loss_fn is not None and self.s == self.p - 1:
            target, grads = self.losses.pop(i), None
        else:
            target, grads = y, self.g_out.pop(i)
        sources = [x, self.flat] if x.dtype.is_floating else [self.flat]
        out = tape.gradient(target, sources, output_gradients=grads)
        dflat = out[-1]
        if dflat is None:
            dflat = tf.zeros_like(self.flat)
        self.dflat = dflat if self.dflat is None else self.dflat + dflat
        if x.dtype.is_floating:
            self.dx[i] = out[0] if out[0] is not None else tf.zeros_like(x)
        return self.dflat

    def _send_grad(self, i):
        prev = self.ranks[self.s - 1]
        sent = ops.send(self.dx.pop(i), {self.rank: prev}, tag=_grad_tag(i), timeout=self.layer.timeout, name=self.layer.name)
        self.pending.append(sent)
        return sent

    def input_gradient(self):
        """Stage 0's gradient of the group's batch; zeros elsewhere (None for ints)."""
        if not self.x.dtype.is_floating:
            return None
        if self.s == 0:
            g = tf.concat([self.dx.pop(i) for i in range(self.m)], 0)
        else:
            g = tf.zeros_like(self.x)
        return p2p._after(g, self.pending + [self.last])

    def weight_gradient(self):
        return p2p._after(self.dflat, self.pending + [self.last])
