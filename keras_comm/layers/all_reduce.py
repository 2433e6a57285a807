"""`AllReduce` layer, and the base shared by keras_comm's collective layers."""

import keras

from keras_comm import config
from keras_comm import topology
from keras_comm.ops.all_reduce import all_reduce
from keras_comm.ops.reduce_op import ReduceOp


def _validate_rank(value, name):
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"`{name}` must be an int global rank. Received: {name}={value!r}")
    if value < 0:
        raise ValueError(f"`{name}` must be a global rank >= 0. Received: {name}={value!r}")
    return value


def _validate_rank_in_group(value, group, name):
    """A root/dest/src rank: an int, and a member of `group` when one is given."""
    value = _validate_rank(value, name)
    if group is not None and value not in group:
        raise ValueError(
            f"`{name}` must be a member of `group` {list(group.ranks)}. "
            f"Received: {name}={value!r}"
        )
    return value


class CollectiveLayer(keras.layers.Layer):
    """Base of keras_comm's collective layers: `group` and `timeout` handling.

    Subclasses set `_output_shape(shape)` (shape of a group member's output
    for an input shape; None for unknown dims) and call their ops function
    with ``group=self.group, timeout=self.timeout, name=self.name``.
    Symbolic Keras inputs never reach the ops function, so building a model
    never communicates.
    """

    def __init__(self, group=None, timeout=None, **kwargs):
        super().__init__(**kwargs)
        self.group = topology.as_group(group)
        self.timeout = None if timeout is None else config.validate_timeout(timeout)
        self.supports_masking = False

    def _output_shape(self, shape):
        return tuple(shape)

    def compute_output_shape(self, input_shape):
        return keras.tree.map_shape_structure(self._output_shape, input_shape)

    def compute_output_spec(self, inputs):
        # Keep the input's dtype (int inputs stay int; the layer's policy has
        # already cast float inputs).
        return keras.tree.map_structure(
            lambda t: keras.KerasTensor(self._output_shape(t.shape), dtype=t.dtype),
            inputs,
        )

    def get_config(self):
        cfg = super().get_config()
        cfg.update(
            {
                "group": None if self.group is None else list(self.group.ranks),
                "timeout": self.timeout,
            }
        )
        return cfg


@keras.saving.register_keras_serializable(package="keras_comm")
class AllReduce(CollectiveLayer):
    """Reduces its input over a group of replicas; every member gets the result.

    Forward: ``op`` over the group, elementwise. Backward (objective: the sum
    of every replica's loss): SUM -> all-reduce SUM of dy; PROD -> all-reduce
    SUM of dy times the product of the *other* members' inputs (exact at
    zeros); MAX/MIN -> all-reduce SUM of dy where x equals the result (on
    ties every tied member gets the full gradient: the reference's
    convention). See `keras_comm.ops.all_reduce`.

    Replicas outside `group` pass their input (and gradient) through.
    Outside any strategy the layer is the identity.

    Fusion: call the layer on a list (or dict) of tensors to all-reduce them
    in ONE transfer per dtype (forward and backward). The `fusion` id is the
    reference's fusion-group attribute; it is validated and serialized, but
    separate layer calls with the same id are **not** fused today.

    Args:
        op: a `keras_comm.ops.ReduceOp` or "sum", "prod", "max", "min".
        group: None (all replicas) or a list of global ranks.
        fusion: int >= 0, the reference's fusion group id (0: no fusion).
            Recorded only; see above.
        timeout: seconds before a missing peer raises DeadlineExceeded;
            None for `keras_comm.get_timeout()`.
        **kwargs: base `keras.layers.Layer` arguments (name, dtype, ...).

    Input shape: any; or a list/dict of tensors.
    Output shape: same as the input.

    Raises:
        ValueError, TypeError: an unknown `op`, a bad `group`, `fusion` or
            `timeout` (at construction).

    Example:

    ```python
    strategy = tf.distribute.MultiWorkerMirroredStrategy()
    layer = keras_comm.layers.AllReduce("sum")
    out = strategy.run(lambda: layer(tf.ones([2]) * (keras_comm.rank() + 1)))
    ```
    """

    def __init__(self, op="sum", group=None, fusion=0, timeout=None, **kwargs):
        super().__init__(group=group, timeout=timeout, **kwargs)
        self.op = ReduceOp.from_value(op)
        if isinstance(fusion, bool) or not isinstance(fusion, int):
            raise TypeError(f"`fusion` must be an int >= 0. Received: fusion={fusion!r}")
        if fusion < 0:
            raise ValueError(f"`fusion` must be an int >= 0. Received: fusion={fusion!r}")
        self.fusion = fusion

    def call(self, inputs):
        return all_reduce(
            inputs, self.op, self.group, timeout=self.timeout, name=self.name
        )

    def get_config(self):
        cfg = super().get_config()
        cfg.update({"op": self.op.value, "fusion": self.fusion})
        return cfg
