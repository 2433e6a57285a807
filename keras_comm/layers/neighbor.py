"""`NeighborExchange` and `HaloExchange` (2-D halo exchange) layers.

`NeighborExchangeV2` is `HaloExchange` under its MindSpore name; configs saved
under that name load as `HaloExchange`.
"""

import keras

from keras_comm.layers._base import CollectiveLayer
from keras_comm.ops import neighbor as neighbor_ops


@keras.saving.register_keras_serializable(package="keras_comm")
class NeighborExchange(CollectiveLayer):
    """Each rank sends tensors to some ranks and receives from others.

    The routes are tables with one row per group member (ascending ranks),
    since every rank runs the same model (MindSpore's NeighborExchange
    takes one rank's row):

    * ``send_ranks[p][i]``: the rank member p sends input i to (None: input
      i is not sent by p);
    * ``recv_ranks[p][j]``: the rank member p receives output j from (None:
      output j is zeros on p).

    The n-th input member a sends to b is the n-th output b receives from a.
    Transfers run in one global order, so the exchange cannot deadlock.

    Forward: output j = the tensor sent by its source. Backward:
    NeighborExchange with sends and receives swapped.

    Args:
        send_ranks: list (one row per member) of k ranks/None.
        recv_ranks: list (one row per member) of m ranks/None.
        recv_shapes: m shapes (None dims: the first input's dims, e.g. batch).
        send_shapes: k shapes, the inputs' (None dims match anything).
        recv_dtype: dtype of the received tensors (inputs are cast to it).
        group: member ranks, or None for the world (then one row per rank).
        timeout: seconds before DeadlineExceeded.

    Input: a list of k tensors. Output: a list of m tensors.

    Example, a ring over 4 replicas (each sends to the next):

    ```python
    ring = keras_comm.layers.NeighborExchange(
        send_ranks=[[1], [2], [3], [0]], recv_ranks=[[3], [0], [1], [2]],
        recv_shapes=[(None, 8)], send_shapes=[(None, 8)])
    (from_prev,) = ring([h])
    ```
    """

    def __init__(self, send_ranks, recv_ranks, recv_shapes, send_shapes,
                 recv_dtype="float32", group=None, timeout=None, **kwargs):
        super().__init__(group=group, timeout=timeout, **kwargs)
        _, send_ranks, recv_ranks, send_shapes, recv_shapes, _ = neighbor_ops.exchange_plan(
            send_ranks, recv_ranks, send_shapes, recv_shapes, self.group
        )
        self.send_ranks = [list(r) for r in send_ranks]
        self.recv_ranks = [list(r) for r in recv_ranks]
        self.send_shapes = [list(s) for s in send_shapes]
        self.recv_shapes = [list(s) for s in recv_shapes]
        try:
            self.recv_dtype = keras.backend.standardize_dtype(recv_dtype)
        except ValueError:
            raise TypeError(f"`recv_dtype` must be a dtype. Received: recv_dtype={recv_dtype!r}") from None

    def call(self, inputs):
        inputs = list(inputs) if isinstance(inputs, (list, tuple)) else [inputs]
        return neighbor_ops.neighbor_exchange(
            inputs, self.send_ranks, self.recv_ranks, self.recv_shapes, self.send_shapes,
            self.recv_dtype, self.group, timeout=self.timeout, name=self.name,
        )

    def _out_shapes(self, input_shapes):
        if not isinstance(input_shapes, list) or (input_shapes and not isinstance(input_shapes[0], (list, tuple))):
            input_shapes = [input_shapes]
        first = tuple(input_shapes[0]) if input_shapes else ()
        return [tuple(first[a] if d is None else d for a, d in enumerate(s)) for s in self.recv_shapes]

    def compute_output_shape(self, input_shape):
        return self._out_shapes(input_shape)

    def compute_output_spec(self, inputs):
        inputs = list(inputs) if isinstance(inputs, (list, tuple)) else [inputs]
        shapes = self._out_shapes([list(t.shape) for t in inputs])
        return [keras.KerasTensor(s, dtype=self.recv_dtype) for s in shapes]

    def get_config(self):
        config_ = super().get_config()
        config_.update(
            send_ranks=self.send_ranks, recv_ranks=self.recv_ranks,
            recv_shapes=self.recv_shapes, send_shapes=self.send_shapes,
            recv_dtype=self.recv_dtype,
        )
        return config_


