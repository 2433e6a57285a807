"""The base of every keras_comm layer, and the mixins of layers that own state.

A keras_comm layer validates its arguments at construction (with
`keras_comm._validation`), stores each under its own name, and in ``call``
passes them to one function of `keras_comm.ops`, which holds the forward
and backward rules. `CollectiveLayer` does the part every layer shares; the
mixins add what only some layers have: per-replica accumulators
(`PerReplicaAccumulator`, `MiniStepCounter`) and the optional mean of the
reduced gradient (`MeanGradient`).
"""

import inspect

import keras

from keras_comm import _validation
from keras_comm import topology
from keras_comm._private import keras_api


class CollectiveLayer(keras.layers.Layer):
    """Base of every keras_comm layer: group, timeout, config and output spec.

    * ``group``: None (every replica) or a list of global ranks, stored as a
      `keras_comm.Group`. ``timeout``: seconds, or None for
      `keras_comm.get_timeout()`. Each is validated and stored only when
      the subclass's constructor takes it, and `get_config` returns it as
      given (a rank list, a number or None) next to the subclass's own
      arguments.
    * Output: `_output_shape(shape)` gives a member's output shape for one
      input tensor's shape (the identity unless overridden; None for dims
      known only when the layer runs). The output keeps the input's dtype:
      a collective moves data without converting it.

    Symbolic Keras inputs never reach an op, so building a model never
    communicates.
    """

    def __init__(self, group=None, timeout=None, **kwargs):
        super().__init__(**kwargs)
        for argument, value in (("group", group), ("timeout", timeout)):
            if value is not None and not self._takes(argument):
                raise TypeError(
                    f"{type(self).__name__} takes no `{argument}` argument. "
                    f"Received: {argument}={value!r}"
                )
        if self._takes("group"):
            self.group = topology.as_group(group)
        if self._takes("timeout"):
            self.timeout = _validation.optional_timeout(timeout)
        self.supports_masking = False

    @classmethod
    def _takes(cls, argument):
        # A layer without a constructor of its own takes no group or timeout.
        init = cls.__init__
        if init is CollectiveLayer.__init__:
            return False
        return argument in inspect.signature(init).parameters

    def _group_member(self, rank, name):
        """`rank` (a root, source or destination) checked to be in `group`."""
        return _validation.rank_in(rank, None if self.group is None else self.group.ranks, name)

    def _output_shape(self, shape):
        return tuple(shape)

    def compute_output_shape(self, input_shape):
        return keras.tree.map_shape_structure(self._output_shape, input_shape)

    def compute_output_spec(self, inputs):
        return keras.tree.map_structure(
            lambda t: keras.KerasTensor(self._output_shape(t.shape), dtype=t.dtype),
            inputs,
        )

    def get_config(self):
        config = super().get_config()
        if self._takes("group"):
            config["group"] = None if self.group is None else list(self.group.ranks)
        if self._takes("timeout"):
            config["timeout"] = self.timeout
        return config


def group_size(group):
    """The size of `group`, or the world size now when it is None."""
    return topology.world_size() if group is None else group.size


def _static_shape(layer, input_shape):
    shape = tuple(input_shape)
    if any(d is None for d in shape):
        raise ValueError(
            f"Layer {layer.name!r} ({type(layer).__name__}) keeps a per-replica "
            "accumulator shaped like its input, so the input shape must be fully "
            "known (use it on parameters or fixed-size tensors, not on batches "
            f"of unknown size). Received: input_shape={shape}"
        )
    return shape


# The TF (possibly distributed) variable behind a Keras variable: the ops
# update it inside their backward.
_tf_variable = keras_api.tf_variable


class PerReplicaAccumulator:
    """Mixin of the layers that own a gradient accumulator per replica.

    ``build`` creates ``accumulator``: non-trainable, zeros, shaped by
    `_accumulator_shape` (the output shape unless overridden) and kept per
    replica (``synchronization="on_read"``, ``aggregation="none"``), so
    MWMS's broadcast of initial values from worker 0 is harmless. Build
    these layers under ``strategy.scope()``. The input shape must be fully
    known.
    """

    def build(self, input_shape):
        shape = self._accumulator_shape(_static_shape(self, input_shape))
        self.accumulator = self._per_replica_weight("accumulator", shape, self.variable_dtype)

    def _accumulator_shape(self, input_shape):
        return self._output_shape(input_shape)

    def _per_replica_weight(self, name, shape, dtype):
        with keras.name_scope(self.name):
            variable = keras.Variable(
                initializer="zeros",
                shape=shape,
                dtype=dtype,
                trainable=False,
                autocast=False,
                aggregation="none",
                synchronization="on_read",
                name=name,
            )
        keras_api.track_variable(self, variable)
        return variable

    def _accumulator_variable(self):
        return _tf_variable(self.accumulator)


class MiniStepCounter(PerReplicaAccumulator):
    """An accumulator released every `accumulation_steps` backwards.

    Adds the per-replica int64 ``step`` counter (built after the
    accumulator) and calls the op named by `_op` with both, plus the
    keywords `_op_kwargs` returns (none unless the subclass adds its own);
    the subclass stores `accumulation_steps`.
    """

    def build(self, input_shape):
        super().build(input_shape)
        self.step = self._per_replica_weight("step", (), "int64")

    def call(self, inputs):
        return self._op(
            inputs,
            self._accumulator_variable(),
            _tf_variable(self.step),
            self.accumulation_steps,
            self.mean,
            self.group,
            timeout=self.timeout,
            name=self.name,
            **self._op_kwargs(),
        )

    def _op_kwargs(self):
        return {}

    def get_config(self):
        config = super().get_config()
        config["accumulation_steps"] = self.accumulation_steps
        return config


class MeanGradient:
    """Mixin of the layers whose backward can divide the reduced gradient by the group size.

    The argument is `mean` (as in `keras_comm.callbacks.ParallelOptimizer`);
    `mean_flag`, its name before, is still accepted as a keyword and as a
    config key, and readable as an attribute.
    """

    def __init__(self, mean, mean_default, **kwargs):
        mean = _validation.renamed(
            kwargs, "mean_flag", "mean", mean, mean_default, check=_validation.boolean
        )
        super().__init__(**kwargs)
        self.mean = mean

    @property
    def mean_flag(self):
        return self.mean

    def get_config(self):
        config = super().get_config()
        config["mean"] = self.mean
        return config
