"""Fully sharded data parallelism (ZeRO-3): `FullyShard` and `fully_shard`.

`FullyShard(layer)` wraps any Keras layer with weights. Every replica of the
shard group persistently holds 1/N of each of the layer's trainable weights
(flattened and padded, `keras_comm.parallel.flat_shard`); the full weights
exist only while the layer computes:

* **Forward**: one all-gather of the layer's packed shards (in the layer's
  compute dtype), the layer run on the gathered tensors
  (`Layer.stateless_call`), the gathered weights dropped.
* **Backward**: the shards are gathered again and the layer's forward is
  recomputed under a tape (nothing of the forward is kept but the inputs),
  then one reduce-scatter (SUM) of the packed full-weight gradients: each
  replica receives its shards' gradients already summed over the shard
  group. The input gradient flows on as usual.
* **Optimizer**: the shards are ordinary trainable weights of the model, so
  a plain Keras optimizer updates them and its slots are shard-sized. Each
  shard carries its own gradient reduction
  (`keras_comm.training.reduction`), which replaces the world all-reduce:
  nothing when the shard group is the world, a SUM over the replicas that
  hold the same shard otherwise (the other axes of a `Mesh`). No gradient is
  reduced twice.

With `prefetch` (the default) each gather may start one wrapped layer
early, to overlap the previous layer's compute: at most about two layers'
full weights are gathered at once (`FullyShard._backward_gather`).

The inner layer is built inside a `keras.StatelessScope`, so its own
variables are never allocated: they give the shapes, dtypes, initializers and
the checkpoint structure, nothing else. Non-trainable weights (BatchNorm's
moving statistics) are held whole on every replica and updated as in plain
data parallelism.

Gradient accumulation (`keras_comm.callbacks.ParallelOptimizer(
accumulation_steps=k)`) composes in two ways, chosen by `accumulation`:

* ``"sharded"`` (default): every micro-batch's gradient is reduce-scattered
  at once, and ParallelOptimizer accumulates the 1/N gradient shards.
  Memory stays 1/N; the reduce-scatter runs k times per update.
* ``"local"``: each replica adds its full-size local gradient into a padded
  buffer of the layer's size and reduce-scatters it once per update (on the
  k-th backward; the others hand zeros to the optimizer). One
  reduce-scatter per update, at the price of a full-size gradient buffer per
  layer on every replica. `accumulation_steps` must equal the callback's.

Saving: a `FullyShard` writes its inner layer's structure (its variables at
its own path, its sublayers' below it), every weight full-size, gathered from
the shards; so `.keras` / `save_weights` / `BackupAndRestore` files are what
the unwrapped model holds and loads, and any cluster size loads them. Keras
names a file's entries after the layers' classes ("fully_shard", "dense_1");
a wrapper given `checkpoint_name` (`fully_shard` sets it to the entry name
the unwrapped model uses) writes and reads its entry under that name, so the
file is the unwrapped model's: each loads the other's files directly.
Optimizer slots are written full-size in the unwrapped weight's shape
(`keras_comm.parallel._checkpoint`).
"""

import enum
import inspect
import re
import threading
import types
import zlib

import keras
import numpy as np
import tensorflow as tf

from keras_comm import _validation
from keras_comm import ops
from keras_comm._private import keras_api
from keras_comm.ops import _differentiable as D
from keras_comm.parallel import _checkpoint
from keras_comm.parallel import _collectives
from keras_comm.parallel import _common
from keras_comm.parallel import _initial
from keras_comm.parallel import flat_shard
from keras_comm.parallel import mesh as mesh_lib
from keras_comm.parallel import sharded
from keras_comm.variables import annotations
from keras_comm.variables import packing


class Accumulation(enum.Enum):
    """How a `FullyShard` layer's gradients are accumulated over micro-batches.

    SHARDED: reduce-scatter every micro-batch; accumulate 1/N shards.
    LOCAL: accumulate the full local gradient; reduce-scatter once per update.
    """

    SHARDED = "sharded"
    LOCAL = "local"

    @classmethod
    def from_value(cls, value):
        if isinstance(value, cls):
            return value
        _validation.one_of(value, [m.value for m in cls], "accumulation")
        return cls(value)