@keras.saving.register_keras_serializable(package="keras_comm")
class HaloExchange(CollectiveLayer):
    """Pads an image tile with its neighbours' border strips (8 directions).

    The image is split over a 2-D grid of ranks, one tile per rank.
    Directions are [top, top_right, right, bottom_right, bottom,
    bottom_left, left, top_left]; lens are [top, bottom, left, right]; the
    rank tables have one row of 8 ranks (-1 = none) per group member (every
    rank runs the same model). `keras_comm.ops.halo_rank_ids` builds them for
    a row-major grid. MindSpore: NeighborExchangeV2 (also importable under
    that name).

    Forward: the tile padded by `recv_lens` on every side, the halos filled
    with the neighbours' border strips; zeros where a neighbour is missing,
    so every rank's output has one shape. Backward: halo gradients are sent
    back and added into the border strips they came from (exact adjoint).
    See `keras_comm.ops.halo_exchange`.

    Args:
        send_rank_ids, recv_rank_ids: one row of 8 ranks per member.
        send_lens, recv_lens: [top, bottom, left, right].
        data_format: "NCHW" (the default) or "NHWC" (Keras's channels_last).
        group: member ranks, or None for the world.
        timeout: seconds before DeadlineExceeded.

    Input shape: 4-D tile (batch, C, H, W) or (batch, H, W, C).
    Output shape: H + top + bottom, W + left + right (recv_lens).
    """

    def __init__(self, send_rank_ids, send_lens, recv_rank_ids, recv_lens,
                 data_format="NCHW", group=None, timeout=None, **kwargs):
        super().__init__(group=group, timeout=timeout, **kwargs)
        self.data_format = neighbor_ops.validate_data_format(data_format)
        _, send, send_lens, recv, recv_lens, _ = neighbor_ops.halo_plan(
            send_rank_ids, send_lens, recv_rank_ids, recv_lens, self.group
        )
        self.send_rank_ids = [[-1 if v is None else v for v in r] for r in send]
        self.recv_rank_ids = [[-1 if v is None else v for v in r] for r in recv]
        self.send_lens = list(send_lens)
        self.recv_lens = list(recv_lens)

    def call(self, inputs):
        return neighbor_ops.halo_exchange(
            inputs, self.send_rank_ids, self.send_lens, self.recv_rank_ids, self.recv_lens,
            self.data_format, self.group, timeout=self.timeout, name=self.name,
        )

    def _output_shape(self, input_shape):
        shape = list(input_shape)
        if len(shape) != 4:
            raise ValueError(f"Layer {self.name!r} expects a 4-D input. Received: input_shape={tuple(input_shape)}")
        h, w = (2, 3) if self.data_format == "NCHW" else (1, 2)
        t, b, l, r = self.recv_lens
        shape[h] = None if shape[h] is None else shape[h] + t + b
        shape[w] = None if shape[w] is None else shape[w] + l + r
        return tuple(shape)

    def get_config(self):
        config_ = super().get_config()
        config_.update(
            send_rank_ids=self.send_rank_ids, send_lens=self.send_lens,
            recv_rank_ids=self.recv_rank_ids, recv_lens=self.recv_lens,
            data_format=self.data_format,
        )
        return config_


# The MindSpore name. Registered too, so configs saved under it still load.
NeighborExchangeV2 = HaloExchange
keras.saving.get_custom_objects()["keras_comm>NeighborExchangeV2"] = HaloExchange
