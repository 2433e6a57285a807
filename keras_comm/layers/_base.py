"""The base of keras_comm's collective layers: `group` and `timeout` handling."""

import keras

from keras_comm import config
from keras_comm import topology


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
