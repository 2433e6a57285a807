"""The `AllReduce` layer."""

import keras

from keras_comm.layers._base import CollectiveLayer
from keras_comm.ops._fusion import validate_fusion
from keras_comm.ops.all_reduce import all_reduce
from keras_comm.ops.reduce_op import ReduceOp


@keras.saving.register_keras_serializable(package="keras_comm")
class AllReduce(CollectiveLayer):
    """Reduces its input over a group of replicas; every member gets the result.

    Forward: ``op`` over the group, elementwise. Backward (objective: the sum
    of every replica's loss): SUM -> all-reduce SUM of dy; PROD -> all-reduce
    SUM of dy times the product of the *other* members' inputs (exact at
    zeros); MAX/MIN -> all-reduce SUM of dy where x equals the result (on
    ties every tied member gets the full gradient, as MindSpore's AllReduce
    does). See `keras_comm.ops.all_reduce`.

    Replicas outside `group` pass their input (and gradient) through.
    Outside any strategy the layer is the identity.

    Fusion: call the layer on a list (or dict) of tensors to all-reduce them
    in ONE transfer per dtype (forward and backward). Separate AllReduce and
    MirrorOperator layers given the same `fusion` id > 0 are packed into one transfer per step when they
    do not depend on each other (forward, and backward separately), in
    `model.fit`/`evaluate`/`predict` and inside `keras_comm.ops.fusion_scope`.
    Values are the same as unfused. See `keras_comm.ops.all_reduce`.

    Args:
        op: a `keras_comm.ops.ReduceOp` or "sum", "prod", "max", "min".
        group: None (all replicas) or a list of global ranks.
        fusion: int >= 0, the fusion group id (0: no fusion).
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
        self.fusion = validate_fusion(fusion)

    def call(self, inputs):
        return all_reduce(
            inputs,
            self.op,
            self.group,
            fusion=self.fusion,
            timeout=self.timeout,
            name=self.name,
        )

    def get_config(self):
        cfg = super().get_config()
        cfg.update({"op": self.op.value, "fusion": self.fusion})
        return cfg
