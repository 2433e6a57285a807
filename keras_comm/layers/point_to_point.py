"""`Send` and `Receive` layers: point-to-point transfers in an SPMD model."""

import keras

from keras_comm import _validation
from keras_comm.layers._base import CollectiveLayer
from keras_comm.ops import point_to_point as p2p_ops


def _routes_config(peer):
    # Dict keys become strings in JSON; store routes as [[active, peer], ...].
    return [[a, p] for a, p in peer.items()] if isinstance(peer, dict) else peer


def _routes_from_config(peer):
    if isinstance(peer, list):
        return {int(a): int(p) for a, p in peer}
    return peer


@keras.saving.register_keras_serializable(package="keras_comm")
class Send(CollectiveLayer):
    """Sends its input from the sending rank(s) to a destination rank.

    Every replica runs the same model; the layer is *active* on the sending
    rank(s) only. On a sending rank it sends its input and returns it (the
    send's own output, so the send is never pruned); on every other rank it
    returns its input unchanged. In a world of one replica it is the
    identity, so the model builds, trains and saves on one machine.

    Forward: send x to `dest`, return x. Backward: Receive reversed: the
    sending rank adds the gradient its destination computed for the
    received tensor to its own upstream gradient.

    Args:
        dest: destination global rank (int), or a dict
            ``{sending rank: destination rank}`` for several pairs.
        tag: int >= 0; the matching `Receive` uses the same tag.
        src: with an int `dest`: the sending rank(s), int or list. None means
            the other rank of a world of two (checked at trace time).
        timeout: seconds before DeadlineExceeded (default
            `keras_comm.get_timeout()`).

    Input shape: any. Output shape: the input's.

    Example (two-stage pipeline, 2 replicas; mask rank 0's loss to zero):

    ```python
    h = stage1(x)
    h = keras_comm.layers.Send(dest=1, src=0)(h)
    h = keras_comm.layers.Receive(src=0, dest=1, shape=(None, 16))(h)
    y = stage2(h)
    ```
    """

    def __init__(self, dest, tag=0, src=None, timeout=None, **kwargs):
        super().__init__(timeout=timeout, **kwargs)
        if isinstance(dest, list):  # the serialized dict form
            dest = _routes_from_config(dest)
        self._routes = p2p_ops.routes(dest, src, "dest", "src", "sends to")
        self.dest = dest
        self.src = src
        self.tag = p2p_ops.validate_tag(tag)

    def call(self, inputs):
        return p2p_ops.send(
            inputs, self.dest, self.tag, src=self.src, timeout=self.timeout, name=self.name
        )

    def get_config(self):
        config = super().get_config()
        config.update(dest=_routes_config(self.dest), tag=self.tag, src=self.src)
        return config


@keras.saving.register_keras_serializable(package="keras_comm")
class Receive(CollectiveLayer):
    """Returns, on the receiving rank(s), the tensor their source sent.

    Called on a template tensor (for example the output of the matching
    `Send`, which every rank computes): on a receiving rank the template's
    values are ignored and the received tensor is returned; on every other
    rank the template passes through unchanged (so the two-stage pipeline
    ``Send -> Receive`` is the plain single-process model with world size
    1). The received tensor has shape `shape` (None dims: the template's)
    and the layer's compute dtype (`dtype`, a dtype or a dtype policy).

    Forward: receive from `src` (receiving ranks), pass through (others).
    Backward: Send reversed: send dy back to `src`; the template's gradient
    is zeros on receiving ranks (it only gives the shape, as MindSpore's
    Receive's dummy input does).

    Args:
        src: source global rank (int), or a dict
            ``{receiving rank: source rank}``.
        tag: int >= 0, the sender's tag.
        shape: the received tensor's full shape, batch dim included (None =
            the template's dim). The template must be compatible.
        dtype: dtype (policy) of the received tensor; default "float32".
        dest: with an int `src`: the receiving rank(s). None means the other
            rank of a world of two.
        timeout: seconds before DeadlineExceeded.

    Input shape: `shape`. Output shape: `shape`.
    """

    def __init__(self, src, tag=0, shape=None, dtype="float32", dest=None, timeout=None, **kwargs):
        super().__init__(timeout=timeout, dtype=dtype, **kwargs)
        if isinstance(src, list):
            src = _routes_from_config(src)
        self._routes = p2p_ops.routes(src, dest, "src", "dest", "receives from")
        self.src = src
        self.dest = dest
        self.tag = p2p_ops.validate_tag(tag)
        self.shape = _validation.shape(shape, "shape")

    def _check(self, input_shape):
        input_shape = tuple(input_shape)
        if len(input_shape) != len(self.shape) or any(
            a is not None and b is not None and a != b for a, b in zip(input_shape, self.shape)
        ):
            raise ValueError(
                f"Layer {self.name!r}: the template input has shape {input_shape}, "
                f"which does not match shape={self.shape}."
            )

    def call(self, inputs):
        self._check(inputs.shape)
        return p2p_ops.receive(
            inputs, self.src, self.tag, dest=self.dest, timeout=self.timeout, name=self.name
        )

    def _output_shape(self, shape):
        self._check(shape)
        return tuple(b if b is not None else a for a, b in zip(shape, self.shape))

    def compute_output_spec(self, inputs):
        # The received tensor has the layer's dtype, whatever the template's.
        return keras.KerasTensor(self._output_shape(inputs.shape), dtype=self.compute_dtype)

    def get_config(self):
        config = super().get_config()
        config.update(
            src=_routes_config(self.src), tag=self.tag, shape=list(self.shape), dest=self.dest
        )
        return config
