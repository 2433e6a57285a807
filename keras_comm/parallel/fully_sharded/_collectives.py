"""A `FullyShard` layer's collectives: gather, prefetch, reduce-scatter.

The layer moves its weights in one collective per direction and dtype: the
shards packed member-major (`keras_comm.variables.packing`) are all-gathered
into full weights for the forward and again for the backward (with
`prefetch`, one wrapped layer early), and the full gradients are packed and
reduce-scattered back to shard gradients.
"""


import threading

import tensorflow as tf

from keras_comm import ops
from keras_comm.parallel import _collectives
from keras_comm.parallel import mesh as mesh_lib
from keras_comm.variables import packing
from keras_comm.parallel.fully_sharded._param import Accumulation
from keras_comm.parallel.fully_sharded._param import is_float


class Trace:
    """What the wrapped layers traced so far into one graph, by one thread,
    share for prefetching: the last forward's gate, the forward order of
    the layers with their shard tensors, the backwards traced, and the
    gathers issued ahead ({forward position: full weights})."""

    def __init__(self):
        self.forward_gate = None
        self.chain = []
        self.done = set()
        self.prefetched = {}


# The graph's own attribute, {thread id: Trace}: in-process replicas trace
# each in its own thread into one graph. Kept on the graph (not in a weak map
# keyed by it: the traces hold the graph's tensors, which hold the graph) so
# that it lives and dies with the trace.
TRACE_ATTRIBUTE = "keras_comm_fully_shard_traces"


def trace_state():
    """The current graph's and thread's `Trace`; None when eager."""
    if tf.executing_eagerly():
        return None
    graph = tf.compat.v1.get_default_graph()
    traces = getattr(graph, TRACE_ATTRIBUTE, None)
    if traces is None:
        traces = {}
        setattr(graph, TRACE_ATTRIBUTE, traces)
    return traces.setdefault(threading.get_ident(), Trace())


def after(tensors, dependencies):
    """`tensors`, computed only after every tensor in `dependencies`."""
    if not dependencies or tf.executing_eagerly():
        return list(tensors)
    with tf.control_dependencies(dependencies):
        return [tf.identity(t) for t in tensors]


