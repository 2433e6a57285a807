"""`PipelineStage`: a two-stage pipeline whose replicas both hold both stages' weights.

`keras_comm.parallel.Pipeline` holds each stage's weights on its own
replicas only and runs any number of stages; see docs/model_parallel.md for
moving from this layer to it.
"""


import keras
import tensorflow as tf

from keras_comm import _validation
from keras_comm import ops
from keras_comm import topology
from keras_comm.layers._base import CollectiveLayer
from keras_comm.parallel import _collectives


@keras.saving.register_keras_serializable(package="keras_comm")
class PipelineStage(CollectiveLayer):
    """Runs `first` on one replica and `second` on the other, micro-batch by micro-batch.

    Forward, in a world of two replicas (ranks ``stages[0]``, ``stages[1]``):
    the two replicas' batches are all-gathered and split into
    `num_micro_batches` micro-batches; the first-stage replica computes
    ``first(mb)`` and sends it (Send, one tag per micro-batch); the second
    receives it and computes ``second(.)``. TensorFlow runs each op when its
    input arrives, so the first stage works on micro-batch m+1 while the
    second works on m. The second-stage replica sends the first replica's
    rows of the output back; each replica returns its own samples' outputs,
    so Keras's loss and metrics are per replica as usual.
    Backward: Send/Receive reversed, micro-batch by micro-batch; each
    stage's weights get their full gradient on their own replica and zeros
    on the other, so the ordinary all-replica SUM of gradients is exact.

    Both stages' weights exist (mirrored) on both replicas; only the owner
    computes with them. This saves compute per replica, not weight memory.
    With one replica (or outside a strategy) the layer is ``second(first(x))``.

    Args:
        first, second: Keras layers or models (the two stages).
        num_micro_batches: micro-batches per step; must divide twice the
            per-replica batch size.
        stages: the (first, second) global ranks.
        timeout: seconds; None for `keras_comm.get_timeout()`.

    Input shape: ``first``'s. Output shape: ``second``'s.

    Raises:
        ValueError: bad `num_micro_batches` or `stages`; a world other
            than 1 or 2 replicas (at call).
    """

    def __init__(self, first, second, num_micro_batches=1, stages=(0, 1), timeout=None, **kwargs):
        super().__init__(timeout=timeout, **kwargs)
        self.num_micro_batches = _validation.positive_int(num_micro_batches, "num_micro_batches")
        stages = tuple(stages)
        if len(stages) != 2 or sorted(stages) != [0, 1]:
            raise ValueError(
                "`stages` must be the two ranks (0, 1) in stage order. "
                f"Received: stages={stages!r}"
            )
        if isinstance(first, dict):
            first = keras.saving.deserialize_keras_object(first)
        if isinstance(second, dict):
            second = keras.saving.deserialize_keras_object(second)
        self.first = first
        self.second = second
        self.stages = stages

    # The output is the second stage's, in the layer's compute dtype.
    compute_output_spec = keras.layers.Layer.compute_output_spec

    def build(self, input_shape):
        self.first.build(input_shape)
        mid = self.first.compute_output_shape(input_shape)
        self.second.build(mid)
        self._mid_shape = tuple(mid)
        self._out_shape = tuple(self.second.compute_output_shape(mid))

    def _touch(self, layer):
        # Zero-valued use of every weight: the other replica's gradients are
        # then zeros, not None, so both replicas reduce the same list.
        return tf.add_n([tf.zeros([])] + [tf.reduce_sum(w) * 0.0 for w in layer.trainable_weights])

    def call(self, inputs):
        world = topology.world_size()
        if world == 1 or _collectives.shape_only():
            return self.second(self.first(inputs))
        if world != 2:
            raise ValueError(
                f"PipelineStage {self.name!r} runs on exactly 2 replicas. "
                f"Received: world size {world}"
            )
        rank = topology.rank()
        s0, s1 = self.stages
        # A zero that depends on every weight. Placeholders (what the idle
        # replica passes through Send/Receive) carry it so that the gradient
        # tape, which only runs backward functions leading to watched
        # variables, runs the Receive backward that the peer waits for.
        anchor = self._touch(self.first) + self._touch(self.second)
        b = tf.shape(inputs)[0]
        x = ops.all_gather(inputs, timeout=self.timeout, name=self.name)  # rank 0's rows first
        m = self.num_micro_batches
        mb = tf.shape(x)[0] // m
        sent = []
        outs = []
        for i in range(m):
            xm = x[i * mb : (i + 1) * mb]
            if rank == s0:
                h = self.first(xm)
            else:
                h = tf.zeros(tf.concat([[mb], self._mid_shape[1:]], 0), self.compute_dtype)
                h = h + tf.cast(anchor, h.dtype)
            h = ops.send(h, dest=s1, src=s0, tag=i, timeout=self.timeout, name=self.name)
            sent.append(h)
            h = ops.receive(h, src=s0, dest=s1, tag=i, timeout=self.timeout, name=self.name)
            if rank == s1:
                outs.append(self.second(h))
        dtype = self.compute_dtype
        if rank == s1:
            full = tf.concat(outs, 0)
        else:
            full = tf.zeros(tf.concat([[2 * b], self._out_shape[1:]], 0), dtype)
            full = full + tf.cast(anchor, dtype)
        rows = [full[:b], full[b:]]  # rows[r]: rank r's samples
        back = ops.send(rows[s0], dest=s0, src=s1, tag=m, timeout=self.timeout, name=self.name)
        back = ops.receive(back, src=s1, dest=s0, tag=m, timeout=self.timeout, name=self.name)
        if rank == s0:
            out = back
            anchor += tf.add_n([tf.reduce_sum(h) * 0.0 for h in sent])
        else:
            out = rows[s1]
            anchor += tf.reduce_sum(back) * 0.0
        return out + tf.cast(anchor, out.dtype)

    def compute_output_shape(self, input_shape):
        mid = self.first.compute_output_shape(input_shape)
        return self.second.compute_output_shape(mid)

    def get_config(self):
        config = super().get_config()
        config.update(
            first=keras.saving.serialize_keras_object(self.first),
            second=keras.saving.serialize_keras_object(self.second),
            num_micro_batches=self.num_micro_batches,
            stages=list(self.stages),
        )
        return config
