"""`AlltoAll` layer."""

import keras

from keras_comm import _validation
from keras_comm.layers._base import CollectiveLayer
from keras_comm.ops.all_to_all import all_to_all


@keras.saving.register_keras_serializable(package="keras_comm")
class AlltoAll(CollectiveLayer):
    """Splits the input into chunks, sends chunk i to group member i.

    Forward: split along `split_dim` into `split_count` chunks, chunk i to
    member i, the received chunks concatenated along `concat_dim` in member
    order. Backward: the same exchange with `split_dim` and `concat_dim`
    swapped (exact adjoint). See `keras_comm.ops.all_to_all`.

    Args:
        split_count: must equal the group size (checked here when `group`
            is given, else when the layer runs).
        split_dim: axis to split; negative values count from the end.
        concat_dim: axis to concatenate; negative values allowed.
        group: None (all replicas) or a list of global ranks.
        timeout: seconds; None for `keras_comm.get_timeout()`.

    Input shape: any rank >= 1, ``shape[split_dim]`` divisible by
    `split_count`. Output shape: ``shape[split_dim] / n`` and
    ``shape[concat_dim] * n`` (unchanged when the dims are equal).
    """

    def __init__(self, split_count, split_dim, concat_dim, group=None, timeout=None, **kwargs):
        super().__init__(group=group, timeout=timeout, **kwargs)
        self.split_count = _validation.integer(split_count, "split_count", minimum=1)
        self.split_dim = _validation.integer(split_dim, "split_dim")
        self.concat_dim = _validation.integer(concat_dim, "concat_dim")
        if self.group is not None and self.split_count != self.group.size:
            raise ValueError(
                f"`split_count` must equal the size of `group` {list(self.group.ranks)} "
                f"({self.group.size}). Received: split_count={split_count}"
            )

    def _output_shape(self, shape):
        shape = list(shape)
        rank = len(shape)
        for arg, dim in (("split_dim", self.split_dim), ("concat_dim", self.concat_dim)):
            if not -rank <= dim < rank:
                raise ValueError(
                    f"Layer {self.name!r}: `{arg}` must be in [{-rank}, {rank}) for an "
                    f"input of rank {rank}. Received: {arg}={dim}"
                )
        s, c = self.split_dim % rank, self.concat_dim % rank
        # A static dim that does not split would be rounded down here and
        # fail only when the layer runs: refuse it when the model is built.
        if shape[s] is not None and shape[s] % self.split_count:
            raise ValueError(
                f"Layer {self.name!r}: dimension {s} (`split_dim`) of the input must be "
                f"divisible by `split_count` {self.split_count}. "
                f"Received: input_shape={tuple(shape)}"
            )
        if s != c:
            n = self.split_count
            shape[s] = None if shape[s] is None else shape[s] // n
            shape[c] = None if shape[c] is None else shape[c] * n
        return tuple(shape)

    def call(self, inputs):
        return all_to_all(
            inputs,
            self.split_count,
            self.split_dim,
            self.concat_dim,
            self.group,
            timeout=self.timeout,
            name=self.name,
        )

    def get_config(self):
        cfg = super().get_config()
        cfg.update(
            {
                "split_count": self.split_count,
                "split_dim": self.split_dim,
                "concat_dim": self.concat_dim,
            }
        )
        return cfg
