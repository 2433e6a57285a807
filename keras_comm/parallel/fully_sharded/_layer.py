"""`FullyShard`: the layer that holds 1/N of a wrapped layer's weights."""


import inspect
import zlib

import keras
import numpy as np
import tensorflow as tf

from keras_comm import _validation
from keras_comm import topology
from keras_comm._private import keras_api
from keras_comm.ops import _differentiable as D
from keras_comm.parallel import _checkpoint
from keras_comm.parallel import _collectives
from keras_comm.parallel import _common
from keras_comm.parallel import _initial
from keras_comm.parallel import mesh as mesh_lib
from keras_comm.parallel import sharded_weights
from keras_comm.variables import annotations
from keras_comm.parallel.fully_sharded._checkpoint_names import CheckpointEntry
from keras_comm.parallel.fully_sharded._collectives import ShardCollectives
from keras_comm.parallel.fully_sharded._collectives import after
from keras_comm.parallel.fully_sharded._collectives import trace_state
from keras_comm.parallel.fully_sharded._param import Accumulation
from keras_comm.parallel.fully_sharded._param import FlatShardSpec
from keras_comm.parallel.fully_sharded._param import Hidden
from keras_comm.parallel.fully_sharded._param import is_float
from keras_comm.parallel.fully_sharded._param import reduce_over_other_axes
from keras_comm.parallel.fully_sharded._param import weight_name


def _symbolic(value):
    """A KerasTensor standing for each tensor in a nest (for building only)."""

    def convert(x):
        if isinstance(x, keras.KerasTensor):
            return x
        if isinstance(x, (tf.Tensor, tf.Variable, np.ndarray, keras.Variable)):
            return keras.KerasTensor(tuple(x.shape), dtype=keras.backend.standardize_dtype(x.dtype))
        return x

    return tf.nest.map_structure(convert, value)


def _is_tensor(x):
    return isinstance(x, (tf.Tensor, np.ndarray, tf.Variable, keras.Variable)) or tf.is_tensor(x)