class _Hidden:
    """Holds the inner layer and private state out of Keras's and TF's tracking.

    A tracked inner layer would put its (unallocated) variables into the
    model's weights and its own entry into checkpoints.
    """

    def __init__(self, layer, initial):
        self.layer = layer
        self.initial = initial
        self.pending = None
        self.structure = None
        self.num_variables = None
        self.takes_training = False
        self.acc = {}
        self.count = None


def _is_float(dtype):
    return tf.as_dtype(keras.backend.standardize_dtype(dtype)).is_floating


def _weight_name(inner, variable):
    path = variable.path
    prefix = inner.name + "/"
    if path.startswith(prefix):
        path = path[len(prefix):]
    return path.replace("/", "_")


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
class FullyShard(_common.ParallelLayer):
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
        self._hidden = _Hidden(layer, initial)
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
            if not _is_float(w.dtype):
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
                return self._hidden.initial[[id(v) for v in inner.weights].index(id(w))]
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
            spec = flat_shard.FlatShardSpec(tuple(int(d) for d in w.shape), 0, self.mesh, self.axis, n)
            shard = self.add_weight(
                name=_weight_name(inner, w),
                shape=spec.shard_shape,
                initializer="zeros",
                dtype=w.dtype,
                trainable=True,
            )
            tf_var = keras_api.tf_variable(shard)
            annotations.register_spec(tf_var, spec)
            annotations.set_gradient_hook(
                tf_var, lambda g, spec=spec: _reduce_over_other_axes(spec, g, self.name)
            )
            sharded.assign_full(shard, self._initial_value(inner, w, sharded._strategy_of([shard])))
            self._shards.append(shard)
            self._specs.append(spec)
        for w in inner.non_trainable_weights:
            v = self.add_weight(
                name=_weight_name(inner, w),
                shape=tuple(w.shape),
                initializer="zeros",
                dtype=w.dtype,
                trainable=False,
                aggregation=w.aggregation,
            )
            sharded.assign_full(v, self._initial_value(inner, w, sharded._strategy_of([v])))
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

    def _group(self):
        rank = 0 if _collectives.shape_only() else None
        return mesh_lib.runtime_mesh(self.mesh, self.axis).group(self.axis, rank)

    def _gather(self, shards):
        """Full weights (inner shapes, compute dtype) from this replica's shards."""
        group = self._group()
        n = group.size
        compute = self.compute_dtype
        full = [None] * len(shards)
        for dtype, index in self._buckets().items():
            pieces = [shards[i] for i in index]
            if dtype.is_floating and _is_float(compute) and tf.as_dtype(compute) != dtype:
                pieces = [tf.cast(p, compute) for p in pieces]
            packed = tf.concat(pieces, 0) if len(pieces) > 1 else pieces[0]
            gathered = _collectives.gather_along(packed, 0, group, f"{self.name}_gather", self.timeout)
            shapes = [self._specs[i].full_shape for i in index]
            for i, w in zip(index, packing.unpack(gathered, self._layout(index, n), shapes)):
                full[i] = w
        return full

    def _layout(self, index, n):
        """The member-major layout of shards `index` over `n` members."""
        return packing.Layout([self._specs[i].size for i in index], n, minimum=1)

    def _backward_gather(self, shards, upstream, position):
        """The backward's full weights, and with `prefetch` the all-gather
        for the wrapped layer traced before this one in the forward (whose
        backward comes next), issued now so that it can run during this
        layer's recompute and gradient.

        keras_comm's collectives on a device run in program order (their
        ordering token), and this layer's reduce-scatter is traced before
        the next backward: a gather traced in the next backward would wait
        for it, and so for this layer's whole backward. Each prefetch waits
        for this layer's upstream gradient, so at most two layers' full
        weights are gathered at once.
        """
        trace = _trace_state()
        if trace is None or position is None:
            return self._gather(_after(shards, upstream))
        trace.done.add(position)
        full = trace.prefetched.pop(position, None)
        if full is None:
            full = self._gather(_after(shards, upstream))
        previous = position - 1
        if (
            self.prefetch
            and previous >= 0
            and previous not in trace.done
            and previous not in trace.prefetched
        ):
            layer, layer_shards = trace.chain[previous]
            trace.prefetched[previous] = layer._gather(_after(layer_shards, upstream))
        return full

    def _scatter(self, grads):
        """This replica's shard gradients from the full local gradients."""
        group = self._group()
        n = group.size
        out = [None] * len(self._shards)
        local = self.accumulation is Accumulation.LOCAL and self.accumulation_steps > 1
        if local:
            self._check_local_window()
            count = self._hidden.count
            update = tf.equal((count.read_value() + 1) % self.accumulation_steps, 0)
        for dtype, index in self._buckets().items():
            packed = packing.pack([grads[i] for i in index], self._layout(index, n), dtype)

            def reduce_scatter(x):
                return _collectives.scatter_batch_sum(x, group, f"{self.name}_grad", self.timeout)

            if local:
                acc = self._hidden.acc[dtype]
                total = acc.read_value() + packed
                k = tf.shape(packed)[0] // n
                mine = tf.cond(update, lambda: reduce_scatter(total), lambda: tf.zeros([k], dtype))
                acc.assign(tf.where(update, tf.zeros_like(total), total))
            else:
                mine = reduce_scatter(packed)
            sizes = [self._specs[i].shard_shape[0] for i in index]
            for i, piece in zip(index, tf.split(mine, sizes)):
                out[i] = piece
        if local:
            self._hidden.count.assign_add(1)
        if tf.as_dtype(self.compute_dtype) == tf.float16:
            out = self._poison_if_any_non_finite(grads, out, group)
        return out

    def _poison_if_any_non_finite(self, grads, out, group):
        """float16 compute (loss scaling): every replica's shard gradients
        become NaN when any replica's local gradient of this layer overflowed.

        A LossScaleOptimizer skips a step when its gradients are not finite,
        judging the gradients it holds; here each replica holds a different
        shard, and an overflow lands in one replica's shard only, so the
        replicas would disagree: some skip (and halve their loss scale), the
        others apply the infinity (Keras's multi-replica apply takes the first
        replica's verdict). One scalar all-reduce per layer makes the verdict
        the shard group's; the mesh's other axes see the NaN through the
        shard's sum over them. Exact otherwise (x + 0 == x).
        """
        bad = tf.add_n(
            [tf.reduce_sum(tf.cast(tf.logical_not(tf.math.is_finite(g)), tf.float32)) for g in grads]
        )
        if group.size > 1 and not _collectives.shape_only():
            bad = ops.all_reduce(bad, group=group, timeout=self.timeout, name=f"{self.name}_grad_finite")
        poison = tf.where(bad > 0, tf.constant(float("nan")), tf.constant(0.0))
        return [o + tf.cast(poison, o.dtype) for o in out]

    def set_accumulation_window(self, steps):
        """Declares who applies this layer's "local" accumulation.

        `keras_comm.callbacks.ParallelOptimizer` calls it when a `fit` it
        serves begins (its `accumulation_steps`, once it has checked that its
        updates fall on the layer's every k-th backward) and ends (None).
        """
        self._accumulation_window = steps

    def _check_local_window(self):
        """At trace time of a backward with "local" accumulation: a
        ParallelOptimizer with the same `accumulation_steps` must serve the
        fit, or the optimizer would apply zero gradients k-1 times in k."""
        k = self.accumulation_steps
        if self._accumulation_window != k:
            raise ValueError(
                f"FullyShard {self.name!r}: accumulation='local' with "
                f"accumulation_steps={k} reduce-scatters once every {k} backward "
                "passes, so it trains only under model.fit with "
                f"keras_comm.callbacks.ParallelOptimizer(accumulation_steps={k}) "
                "(without it the optimizer would apply zero gradients k-1 "
                "times in k). Received: no ParallelOptimizer serving this fit"
            )

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

        shards = [tf.convert_to_tensor(keras_api.tf_variable(s)) for s in self._shards]
        non_trainable = [tf.convert_to_tensor(keras_api.tf_variable(v)) for v in self._non_trainable]
        ns, nn = len(shards), len(non_trainable)
        meta = {}

        def forward(xs):
            s, nt, d = xs[:ns], xs[ns : ns + nn], xs[ns + nn :]
            # Gather only once the layer's input exists: TensorFlow runs an op
            # as soon as its inputs are ready, so every layer's gather (which
            # depends on nothing but its shards) would otherwise run at the
            # step's start and hold the whole model's weights at once.
            own = list(d) + [x for j, x in enumerate(inputs) if j not in diff_at]
            trace = _trace_state()
            gate = own
            if trace is not None:
                if self.prefetch and trace.forward_gate is not None:
                    gate = trace.forward_gate  # one layer early: the previous input
                trace.forward_gate = own
                meta["position"] = len(trace.chain)
                trace.chain.append((self, list(s)))
            s = _after(s, gate)
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

    # --- Whole weights ------------------------------------------------------

    def full_weights(self):
        """Host side: the inner layer's weights, full-size, in its order."""
        pairs = list(zip(self._shards, self._specs))
        trainable = _checkpoint._gather(self, pairs)
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
            sharded.assign_full(target, np.asarray(value))

    # --- Checkpoints: the inner layer's structure, full-size -------------------

    def _entry_path(self, path):
        """The unwrapped model's entry for this layer: `path`'s last part
        replaced by `checkpoint_name` when `path` is an entry of a layer
        list (Keras's class-based "fully_shard_1"); None otherwise (a layer
        saved under an attribute's name, which the unwrapped model shares)."""
        if self.checkpoint_name is None:
            return None
        parent, _, last = path.rpartition("/")
        if not _LIST_ENTRY.fullmatch(last):
            return None
        return f"{parent}/{self.checkpoint_name}" if parent else self.checkpoint_name

    def save_own_variables(self, store):
        inner = self._hidden.layer
        values = self.full_weights()
        path = keras_api.weights_store_path(store)
        entry = self._entry_path(path)
        if entry is not None:
            path = entry
            # Repositions the store, as Keras's own walk does per layer.
            store.make(path, metadata={"name": inner.name})
        with keras.StatelessScope(
            state_mapping=list(zip(inner.weights, values)), initialize_variables=False
        ):
            inner.save_own_variables(store)
            keras_api.save_children(inner, store, path)

    def load_own_variables(self, store):
        inner = self._hidden.layer
        path = keras_api.weights_store_path(store)
        entry = self._entry_path(path)
        if entry is not None and _store_has(store, entry):
            path = entry
            store.get(path)
        with keras.StatelessScope(initialize_variables=False) as scope:
            inner.load_own_variables(store)
            keras_api.load_children(inner, store, path)
            values = [scope.get_current_value(w) for w in inner.weights]
        missing = [w.path for w, v in zip(inner.weights, values) if v is None]
        if missing:
            raise ValueError(
                f"FullyShard {self.name!r}: the file holds no value for "
                f"{missing[0]!r} (was it written by another architecture?). "
                f"Received: {len(missing)} weights missing"
            )
        self.set_full_weights([np.asarray(v) for v in values])

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


