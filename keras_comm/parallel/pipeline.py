"""`Pipeline`: p stages, each replica holding and running only its own stage.

The pieces, one concern each (the layout of torch's `distributed.pipelining`):

* this module: the layer -- validation, build, the forward and backward
  `model.fit` calls, and the training step's plug-in
  (`run_training_schedule`);
* `keras_comm.parallel.schedules`: GPipe and 1F1B as instruction tables;
* `keras_comm.parallel._pipeline_executor`: one stage's instructions as ops;
* `keras_comm.parallel._stage_buffer`: the per-replica stage weights, their
  gradient reduction and their full values.

The older two-stage layer is `keras_comm.parallel.pipeline_stage.PipelineStage`.
"""

import dataclasses

import keras
import numpy as np
import tensorflow as tf

from keras_comm import _validation
from keras_comm import ops
from keras_comm import topology
from keras_comm._private import keras_api
from keras_comm.ops import point_to_point as p2p
from keras_comm.parallel import _collectives
from keras_comm.parallel import _common
from keras_comm.parallel import _stage_buffer
from keras_comm.parallel._pipeline_executor import Executor
from keras_comm.parallel._stage_buffer import StageBuffer
from keras_comm.parallel import mesh as mesh_lib
from keras_comm.parallel import schedules
from keras_comm.parallel.pipeline_stage import PipelineStage  # noqa: F401  (its first home)
from keras_comm.variables import annotations


def _keep_unallocated(stages):
    """Keeps the stage layers' own variables without storage for good.

    Variables created in a `keras.StatelessScope` are queued for allocation
    when the next outermost stateless scope closes (the first traced step
    opens one), which would give every replica every stage's weights (the
    whole model) next to its stage buffer. The buffer holds the values; the
    stages' variables only describe shapes and initializers.
    """
    for stage in stages:
        keras_api.keep_uninitialized(stage.variables)


# ---------------------------------------------------------------------------
# Pipeline: p stages, each replica holding only its own stage's weights.
# ---------------------------------------------------------------------------

@keras.saving.register_keras_serializable(package="keras_comm")
class Pipeline(StageBuffer, _common.ParallelLayer):
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
        _keep_unallocated(stages)
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

    def traced_instructions(self):
        """``{rank: [instruction list, ...]}``: what each local replica traced, in order.

        One list per traced forward, backward or training table, as the
        executor ran it: how a schedule was interleaved on this process.
        """
        return {rank: list(runs) for rank, runs in self._traced_instructions.items()}

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
        _keep_unallocated(self._holder.items)
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
            self._weight_shards.append([self._check_stage_weight(s, v) for v in stage.trainable_variables])
            entries, offset, dtype = self._flat_layout(stage.trainable_variables, dtype, "stage weight")
            self._layout.append((entries, offset))
        self._weight_dtype = dtype or "float32"
        self._build_state_layout()
        sizes = [size for _, size in self._layout]
        length = sum(sizes) if n == 1 else max(sizes)
        self._tp_axes = sorted({d.spec.mesh_axis for ws in self._weight_shards for d in ws if d is not None})
        self._buffer = self.add_weight(
            name=_stage_buffer.BUFFER_NAME,
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
                _stage_buffer.StageBufferSpec(
                    (full_size,), 0, self.mesh, self.axis, self._gather_group(0).size,
                    tuple(sizes), owner=self,
                ),
            )
        self._state_buffer = None
        if any(size for _, size in self._state_layout):
            state_sizes = [size for _, size in self._state_layout]
            self._state_buffer = self.add_weight(
                name=_stage_buffer.STATE_NAME,
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
            annotations.register_composite(self._state_buffer, _stage_buffer.NoValues())
        self._assign_initial_values()
        self.built = True

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

    # -- computing a stage ---------------------------------------------------------

    def _run_stage(self, s, values, x, training, state_values=()):
        """Stage s on `x`: ``(output, the stage's new non-trainable values)``."""
        stage = self._holder.items[s]
        kwargs = {}
        if training is not None and keras_api.call_has_training_arg(stage):
            kwargs["training"] = training
        out, new_state = stage.stateless_call(values, list(state_values), x, **kwargs)
        return out, list(new_state)

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
            ex = Executor(self, s, group, x, flat, training, state=state)
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
        ex = Executor(self, s, group, x, flat, True, loss_fn=loss_fn, state=self._state_tensor())
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


class _Hidden:
    """A plain holder: neither Keras's trackers nor its saving walk look inside."""

    def __init__(self, items):
        self.items = items