class ShardCollectives:
    """The collective half of `FullyShard` (a mixin: `FullyShard` holds the state)."""

    def _group(self):
        rank = 0 if _collectives.shape_only() else None
        return mesh_lib.runtime_mesh(self.mesh, self.axis).group(self.axis, rank)

    def _gather(self, shards):
        """Full weights (inner shapes, compute dtype) from this replica's shards."""
        group = self._group()
        n = group.size
        compute = self.compute_dtype
        full = [None] * len(shards)
        for dtype, index in self._buckets().items():
            pieces = [shards[i] for i in index]
            if dtype.is_floating and is_float(compute) and tf.as_dtype(compute) != dtype:
                pieces = [tf.cast(p, compute) for p in pieces]
            packed = tf.concat(pieces, 0) if len(pieces) > 1 else pieces[0]
            gathered = _collectives.gather_along(packed, 0, group, f"{self.name}_gather", self.timeout)
            shapes = [self._specs[i].full_shape for i in index]
            for i, w in zip(index, packing.unpack(gathered, self._layout(index, n), shapes)):
                full[i] = w
        return full

    def _layout(self, index, n):
        """The member-major layout of shards `index` over `n` members."""
        return packing.Layout([self._specs[i].size for i in index], n, minimum=1)

    def _backward_gather(self, shards, upstream, position):
        """The backward's full weights, and with `prefetch` the all-gather
        for the wrapped layer traced before this one in the forward (whose
        backward comes next), issued now so that it can run during this
        layer's recompute and gradient.

        keras_comm's collectives on a device run in program order (their
        ordering token), and this layer's reduce-scatter is traced before
        the next backward: a gather traced in the next backward would wait
        for it, and so for this layer's whole backward. Each prefetch waits
        for this layer's upstream gradient, so at most two layers' full
        weights are gathered at once.
        """
        trace = trace_state()
        if trace is None or position is None:
            return self._gather(after(shards, upstream))
        trace.done.add(position)
        full = trace.prefetched.pop(position, None)
        if full is None:
            full = self._gather(after(shards, upstream))
        previous = position - 1
        if (
            self.prefetch
            and previous >= 0
            and previous not in trace.done
            and previous not in trace.prefetched
        ):
            layer, layer_shards = trace.chain[previous]
            trace.prefetched[previous] = layer._gather(after(layer_shards, upstream))
        return full

    def _scatter(self, grads):
        """This replica's shard gradients from the full local gradients."""
        group = self._group()
        n = group.size
        out = [None] * len(self._shards)
        local = self.accumulation is Accumulation.LOCAL and self.accumulation_steps > 1
        if local:
            self._check_local_window()
            count = self._hidden.count
            update = tf.equal((count.read_value() + 1) % self.accumulation_steps, 0)
        for dtype, index in self._buckets().items():
            packed = packing.pack([grads[i] for i in index], self._layout(index, n), dtype)

            def reduce_scatter(x):
                return _collectives.scatter_batch_sum(x, group, f"{self.name}_grad", self.timeout)

            if local:
                acc = self._hidden.acc[dtype]
                total = acc.read_value() + packed
                k = tf.shape(packed)[0] // n
                mine = tf.cond(update, lambda: reduce_scatter(total), lambda: tf.zeros([k], dtype))
                acc.assign(tf.where(update, tf.zeros_like(total), total))
            else:
                mine = reduce_scatter(packed)
            sizes = [self._specs[i].shard_shape[0] for i in index]
            for i, piece in zip(index, tf.split(mine, sizes)):
                out[i] = piece
        if local:
            self._hidden.count.assign_add(1)
        if tf.as_dtype(self.compute_dtype) == tf.float16:
            out = self._poison_if_any_non_finite(grads, out, group)
        return out

    def _poison_if_any_non_finite(self, grads, out, group):
        """float16 compute (loss scaling): every replica's shard gradients
        become NaN when any replica's local gradient of this layer overflowed.

        A LossScaleOptimizer skips a step when its gradients are not finite,
        judging the gradients it holds; here each replica holds a different
        shard, and an overflow lands in one replica's shard only, so the
        replicas would disagree: some skip (and halve their loss scale), the
        others apply the infinity (Keras's multi-replica apply takes the first
        replica's verdict). One scalar all-reduce per layer makes the verdict
        the shard group's; the mesh's other axes see the NaN through the
        shard's sum over them. Exact otherwise (x + 0 == x).
        """
        bad = tf.add_n(
            [tf.reduce_sum(tf.cast(tf.logical_not(tf.math.is_finite(g)), tf.float32)) for g in grads]
        )
        if group.size > 1 and not _collectives.shape_only():
            bad = ops.all_reduce(bad, group=group, timeout=self.timeout, name=f"{self.name}_grad_finite")
        poison = tf.where(bad > 0, tf.constant(float("nan")), tf.constant(0.0))
        return [o + tf.cast(poison, o.dtype) for o in out]

    def set_accumulation_window(self, steps):
        """Declares who applies this layer's "local" accumulation.

        `keras_comm.callbacks.ParallelOptimizer` calls it when a `fit` it
        serves begins (its `accumulation_steps`, once it has checked that its
        updates fall on the layer's every k-th backward) and ends (None).
        """
        self._accumulation_window = steps

    def _check_local_window(self):
        """At trace time of a backward with "local" accumulation: a
        ParallelOptimizer with the same `accumulation_steps` must serve the
        fit, or the optimizer would apply zero gradients k-1 times in k."""
        k = self.accumulation_steps
        if self._accumulation_window != k:
            raise ValueError(
                f"FullyShard {self.name!r}: accumulation='local' with "
                f"accumulation_steps={k} reduce-scatters once every {k} backward "
                "passes, so it trains only under model.fit with "
                f"keras_comm.callbacks.ParallelOptimizer(accumulation_steps={k}) "
                "(without it the optimizer would apply zero gradients k-1 "
                "times in k). Received: no ParallelOptimizer serving this fit"
            )