# Keras's name for a FullyShard in a layer list: its class in snake case,
# numbered per class (keras.src.saving.saving_lib._save_container_state).
_LIST_ENTRY = re.compile(r"fully_shard(_[0-9]+)?")


def _store_has(store, path):
    has_path = getattr(store, "has_path", None)  # Keras >= 3.12
    if has_path is not None:
        return has_path(path)
    return path in store.h5_file


def _snake_case(name):
    # keras.src.utils.naming.to_snake_case, which names a file's entries.
    name = re.sub(r"\W+", "", name)
    name = re.sub("(.)([A-Z][a-z]+)", r"\1_\2", name)
    name = re.sub("([a-z])([A-Z])", r"\1_\2", name).lower()
    return name


def _is_layer_list_model(model):
    """Sequential or Functional (subclasses too): Keras saves their `layers`
    as one list, each entry named after its class (public names only: the
    type's MRO, as Keras's `_obj_type`)."""
    return isinstance(model, keras.Model) and any(
        c.__name__ in ("Sequential", "Functional") for c in type(model).__mro__
    )


def set_checkpoint_names(model):
    """Names every `FullyShard`'s file entry as the unwrapped model's.

    Keras names the entries of a Sequential/Functional model's layer list
    after each layer's class, numbered per class in list order ("dense",
    "dense_1", ...; never the layer's `name`, which differs between two
    instances of one model). A wrapper is listed under its own class
    ("fully_shard", "fully_shard_1"), so a model with hand-placed wrappers
    writes files the unwrapped model cannot load (Keras raises: its layers
    find no entry) and cannot load the unwrapped model's. This gives each
    wrapper, as its `checkpoint_name`, the entry its inner layer has in the
    unwrapped model; afterwards each model loads the other's `.keras` /
    `.weights.h5` files. `fully_shard` calls it on its copy.

    Nested Sequential/Functional models are entered. Layers a subclassed
    model tracks as attributes are saved under the attribute's name, which
    the unwrapped model shares, so they need (and get) no name.

    Args:
        model: a Keras model holding `FullyShard` layers.

    Returns:
        `model`.

    Raises:
        TypeError: `model` is not a Keras model.
    """
    if not isinstance(model, keras.Model):
        raise TypeError(
            f"set_checkpoint_names takes a Keras model. Received: model={model!r}"
        )
    _set_checkpoint_names(model)
    return model


