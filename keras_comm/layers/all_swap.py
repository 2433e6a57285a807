"""`AllSwap` layer: variable-size exchange."""

import keras

from keras_comm.layers._base import CollectiveLayer
from keras_comm.ops.all_swap import all_swap


@keras.saving.register_keras_serializable(package="keras_comm")
class AllSwap(CollectiveLayer):
    """Variable-size exchange: member i sends ``send_sizes[j]`` rows to member j.

    Called on ``[x, send_sizes]`` or ``[x, send_sizes, recv_sizes]``:
    `x`'s rows are grouped by destination (group order), `send_sizes` is a
    1-D int tensor with one entry per member (it may differ per rank and per
    step), `recv_sizes` optionally states what each member sends here and is
    checked at run time. Returns the received rows, concatenated in group
    order. See `keras_comm.ops.all_swap` for the bytes moved (padding to the
    largest block).

    Forward: concat over j of the rows member j sent here. Backward: AllSwap
    of dy with the sizes swapped; the sizes get no gradient.

    Args:
        group: member ranks, or None for the world. Non-members return x.
        timeout: seconds before DeadlineExceeded.

    Input shape: ``(rows, ...)`` and ``(n,)`` (and ``(n,)``).
    Output shape: ``(None, ...)``.
    """

    def __init__(self, group=None, timeout=None, **kwargs):
        super().__init__(group=group, timeout=timeout, **kwargs)

    def _split(self, inputs):
        if not isinstance(inputs, (list, tuple)) or len(inputs) not in (2, 3):
            raise ValueError(
                f"Layer {self.name!r} is called on [x, send_sizes] or "
                f"[x, send_sizes, recv_sizes]. Received: {inputs!r}"
            )
        return list(inputs) + [None] * (3 - len(inputs))

    def call(self, inputs):
        x, send_sizes, recv_sizes = self._split(inputs)
        return all_swap(
            x, send_sizes, recv_sizes, self.group, timeout=self.timeout, name=self.name
        )

    def compute_output_spec(self, inputs):
        x, _, _ = self._split(inputs)
        return keras.KerasTensor((None,) + tuple(x.shape[1:]), dtype=x.dtype)

    def compute_output_shape(self, input_shape):
        x_shape, _, _ = self._split(input_shape)
        return (None,) + tuple(x_shape[1:])
