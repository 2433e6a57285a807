"""Tensor-parallel dense layers: `ColumnParallelDense` and `RowParallelDense`.

A Column layer followed by a Row layer is Megatron's MLP split: the first
kernel is split on its output units, the second on its input units, so the
hidden activations stay split and the pair communicates once on the way in
(all-gather of the batch over the model group) and once on the way out
(reduce-scatter of the partial sums along the batch). See
`keras_comm.parallel._common` for the batch convention.
"""

import keras

from keras_comm import _validation
from keras_comm.parallel import _collectives
from keras_comm.parallel import _common
from keras_comm.parallel import sharded_weights


@keras.saving.register_keras_serializable(package="keras_comm")
class ColumnParallelDense(_common.ParallelLayer):
    """Dense layer whose kernel and bias are split on the output units.

    Forward: each member of the model group all-gathers the group's batch
    (so every member sees the same, "mirrored", input), then computes its
    ``units / n`` output columns ``act(x @ W_k + b_k)`` for those samples.
    With `gather_output`, the columns are all-gathered and each member keeps
    its own samples' rows: the output is then the plain Dense output.
    Backward (exact adjoint): the batch all-gather's gradient is a
    reduce-scatter, so each member's input gradient sums the contributions
    of all shards; the kernel shard's gradient covers all the group's
    samples and is summed over its data-parallel group only.

    Args:
        units: output size of the full layer; divisible by the group size.
        activation: Keras activation, applied per shard (elementwise).
        use_bias: whether to add a (split) bias.
        gather_output: return the full output for this replica's samples;
            otherwise return this shard's columns for the group's samples,
            the input a `RowParallelDense` expects.
        kernel_initializer, bias_initializer: initializers of the FULL
            weights (each replica keeps its slice).
        mesh, axis, seed, timeout: see `ParallelLayer`.

    Input shape: ``(batch, ..., input_dim)``.
    Output shape: ``(batch, ..., units)`` with `gather_output`, else
    ``(n * batch, ..., units / n)`` (batch reported as None).

    Raises:
        ValueError: `units` not divisible by the group size (at construction
            when `mesh` is given, else at build).

    Example (2 replicas):

    ```python
    with strategy.scope():
        model = keras.Sequential([
            keras.Input((8,)),
            keras_comm.parallel.ColumnParallelDense(16, activation="relu"),
            keras_comm.parallel.RowParallelDense(4),
        ])
        model.compile("sgd", "mse")
    model.fit(x, y)
    ```
    """

    def __init__(
        self,
        units,
        activation=None,
        use_bias=True,
        gather_output=False,
        kernel_initializer="glorot_uniform",
        bias_initializer="zeros",
        mesh=None,
        axis="model",
        seed=None,
        timeout=None,
        **kwargs,
    ):
        super().__init__(mesh=mesh, axis=axis, seed=seed, timeout=timeout, **kwargs)
        self.units = self.split_size(_validation.positive_int(units, "units"), "units")
        _validation.boolean(gather_output, "gather_output")
        self.activation = keras.activations.get(activation)
        self.use_bias = bool(use_bias)
        self.gather_output = gather_output
        self.kernel_initializer = keras.initializers.get(kernel_initializer)
        self.bias_initializer = keras.initializers.get(bias_initializer)

    def build(self, input_shape):
        self.split_size(self.units, "units", built=True)
        in_dim = int(input_shape[-1])
        self.kernel = sharded_weights.add_sharded_weight(
            self, "kernel", (in_dim, self.units), 1, self.mesh, self.axis,
            self.kernel_initializer, self.weight_seed(0),
        )
        self.bias = None
        if self.use_bias:
            self.bias = sharded_weights.add_sharded_weight(
                self, "bias", (self.units,), 0, self.mesh, self.axis,
                self.bias_initializer, self.weight_seed(1),
            )

    def call(self, inputs):
        group = self.group()
        x = _collectives.gather_batch(inputs, group, self.name, self.timeout)
        y = keras.ops.matmul(x, self.kernel)
        if self.bias is not None:
            y = y + self.bias
        y = self.activation(y)
        if self.gather_output:
            y = _collectives.gather_along(y, len(y.shape) - 1, group, self.name, self.timeout)
            y = _collectives.own_rows(y, group)
        return y

    def compute_output_shape(self, input_shape):
        if self.gather_output:
            return tuple(input_shape[:-1]) + (self.units,)
        return (None,) + tuple(input_shape[1:-1]) + (self.units // self.group_size(),)

    def get_config(self):
        config = super().get_config()
        config.update(
            units=self.units,
            activation=keras.activations.serialize(self.activation),
            use_bias=self.use_bias,
            gather_output=self.gather_output,
            kernel_initializer=keras.initializers.serialize(self.kernel_initializer),
            bias_initializer=keras.initializers.serialize(self.bias_initializer),
        )
        return config


@keras.saving.register_keras_serializable(package="keras_comm")
class RowParallelDense(_common.ParallelLayer):
    """Dense layer whose kernel is split on the input units; bias replicated.

    Forward: member k computes the partial product ``x_k @ W_k`` of its
    input columns; a reduce-scatter along the batch sums the partials over
    the model group and gives each member its own samples' rows; then the
    (unsplit) bias and activation. Backward (exact adjoint): the
    reduce-scatter's gradient is an all-gather of dy; the kernel shard's
    gradient is summed over its data-parallel group only, the bias's over
    all replicas (it is an ordinary weight).

    Args:
        units: output size (not split).
        activation: Keras activation.
        use_bias: whether to add a bias (after the reduction).
        input_is_parallel: True (default): the input is a
            `ColumnParallelDense` output, this shard's columns for the
            group's samples. False: the input is an ordinary per-replica
            batch with all features (its last dim must be divisible by the
            group size); the layer gathers the batch and takes its columns.
        kernel_initializer, bias_initializer: initializers of the FULL
            weights.
        mesh, axis, seed, timeout: see `ParallelLayer`.

    Input shape: ``(n * batch, ..., input_dim / n)`` if `input_is_parallel`,
    else ``(batch, ..., input_dim)``.
    Output shape: ``(batch, ..., units)``.

    Raises:
        ValueError: the full input dim not divisible by the group size.
    """

    def __init__(
        self,
        units,
        activation=None,
        use_bias=True,
        input_is_parallel=True,
        kernel_initializer="glorot_uniform",
        bias_initializer="zeros",
        mesh=None,
        axis="model",
        seed=None,
        timeout=None,
        **kwargs,
    ):
        super().__init__(mesh=mesh, axis=axis, seed=seed, timeout=timeout, **kwargs)
        self.units = _validation.positive_int(units, "units")
        _validation.boolean(input_is_parallel, "input_is_parallel")
        self.activation = keras.activations.get(activation)
        self.use_bias = bool(use_bias)
        self.input_is_parallel = input_is_parallel
        self.kernel_initializer = keras.initializers.get(kernel_initializer)
        self.bias_initializer = keras.initializers.get(bias_initializer)

    def build(self, input_shape):
        n = self.group_size()
        in_dim = int(input_shape[-1])
        if self.input_is_parallel:
            in_dim *= n
        else:
            self.split_size(in_dim, "input_dim", built=True)
        self.kernel = sharded_weights.add_sharded_weight(
            self, "kernel", (in_dim, self.units), 0, self.mesh, self.axis,
            self.kernel_initializer, self.weight_seed(0),
        )
        self.bias = None
        if self.use_bias:
            init = sharded_weights.seeded_initializer(self.bias_initializer, self.weight_seed(1) or 0)
            self.bias = self.add_weight(name="bias", shape=(self.units,), initializer=init)

    def call(self, inputs):
        group = self.group()
        x = inputs
        if not self.input_is_parallel and group.size > 1:
            x = _collectives.gather_batch(x, group, self.name, self.timeout)
            width = x.shape[-1] // group.size
            k = group.index(_collectives.my_rank())
            x = x[..., k * width : (k + 1) * width]
        y = keras.ops.matmul(x, self.kernel)
        y = _collectives.scatter_batch_sum(y, group, self.name, self.timeout)
        if self.bias is not None:
            y = y + self.bias
        return self.activation(y)

    def get_build_config(self):
        config = super().get_build_config()
        if config and self.input_is_parallel and self.built:
            # The input is 1/n of the full input dim for the group size n at
            # build; record the full dim so a model saved by one cluster size
            # is rebuilt (`keras.models.load_model`) in another.
            config["full_input_dim"] = sharded_weights.shard_spec(self.kernel).full_shape[0]
        return config

    def build_from_config(self, config):
        full = (config or {}).get("full_input_dim")
        if full is not None and "input_shape" in config:
            n = self.group_size()
            _validation.divisible(full, n, "input_dim", f"{self.axis!r} group size")
            shape = list(config["input_shape"])
            shape[-1] = full // n
            config = dict(config, input_shape=tuple(shape))
        super().build_from_config(config)

    def compute_output_shape(self, input_shape):
        batch = None if self.input_is_parallel else input_shape[0]
        return (batch,) + tuple(input_shape[1:-1]) + (self.units,)

    def get_config(self):
        config = super().get_config()
        config.update(
            units=self.units,
            activation=keras.activations.serialize(self.activation),
            use_bias=self.use_bias,
            input_is_parallel=self.input_is_parallel,
            kernel_initializer=keras.initializers.serialize(self.kernel_initializer),
            bias_initializer=keras.initializers.serialize(self.bias_initializer),
        )
        return config