def _set_checkpoint_names(model):
    """Gives every FullyShard in `model`'s layer list (Sequential and
    Functional) the entry name Keras's saving gives its inner layer in the
    unwrapped model: the snake case of the class, made unique per container
    in the order of `layers`."""
    listed = _is_layer_list_model(model)
    used = {}
    for layer in getattr(model, "layers", []):
        if isinstance(layer, keras.Model):
            _set_checkpoint_names(layer)
        if not listed:
            continue
        unwrapped = layer.inner_layer() if isinstance(layer, FullyShard) else layer
        base = _snake_case(type(unwrapped).__name__)
        if base in used:
            used[base] += 1
            name = f"{base}_{used[base]}"
        else:
            used[base] = 0
            name = base
        if isinstance(layer, FullyShard):
            layer.checkpoint_name = name


class _Trace:
    """What the wrapped layers traced so far into one graph, by one thread,
    share for prefetching: the last forward's gate, the forward order of
    the layers with their shard tensors, the backwards traced, and the
    gathers issued ahead ({forward position: full weights})."""

    def __init__(self):
        self.forward_gate = None
        self.chain = []
        self.done = set()
        self.prefetched = {}


# The graph's own attribute, {thread id: _Trace}: in-process replicas trace
# each in its own thread into one graph. Kept on the graph (not in a weak map
# keyed by it: the traces hold the graph's tensors, which hold the graph) so
# that it lives and dies with the trace.
_TRACE_ATTRIBUTE = "keras_comm_fully_shard_traces"


