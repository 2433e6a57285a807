"""`Broadcast` and `Reduce` layers."""

import keras

from keras_comm.layers._base import CollectiveLayer
from keras_comm.ops.broadcast import broadcast
from keras_comm.ops.broadcast import reduce
from keras_comm.ops.broadcast import validate_gradient
from keras_comm.ops.reduce_op import ReduceOp


@keras.saving.register_keras_serializable(package="keras_comm")
class Broadcast(CollectiveLayer):
    """Sends `root`'s input to every group member.

    Forward: ``x_root`` everywhere. Backward: with ``gradient="exact"``
    (default) the exact adjoint, the SUM of every member's dy at `root` and
    zeros elsewhere: the gradient of the global objective (the sum of the
    replicas' losses), so training matches single-process training. With
    ``gradient="identity"`` dy passes through unchanged (MindSpore's
    Broadcast does this), right when every member keeps its own copy and the
    broadcast only re-synchronizes it. See `keras_comm.ops.broadcast`.

    Args:
        root: GLOBAL rank of the source; must be in `group`.
        group: None (all replicas) or a list of global ranks.
        gradient: "exact" or "identity".
        timeout: seconds; None for `keras_comm.get_timeout()`.

    Input shape: any, the same on every member. Output shape: the same.
    """

    def __init__(self, root=0, group=None, gradient="exact", timeout=None, **kwargs):
        super().__init__(group=group, timeout=timeout, **kwargs)
        self.root = self._group_member(root, "root")
        self.gradient = validate_gradient(gradient)

    def call(self, inputs):
        return broadcast(
            inputs,
            self.root,
            self.group,
            gradient=self.gradient,
            timeout=self.timeout,
            name=self.name,
        )

    def get_config(self):
        cfg = super().get_config()
        cfg.update({"root": self.root, "gradient": self.gradient})
        return cfg


@keras.saving.register_keras_serializable(package="keras_comm")
class Reduce(CollectiveLayer):
    """Reduces the input over the group (`op`: sum, prod, max, min) into member `dest`.

    Forward: the reduction at `dest`; zeros of the same shape on the other
    members. Backward (exact adjoint, given the zeros), with g = dy of
    `dest` broadcast to every member: SUM -> g; PROD -> g times the product
    of the *other* members' inputs (exact at zeros); MAX/MIN -> g where the
    input equals the result (on ties every tied member gets all of g, as for
    `AllReduce`). See `keras_comm.ops.reduce`.

    Args:
        dest: GLOBAL rank of the destination; must be in `group`.
        group: None (all replicas) or a list of global ranks.
        timeout: seconds; None for `keras_comm.get_timeout()`.
        op: a `keras_comm.ops.ReduceOp` or "sum" (default), "prod", "max",
            "min". Keyword-only, after the older arguments, so positional
            calls written before it existed keep their meaning.

    Input shape: any, the same on every member. Output shape: the same.

    Raises:
        ValueError, TypeError: a bad `dest`, `group`, `timeout` or `op` (at
            construction).

    Example:

    ```python
    strategy = tf.distribute.MultiWorkerMirroredStrategy()
    layer = keras_comm.layers.Reduce(dest=0, op="max")
    out = strategy.run(lambda: layer(tf.ones([2]) * (keras_comm.rank() + 1)))
    ```
    """

    def __init__(self, dest=0, group=None, timeout=None, *, op="sum", **kwargs):
        super().__init__(group=group, timeout=timeout, **kwargs)
        self.dest = self._group_member(dest, "dest")
        self.op = ReduceOp.from_value(op)

    def call(self, inputs):
        return reduce(
            inputs, self.dest, self.group, op=self.op, timeout=self.timeout, name=self.name
        )

    def get_config(self):
        cfg = super().get_config()
        # Configs saved before `op` existed have no "op" key; they load as "sum".
        cfg.update({"dest": self.dest, "op": self.op.value})
        return cfg
