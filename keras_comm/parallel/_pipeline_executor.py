"""Runs one pipeline stage's instruction list: sends, receives, forwards, backwards.

The schedule (`keras_comm.parallel.schedules`) is data: a list of
instructions per stage. `Executor` turns one stage's list into TensorFlow
ops on one replica, in the list's order.
"""

import tensorflow as tf

from keras_comm import ops
from keras_comm.ops import point_to_point as p2p


def _act_tag(i):
    return 2 * i


def _grad_tag(i):
    return 2 * i + 1


class Executor:
    """Runs one stage's instruction list (`keras_comm.parallel.schedules`).

    One instance per traced step on one replica. Each instruction's ops are
    created after the previous instruction's (a control dependency), so the
    stage runs the table's order, not just what the data allows; transfers
    are ordered besides by the device's ordering token.

    Micro-batch i's forward records a tape (the stage's input and this
    replica's buffer watched); its backward consumes it. With `loss_fn`
    (the pipeline training step), the last stage's forward also computes the
    loss of micro-batch i and its backward starts from that loss instead of
    a received gradient.
    """

    def __init__(self, layer, stage, group, x, flat, training, loss_fn=None, state=None):
        self.layer = layer
        self.s = stage
        self.p = layer.num_stages
        self.ranks = group.ranks
        self.rank = self.ranks[stage]
        self.x = x
        self.flat = flat
        self.training = training
        self.loss_fn = loss_fn
        # This replica's non-trainable state (None: the stages have none),
        # advanced by each micro-batch's forward in order, as the unsplit
        # model updates it once per micro-batch.
        self.state = state
        m = layer.num_micro_batches
        self.m = m
        self.mb = tf.shape(x)[0] // m
        self.h_in, self.h_out, self.tapes, self.g_out, self.dx = {}, {}, {}, {}, {}
        self.losses = {}
        # The stage weights' gradients, summed over the micro-batches so far
        # (one per stage weight; see `weight_gradient`).
        self.dvalues = None
        self.pending = []  # sends, kept alive through the outputs
        self.last = None

    def _shape(self, k):
        return tf.concat([[self.mb], list(self.layer._shapes[k][1:])], 0)

    def run(self, instructions):
        # What this replica traced, in order: `Pipeline.traced_instructions`.
        self.layer._traced_instructions.setdefault(self.rank, []).append(list(instructions))
        for op in instructions:
            deps = [self.last] if self.last is not None else []
            with tf.control_dependencies(deps):
                self.last = getattr(self, "_" + op.kind)(op.micro_batch)

    def _recv_act(self, i):
        template = tf.zeros(self._shape(self.s), self.layer._dtypes[self.s - 1])
        prev = self.ranks[self.s - 1]
        h = ops.receive(template, {self.rank: prev}, tag=_act_tag(i), timeout=self.layer.timeout, name=self.layer.name)
        self.h_in[i] = h
        return h

    def _forward(self, i):
        if self.s == 0:
            x = self.x[i * self.mb : (i + 1) * self.mb]
        else:
            x = self.h_in.pop(i)
        with tf.GradientTape() as tape:
            if x.dtype.is_floating:
                tape.watch(x)
            tape.watch(self.flat)
            held = self.layer._held_stages(self.rank)
            values = self.layer._stage_values(self.flat, self.s, held)
            state_values = self.layer._stage_values(self.state, self.s, held, True)
            y, new_state = self.layer._run_stage(self.s, values, x, self.training, state_values)
            if self.state is not None and self.training:
                self.state = self.layer._replace_state(self.state, self.s, held, new_state)
            if self.loss_fn is not None and self.s == self.p - 1:
                self.losses[i] = self.loss_fn(i, y)
        self.tapes[i] = (tape, x, y, values)
        self.h_out[i] = y
        return y

    def _send_act(self, i):
        nxt = self.ranks[self.s + 1]
        y = self.h_out.pop(i)
        sent = ops.send(y, {self.rank: nxt}, tag=_act_tag(i), timeout=self.layer.timeout, name=self.layer.name)
        self.pending.append(sent)
        self.h_out[i] = None  # the last stage keeps outputs; others need not
        return sent

    def output(self):
        """The last stage's outputs for the group's batch; zeros elsewhere."""
        if self.s == self.p - 1:
            y = tf.concat([self.h_out[i] for i in range(self.m)], 0)
        else:
            shape = tf.concat([[tf.shape(self.x)[0]], list(self.layer._shapes[-1][1:])], 0)
            y = tf.zeros(shape, self.layer._dtypes[-1])
        return p2p._after(y, self.pending + [self.last])

    def output_gradient(self, dy):
        if self.s == self.p - 1:
            for i in range(self.m):
                self.g_out[i] = dy[i * self.mb : (i + 1) * self.mb]

    def _recv_grad(self, i):
        nxt = self.ranks[self.s + 1]
        template = tf.zeros(self._shape(self.s + 1), self.layer._dtypes[self.s])
        g = ops.receive(template, {self.rank: nxt}, tag=_grad_tag(i), timeout=self.layer.timeout, name=self.layer.name)
        self.g_out[i] = g
        return g

    def _backward(self, i):
        tape, x, y, values = self.tapes.pop(i)
        if self.loss_fn is not None and self.s == self.p - 1:
            target, grads = self.losses.pop(i), None
        else:
            target, grads = y, self.g_out.pop(i)
        # The gradient of each stage weight (a slice of the buffer), not of
        # the buffer: the buffer's would be one buffer-sized tensor per
        # slice (a slice's gradient is the whole input, zeros around the
        # slice) summed at the end, several times the stage's size at once.
        sources = ([x] if x.dtype.is_floating else []) + list(values)
        out = tape.gradient(target, sources, output_gradients=grads)
        dvalues = [
            g if g is not None else tf.zeros_like(v)
            for g, v in zip(out[len(out) - len(values):], values)
        ]
        if self.dvalues is None:
            self.dvalues = dvalues
        else:
            self.dvalues = [a + g for a, g in zip(self.dvalues, dvalues)]
        if x.dtype.is_floating:
            self.dx[i] = out[0] if out[0] is not None else tf.zeros_like(x)
        return tf.group(*self.dvalues)  # what the next instruction waits for

    def _send_grad(self, i):
        prev = self.ranks[self.s - 1]
        sent = ops.send(self.dx.pop(i), {self.rank: prev}, tag=_grad_tag(i), timeout=self.layer.timeout, name=self.layer.name)
        self.pending.append(sent)
        return sent

    def input_gradient(self):
        """Stage 0's gradient of the group's batch; zeros elsewhere (None for ints)."""
        if not self.x.dtype.is_floating:
            return None
        if self.s == 0:
            g = tf.concat([self.dx.pop(i) for i in range(self.m)], 0)
        else:
            g = tf.zeros_like(self.x)
        return p2p._after(g, self.pending + [self.last])

    def weight_gradient(self):
        """This replica's buffer gradient: the stage weights' summed
        gradients laid out as the buffer holds them (one concatenation)."""
        held = self.layer._held_stages(self.rank)
        if self.dvalues is None:
            dflat = tf.zeros_like(self.flat)
        else:
            dflat = self.layer._flat_gradient(self.dvalues, self.s, held, self.flat)
        return p2p._after(dflat, self.pending + [self.last])