def _trace_state():
    """The current graph's and thread's `_Trace`; None when eager."""
    if tf.executing_eagerly():
        return None
    graph = tf.compat.v1.get_default_graph()
    traces = getattr(graph, _TRACE_ATTRIBUTE, None)
    if traces is None:
        traces = {}
        setattr(graph, _TRACE_ATTRIBUTE, traces)
    return traces.setdefault(threading.get_ident(), _Trace())


def _after(tensors, dependencies):
    """`tensors`, computed only after every tensor in `dependencies`."""
    if not dependencies or tf.executing_eagerly():
        return list(tensors)
    with tf.control_dependencies(dependencies):
        return [tf.identity(t) for t in tensors]


def _reduce_over_other_axes(spec, grad, name):
    """Replica context: the shard gradient is summed over the shard group
    already; sum it over the replicas holding the same shard."""
    group = spec.data_group()
    if group.size == 1 or grad is None:
        return grad
    return ops.all_reduce(grad, group=group, name=f"{name}_shard_grad")


# --- Whole models -------------------------------------------------------------


def fully_sharded_layers(model_or_layer):
    """The `FullyShard` layers of a model or layer, nested models included."""
    if isinstance(model_or_layer, FullyShard):
        return [model_or_layer]
    out = []
    for layer in getattr(model_or_layer, "layers", []):
        out += [layer] if isinstance(layer, FullyShard) else fully_sharded_layers(layer)
    return out


_fully_sharded_layers = fully_sharded_layers


def _owners(model_or_layer):
    owners = {}
    for layer in _fully_sharded_layers(model_or_layer):
        for w in layer.weights:
            owners[id(w)] = layer
    return owners