@keras.saving.register_keras_serializable(package="keras_comm")
class FullyShard(ShardCollectives, CheckpointEntry, _common.ParallelLayer):
    """Wraps a Keras layer so that each replica holds 1/N of its weights.

    Forward: all-gather the layer's weight shards, run the layer on the full
    weights, drop them. Backward: gather again, recompute the layer's
    forward, reduce-scatter (SUM) the weight gradients: each replica gets
    its shards' gradient summed over the shard group. See the module
    docstring of `keras_comm.parallel.fully_shard`.

    Args:
        layer: any Keras layer with weights (Dense, Conv, Embedding,
            LayerNormalization, MultiHeadAttention, a nested
            Sequential/Functional block, a custom layer). An unbuilt layer
            is built inside the wrapper without allocating its weights; a
            built one gives its current values and is not used further (a
            copy built from its config takes its place).
        mesh: None (shard over every replica), a `keras_comm.parallel.Mesh`,
            or a list of rank lists (the shard groups).
        axis: the mesh axis whose groups share one set of shards ("data").
            Gradients are also summed over the mesh's other axes.
        accumulation: "sharded" (default) or "local"; see
            `keras_comm.parallel.Accumulation`.
        accumulation_steps: with "local", the number of micro-batches per
            update (equal to `ParallelOptimizer`'s).
        seed: int offset of the seeds given to unseeded initializers (the
            seed of a full weight is derived from its path plus this). With
            more than one worker, worker 0 computes each full weight and
            broadcasts it, so every worker slices the same values.
        timeout: seconds; None for `keras_comm.get_timeout()`.
        checkpoint_name: None (the file entry is Keras's name for this
            wrapper, "fully_shard", "fully_shard_1", ...) or the entry
            name the unwrapped model's file uses for the inner layer
            ("dense_1"): then this layer writes and reads that entry, and
            the unwrapped model and this one load each other's files.
            `fully_shard` and `set_checkpoint_names` set it. It applies
            where Keras lists the wrapper by class (a layer list); a
            wrapper saved under an attribute's name keeps that name. A
            file without that entry is read from the wrapper's own entry
            (files written without it).
        prefetch: True (default): the layer's all-gather may start one
            wrapped layer early -- forward, once the previous wrapped
            layer's input exists; backward, once the upstream gradient of
            the layer after it exists -- so it can overlap that layer's
            compute; at most about two layers' full weights are live.
            False: each gather waits for its own layer's input (forward)
            or upstream gradient (backward).

    Input shape / Output shape: those of `layer`.

    Raises:
        TypeError: `layer` is not a Keras layer.
        ValueError: `layer` is a FullyShard or a tensor-parallel layer; at
            build, the layer has no weights, state that is not a weight (a
            seed generator), a weight that cannot be sharded (integer
            dtype, regularizer or constraint), weights created outside
            `build`, or the mesh does not fit the world.

    Example:

    ```python
    strategy = tf.distribute.MultiWorkerMirroredStrategy()
    with strategy.scope():
        model = keras.Sequential([
            keras.Input((784,)),
            keras_comm.parallel.FullyShard(keras.layers.Dense(1024, activation="relu")),
            keras_comm.parallel.FullyShard(keras.layers.Dense(10)),
        ])
        model.compile(keras.optimizers.Adam(1e-3), "sparse_categorical_crossentropy")
    ```
    """

    def __init__(
        self,
        layer,
        mesh=None,
        axis="data",
        accumulation="sharded",
        accumulation_steps=1,
        seed=None,
        timeout=None,
        checkpoint_name=None,
        prefetch=True,
        **kwargs,
    ):
        if isinstance(layer, dict):
            layer = keras.saving.deserialize_keras_object(layer)
        if not isinstance(layer, keras.layers.Layer):
            raise TypeError(
                f"FullyShard wraps a Keras layer. Received: layer={layer!r}"
            )
        if isinstance(layer, FullyShard):
            raise ValueError(
                f"FullyShard: layer {layer.name!r} is already fully sharded. "
                f"Received: layer={layer!r}"
            )
        if isinstance(layer, _common.ParallelLayer):
            raise ValueError(
                f"FullyShard: layer {layer.name!r} is a keras_comm parallel "
                "layer whose weights are sharded already; wrap the plain "
                "layers beside it (FullyShard over one mesh axis, "
                f"tensor parallelism over another). Received: layer={type(layer).__name__}"
            )
        kwargs.setdefault("name", layer.name)
        kwargs.setdefault("dtype", layer.dtype_policy)
        super().__init__(mesh=mesh, axis=axis, seed=seed, timeout=timeout, **kwargs)
        self.accumulation = Accumulation.from_value(accumulation)
        self._accumulation_window = None  # set by ParallelOptimizer
        self.accumulation_steps = _validation.accumulation_steps(accumulation_steps)
        if checkpoint_name is not None and (
            not isinstance(checkpoint_name, str) or not checkpoint_name or "/" in checkpoint_name
        ):
            raise ValueError(
                "FullyShard: `checkpoint_name` must be None or a file entry "
                "name (a non-empty string without '/', e.g. 'dense_1'). "
                f"Received: checkpoint_name={checkpoint_name!r}"
            )
        self.checkpoint_name = checkpoint_name
        if not isinstance(prefetch, bool):
            raise TypeError(
                f"FullyShard: `prefetch` must be True or False. Received: prefetch={prefetch!r}"
            )
        self.prefetch = prefetch
        initial = None
        if layer.built:
            initial = [np.asarray(keras.ops.convert_to_numpy(w)) for w in layer.weights]
            layer = layer.__class__.from_config(layer.get_config())
        self._hidden = Hidden(layer, initial)
        self._shards = []
        self._specs = []
        self._non_trainable = []
        self._order = []

    # --- Access -------------------------------------------------------------

    def inner_layer(self):
        """The wrapped layer (built without storage: use `full_weights`)."""
        return self._hidden.layer

    @property
    def shard_variables(self):
        """This layer's trainable weight shards, in the inner layer's order."""
        return list(self._shards)

    def group_size(self):
        return mesh_lib.runtime_mesh(self.mesh, self.axis).axis_size(self.axis)

    # --- Build --------------------------------------------------------------

    def __call__(self, *args, **kwargs):
        if not self.built:
            # Building needs the real call arguments (MultiHeadAttention takes
            # several inputs): `build` runs the inner layer on stand-ins.
            self._hidden.pending = (_symbolic(args), _symbolic(kwargs))
            try:
                self.build(None)
            finally:
                self._hidden.pending = None
        return super().__call__(*args, **kwargs)

    def build(self, input_shape):
        inner = self._hidden.layer
        if tf.inside_function():
            # A model without a keras.Input builds on its first batch, inside
            # Keras's traced step or its symbolic build: there the full
            # initial values are symbolic and the shards cannot be created.
            raise ValueError(
                f"FullyShard: layer {self.name!r} must be built before the "
                "model is first traced (fit, evaluate or predict on an unbuilt "
                "model builds it inside a traced function, where its full "
                "initial weights cannot be computed and sharded). Start the "
                "model with keras.Input(shape), or call model.build(input_shape) "
                "or the model on a batch under the strategy's scope first. "
                f"Received: input_shape={input_shape}"
            )
        if self._hidden.pending is not None:
            args, kwargs = self._hidden.pending
        else:
            args, kwargs = (keras.KerasTensor(tuple(input_shape), dtype=self.input_dtype),), {}
        kwargs = {k: v for k, v in kwargs.items() if k not in ("training", "mask")}
        try:
            with keras.StatelessScope(initialize_variables=False):
                inner(*args, **kwargs)
        finally:
            keras_api.keep_uninitialized(inner.variables)
        self._check_inner(inner)
        self._hidden.takes_training = "training" in inspect.signature(inner.call).parameters
        self._hidden.num_variables = len(inner.variables)
        self._create_state(inner)
        self._hidden.initial = None

    @classmethod
    def _in_place(cls, layer, **options):
        """A wrapper holding `layer` itself (built, inside a model) as its inner layer.

        `fully_shard` on a model it shards in place (a KerasHub backbone or
        task) wraps each layer that owns weights where it stands: the
        layer's current values (or, built inside `deferred_weights`, its
        initializers) give the shards' initial values and its own storage
        is freed, so the layer serves as the inner layer (shapes, dtypes,
        structure) as the stateless copy the constructor makes would. The
        wrapper is built; `options` are the constructor's.
        """
        # A stand-in with the layer's name and policy: the constructor
        # copies a built layer from its config and reads its values, which
        # this wrapper takes from the layer itself.
        wrapper = cls(keras.layers.Layer(name=layer.name, dtype=layer.dtype_policy), **options)
        wrapper._adopt(layer)
        return wrapper

    def _adopt(self, layer):
        own = keras_api.own_weights(layer)
        # A weight built under `deferred_weights` has no value yet: its
        # initializer (seeded when the layer was made) gives the value the
        # unsharded model gets, one weight at a time.
        initial = [
            keras_api.deferred_initializer(w) if keras_api.is_uninitialized(w)
            else np.asarray(keras.ops.convert_to_numpy(w))
            for w in own
        ]
        keras_api.drop_storage(own)
        self._hidden = Hidden(layer, initial)
        self._check_inner(layer)
        self._hidden.takes_training = "training" in inspect.signature(layer.call).parameters
        self._hidden.num_variables = len(layer.variables)
        self._create_state(layer)
        self._hidden.initial = None
        self.supports_masking = layer.supports_masking
        self.built = True

    def _check_inner(self, inner):
        name = inner.name
        weight_ids = {id(w) for w in inner.weights}
        extra = [v for v in inner.variables if id(v) not in weight_ids]
        if extra:
            raise ValueError(
                f"FullyShard: layer {name!r} has state that is not a weight "
                f"({extra[0].path}: a seed generator, e.g. Dropout with "
                "rate > 0, or a metric); keep such layers outside the "
                f"FullyShard. Received: {len(extra)} non-weight variables"
            )
        if not inner.weights:
            raise ValueError(
                f"FullyShard: layer {name!r} has no weights after build, so "
                "there is nothing to shard (a layer that creates its weights "
                "lazily in `call` must create them in `build`). "
                f"Received: layer={type(inner).__name__}"
            )
        allocated = [w for w in inner.weights if not keras_api.is_uninitialized(w)]
        if allocated:
            raise ValueError(
                f"FullyShard: layer {name!r} created weight "
                f"{allocated[0].path!r} outside `build` (in `__init__`), so it "
                "already holds its full value; create weights in `build`. "
                f"Received: {len(allocated)} allocated weights"
            )
        for w in inner.trainable_weights:
            if not is_float(w.dtype):
                raise ValueError(
                    f"FullyShard: layer {name!r}'s trainable weight {w.path!r} "
                    "cannot be sharded: it must be floating (it carries a "
                    f"gradient). Received: dtype={w.dtype}"
                )
            if w.regularizer is not None or w.constraint is not None:
                raise ValueError(
                    f"FullyShard: layer {name!r}'s weight {w.path!r} has a "
                    "regularizer or constraint, which needs the full weight "
                    "on every replica; put it in the loss or drop it. "
                    f"Received: regularizer={w.regularizer!r}, constraint={w.constraint!r}"
                )

    def _initial_value(self, inner, w, strategy):
        """`w`'s full initial value (numpy): worker 0's, on every worker.

        One weight at a time, so a worker holds at most one full weight
        beside its shards. With several workers worker 0 computes it and
        broadcasts it: the seed below comes from `w.path`, whose automatic
        layer names count the layers each process made before, and a layer
        wrapped after its build holds each worker's own draw.
        """

        def compute():
            if self._hidden.initial is not None:
                value = self._hidden.initial[[id(v) for v in inner.weights].index(id(w))]
                if callable(value):  # the initializer of a deferred weight, as Keras calls it
                    value = value(tuple(w.shape), dtype=keras_api.variable_dtype(w))
                return np.asarray(keras.ops.convert_to_numpy(value))
            init = keras_api.deferred_initializer(w)
            if isinstance(init, keras.initializers.Initializer):
                config = init.get_config()
                if "seed" in config and config["seed"] is None:
                    config["seed"] = (zlib.crc32(w.path.encode()) + (self.seed or 0)) % (2**31)
                    init = init.__class__.from_config(config)
            return np.asarray(keras.ops.convert_to_numpy(init(tuple(w.shape), dtype=w.dtype)))

        return _initial.chief_value(strategy, tuple(w.shape), w.dtype, compute)

    def _create_state(self, inner):
        n = self.group_size()
        trainable_ids = {id(w): i for i, w in enumerate(inner.trainable_weights)}
        non_trainable_ids = {id(w): i for i, w in enumerate(inner.non_trainable_weights)}
        self._order = [
            ("t", trainable_ids[id(w)]) if id(w) in trainable_ids else ("n", non_trainable_ids[id(w)])
            for w in inner.weights
        ]
        for w in inner.trainable_weights:
            spec = FlatShardSpec(tuple(int(d) for d in w.shape), 0, self.mesh, self.axis, n)
            shard = self.add_weight(
                name=weight_name(inner, w),
                shape=spec.shard_shape,
                initializer="zeros",
                dtype=w.dtype,
                trainable=True,
            )
            tf_var = keras_api.tf_variable(shard)
            annotations.register_spec(tf_var, spec)
            annotations.set_gradient_hook(
                tf_var, lambda g, spec=spec: reduce_over_other_axes(spec, g, self.name)
            )
            sharded_weights.assign_full(shard, self._initial_value(inner, w, sharded_weights.strategy_of([shard])))
            self._shards.append(shard)
            self._specs.append(spec)
        for w in inner.non_trainable_weights:
            v = self.add_weight(
                name=weight_name(inner, w),
                shape=tuple(w.shape),
                initializer="zeros",
                dtype=w.dtype,
                trainable=False,
                aggregation=w.aggregation,
            )
            sharded_weights.assign_full(v, self._initial_value(inner, w, sharded_weights.strategy_of([v])))
            self._non_trainable.append(v)
        if self.accumulation is Accumulation.LOCAL and self.accumulation_steps > 1:
            self._create_accumulators()

    def _buckets(self):
        """``{dtype: [shard index]}``: the shards moved in one collective each."""
        out = {}
        for i, s in enumerate(self._shards):
            out.setdefault(tf.as_dtype(s.dtype), []).append(i)
        return out

    def _create_accumulators(self):
        n = self.group_size()
        per_replica = dict(
            trainable=False,
            synchronization=tf.VariableSynchronization.ON_READ,
            aggregation=tf.VariableAggregation.NONE,
        )
        with tf.init_scope():
            for dtype, index in self._buckets().items():
                size = n * sum(self._specs[i].shard_shape[0] for i in index)
                self._hidden.acc[dtype] = tf.Variable(
                    tf.zeros([size], dtype), name=f"{self.name}_grad_acc", **per_replica
                )
            self._hidden.count = tf.Variable(
                tf.constant(0, tf.int64), name=f"{self.name}_micro_step", **per_replica
            )

    # --- Compute ------------------------------------------------------------

    def compute_output_spec(self, *args, training=None, **kwargs):
        kwargs.pop("mask", None)
        return self._hidden.layer.compute_output_spec(*args, **kwargs)

    def _run(self, full, non_trainable, flat_inputs, structure, kwargs):
        """The inner layer on `full` weights; returns its flat outputs, its
        updated non-trainable weights and its losses."""
        inner = self._hidden.layer
        args, kw = tf.nest.pack_sequence_as(structure, flat_inputs)
        with keras.StatelessScope(initialize_variables=False):
            y, new_nt, losses = inner.stateless_call(
                full, non_trainable, *args, return_losses=True, **kw, **kwargs
            )
        if len(inner.variables) != self._hidden.num_variables:
            raise ValueError(
                f"FullyShard: layer {inner.name!r} created weights in `call`, "
                "after it was built; they cannot be sharded. Create every "
                "weight in `build`. Received: "
                f"{len(inner.variables) - self._hidden.num_variables} new variables"
            )
        flat_y = tf.nest.flatten(y)
        return flat_y, list(new_nt), list(losses), y

    def call(self, *args, training=None, **kwargs):
        inner = self._hidden.layer
        extra = {}
        if training is not None and self._hidden.takes_training:
            extra["training"] = training
        structure = (list(args), dict(kwargs))
        leaves = tf.nest.flatten(structure)
        tensor_at = [i for i, x in enumerate(leaves) if _is_tensor(x)]
        inputs = [tf.convert_to_tensor(leaves[i]) for i in tensor_at]
        diff_at = [j for j, x in enumerate(inputs) if x.dtype.is_floating]

        def rebuild(diff):
            values = list(inputs)
            for j, x in zip(diff_at, diff):
                values[j] = x
            out = list(leaves)
            for i, x in zip(tensor_at, values):
                out[i] = x
            return out

        non_trainable = [tf.convert_to_tensor(keras_api.tf_variable(v)) for v in self._non_trainable]
        if self._outside_replica_step():
            full = [tf.constant(v) for v in self._host_full()]
            flat_y, _, _, y = self._run(full, non_trainable, leaves, structure, extra)
            return tf.nest.pack_sequence_as(y, flat_y)
        shards = [tf.convert_to_tensor(keras_api.tf_variable(s)) for s in self._shards]
        ns, nn = len(shards), len(non_trainable)
        meta = {}

        def forward(xs):
            s, nt, d = xs[:ns], xs[ns : ns + nn], xs[ns + nn :]
            # Gather only once the layer's input exists: TensorFlow runs an op
            # as soon as its inputs are ready, so every layer's gather (which
            # depends on nothing but its shards) would otherwise run at the
            # step's start and hold the whole model's weights at once.
            own = list(d) + [x for j, x in enumerate(inputs) if j not in diff_at]
            trace = trace_state()
            gate = own
            if trace is not None:
                if self.prefetch and trace.forward_gate is not None:
                    gate = trace.forward_gate  # one layer early: the previous input
                trace.forward_gate = own
                meta["position"] = len(trace.chain)
                trace.chain.append((self, list(s)))
            s = after(s, gate)
            flat_y, new_nt, losses, y = self._run(self._gather(s), nt, rebuild(d), structure, extra)
            meta.update(y=y, ny=len(flat_y), nl=len(losses))
            return flat_y + new_nt + losses

        def backward(dys, xs, ys):
            s, nt, d = xs[:ns], xs[ns : ns + nn], xs[ns + nn :]
            ny = meta["ny"]
            # Again (the forward kept nothing), once the upstream gradient exists.
            own = [u for u in dys if u is not None]
            full = self._backward_gather(s, own, meta.get("position"))
            # Distinct tensors: an input passed twice (attention(h, h)) must
            # get each position's own gradient, not the total twice.
            d = [tf.identity(x) for x in d]
            with tf.GradientTape() as tape:
                tape.watch(full)
                tape.watch(d)
                flat_y, _, losses, _ = self._run(full, nt, rebuild(d), structure, extra)
            targets = flat_y + losses
            upstream = dys[:ny] + dys[ny + nn :]
            upstream = [
                tf.zeros_like(t) if u is None else tf.cast(u, t.dtype)
                for t, u in zip(targets, upstream)
            ]
            grads = tape.gradient(
                targets,
                full + list(d),
                output_gradients=upstream,
                unconnected_gradients=tf.UnconnectedGradients.ZERO,
            )
            grads = [tf.convert_to_tensor(g) for g in grads]
            return self._scatter(grads[:ns]) + [None] * nn + grads[ns:]

        diff = [inputs[j] for j in diff_at]
        outs = D.with_gradient(shards + non_trainable + diff, forward, backward)
        ny, nl = meta["ny"], meta["nl"]
        flat_y, new_nt, losses = outs[:ny], outs[ny : ny + nn], outs[ny + nn :]
        for v, value in zip(self._non_trainable, new_nt):
            keras_api.tf_variable(v).assign(value)
        for loss in losses:
            self.add_loss(loss)
        return tf.nest.pack_sequence_as(meta["y"], flat_y)

    def _outside_replica_step(self):
        """Called outside a replica step of the shards' strategy with more than
        one replica (KerasHub's `generate()`, a model called on the host):
        no collective can run, so the layer computes on full weights held
        on the host."""
        if _collectives.shape_only():
            return False
        strategy = sharded_weights.strategy_of(self._shards)
        if strategy.num_replicas_in_sync == 1:
            return False
        context = tf.distribute.get_replica_context()
        return context is None or context.strategy is not strategy

    def _host_full(self):
        """The trainable weights, full (numpy): those `gathered` holds, else
        (one worker only) gathered now."""
        held = self._hidden.gathered
        if held is not None:
            return held
        strategy = sharded_weights.strategy_of(self._shards)
        if topology.worker_count(strategy) > 1:
            raise ValueError(
                f"FullyShard {self.name!r} is called outside a replica step (e.g. "
                "`generate()`, or the model called directly) while its weights are "
                "split over several workers, where it cannot gather them: gather "
                "them first on every worker, `with keras_comm.parallel.gathered(model): "
                f"...`. Received: {topology.worker_count(strategy)} workers"
            )
        with tf.init_scope():
            return self._gather_on_host()

    def _gather_on_host(self):
        return _checkpoint._gather(list(zip(self._shards, self._specs)))

    # --- Whole weights ------------------------------------------------------

    def full_weights(self):
        """Host side: the inner layer's weights, full-size, in its order."""
        pairs = list(zip(self._shards, self._specs))
        trainable = _checkpoint._gather(pairs)
        non_trainable = [np.asarray(v.numpy()) for v in self._non_trainable]
        return [trainable[i] if kind == "t" else non_trainable[i] for kind, i in self._order]

    def set_full_weights(self, values):
        """Host side: assigns full values in the inner layer's weight order."""
        inner = self._hidden.layer
        if len(values) != len(self._order):
            raise ValueError(
                f"FullyShard {self.name!r}: `values` must hold one array per "
                f"weight of {inner.name!r} ({len(self._order)}). "
                f"Received: len(values)={len(values)}"
            )
        for (kind, i), value, w in zip(self._order, values, inner.weights):
            if tuple(np.shape(value)) != tuple(w.shape):
                raise ValueError(
                    f"FullyShard {self.name!r}: weight {w.path!r} has shape "
                    f"{tuple(w.shape)}. Received: value of shape {np.shape(value)}"
                )
            target = self._shards[i] if kind == "t" else self._non_trainable[i]
            sharded_weights.assign_full(target, np.asarray(value))

    # --- Checkpoints: the inner layer's structure, full-size -------------------

    def get_build_config(self):
        # Rebuilt by being called (its container calls it on the saved
        # input specs): its build needs the call's arguments, not one shape.
        return None

    def get_config(self):
        config = super().get_config()
        config.update(
            layer=keras.saving.serialize_keras_object(self._hidden.layer),
            accumulation=self.accumulation.value,
            accumulation_steps=self.accumulation_steps,
            checkpoint_name=self.checkpoint_name,
            prefetch=self.prefetch,
        )
        return config


# --- Whole models -------------------------------------------------------------