def full_weights(model_or_layer):
    """Host side: every weight as a full numpy array, in the unwrapped order.

    `FullyShard` layers give their inner layer's weights (gathered);
    tensor-parallel sharded weights are gathered
    (`keras_comm.parallel.sharded.full_weights`); plain weights are read.
    The order is the unwrapped model's ``model.weights``.
    """
    if isinstance(model_or_layer, FullyShard):
        return model_or_layer.full_weights()
    owners = _owners(model_or_layer)
    if not owners:
        return sharded.full_weights(model_or_layer)
    weights = list(model_or_layer.weights)
    plain = sharded.full_weights(
        types.SimpleNamespace(weights=[w for w in weights if id(w) not in owners])
    )
    plain = iter(plain)
    out, done = [], set()
    for w in weights:
        owner = owners.get(id(w))
        if owner is None:
            out.append(next(plain))
        elif id(owner) not in done:
            done.add(id(owner))
            out.extend(owner.full_weights())
    return out


def set_full_weights(model_or_layer, values):
    """Host side: assigns full values in the unwrapped model's weight order
    (e.g. the unwrapped model's `get_weights()`)."""
    if isinstance(model_or_layer, FullyShard):
        return model_or_layer.set_full_weights(values)
    owners = _owners(model_or_layer)
    if not owners:
        return sharded.set_full_weights(model_or_layer, values)
    weights = list(model_or_layer.weights)
    expected, seen = 0, set()
    for w in weights:
        owner = owners.get(id(w))
        if owner is None:
            expected += 1
        elif id(owner) not in seen:
            seen.add(id(owner))
            expected += len(owner._order)
    if len(values) != expected:
        raise ValueError(
            f"`values` must hold one array per weight of the unwrapped model "
            f"({expected}). Received: len(values)={len(values)}"
        )
    values = iter(values)
    done = set()
    for w in weights:
        owner = owners.get(id(w))
        if owner is None:
            sharded.set_full_weights(types.SimpleNamespace(weights=[w]), [next(values)])
        elif id(owner) not in done:
            done.add(id(owner))
            owner.set_full_weights([next(values) for _ in owner._order])


def _has_weights(layer):
    return isinstance(layer, keras.layers.Layer) and bool(layer.weights)


def fully_shard(
    model, mesh=None, axis="data", accumulation="sharded", accumulation_steps=1, seed=None,
    prefetch=True,
):
    """A copy of a built Sequential/Functional model with every weighted layer
    wrapped in `FullyShard` (nested Sequential/Functional models are
    entered, other layers with weights wrapped whole).

    The copy starts from `model`'s current weights. Call it inside the
    strategy's scope; compile the copy.

    Args:
        model: a built `keras.Sequential` or Functional model.
        mesh, axis, accumulation, accumulation_steps, seed, prefetch: as
            for `FullyShard`.

    Returns:
        The copy (same layer names and weight order as `model`).

    Raises:
        ValueError: `model` is not built, or not Sequential/Functional.
    """
    if not isinstance(model, keras.Model) or not model.built:
        raise ValueError(
            "fully_shard copies a built Sequential or Functional model (give "
            f"a Sequential its keras.Input). Received: model={model!r}"
        )

    def clone(layer):
        if _has_weights(layer) and not isinstance(layer, (FullyShard, keras.Model)):
            return FullyShard(
                layer,
                mesh=mesh,
                axis=axis,
                accumulation=accumulation,
                accumulation_steps=accumulation_steps,
                seed=seed,
                prefetch=prefetch,
            )
        if not isinstance(layer, keras.layers.Layer):
            return layer
        return layer.__class__.from_config(layer.get_config())

    try:
        copy = keras.models.clone_model(model, clone_function=clone, recursive=True)
    except ValueError as e:
        if "subclass" in str(e).lower():
            raise ValueError(
                "fully_shard copies Sequential and Functional models; wrap the "
                f"layers of a subclassed model with FullyShard. Received: model={type(model).__name__}"
            ) from e
        raise
    _set_checkpoint_names(copy)
    return copy


def replica_state_bytes(model):
    """``{global rank: bytes}`` each local replica holds for the model's
    weights and its optimizer's variables (what sharding makes 1/N)."""
    out = {}
    variables = list(model.weights)
    if model.optimizer is not None:
        variables += list(model.optimizer.variables)
    for v in variables:
        for rank, b in sharded.shard_nbytes(v).items():
            out[rank] = out.get(rank, 0) + b
    return out
