"""Fusion groups: separate all-reduces with one `fusion` id share one transfer.

MindSpore's ``fusion`` attribute lets its graph compiler pack every AllReduce
of a fusion group into one collective. TensorFlow has no such pass, so this
module does it while a `tf.function` is traced:

1. Inside a `fusion_scope`, an all-reduce with ``fusion > 0`` is *deferred*:
   the caller gets a stand-in (an ``Identity`` of its input) and the input
   joins the scope's pending bucket for (fusion id, group, reduction, dtype,
   device, timeout).
2. When the scope closes, each bucket becomes ONE all-reduce of the
   concatenated, flattened inputs, and each stand-in is rewired to read its
   slice of the result. Nothing else in the graph changes.

Rewiring is only valid if the graph stays acyclic and the device's ordering
token still orders every collective before its consumers. Two rules keep it
so:

* A bucket is flushed early -- before anything is built on top of it --
  whenever a collective (deferred or not) is about to take an input that
  depends on one of its stand-ins. So a chain of dependent all-reduces
  becomes one transfer per link, never a cycle, and every token-ordered
  collective is created after the packed op it reads from.
* A collective issued in a nested graph (a `tf.cond` branch, a `while` body,
  an inner `tf.function`) flushes every pending bucket first, since the op
  that calls the nested graph takes the token in the enclosing graph.

All-gathers and reduce-scatters with a ``fusion`` id are deferred and
packed the same way, in buckets of their own kind (a bucket never mixes
kinds): an all-gather packs by flattening each member's input and
concatenating them, gathering once, and cutting every member's block back
into the pieces; a reduce-scatter first lays each input out as
``[group_size, rest]`` (the slices that go to each member), concatenates
along the second axis, scatters once, and splits this member's slice back.
Both are exact re-layouts: every element travels once, to where the
unfused op would send it.

Deferral only happens in the graph that opened the scope; in eager mode, in
nested graphs, or with call checking on (`keras_comm.set_check_calls`), a
fused all-reduce runs immediately on its own, with the same values.
"""

import contextlib
import threading

import tensorflow as tf

from keras_comm import config
from keras_comm._private import tf_api
from keras_comm.variables import packing

_SCOPE_ATTR = "_keras_comm_fusion_scope"
_lock = threading.RLock()


def validate_fusion(fusion, name="fusion"):
    """Returns `fusion` if it is an int >= 0 (0: not fused); raises otherwise."""
    if isinstance(fusion, bool) or not isinstance(fusion, int):
        raise TypeError(f"`{name}` must be an int >= 0. Received: {name}={fusion!r}")
    if fusion < 0:
        raise ValueError(f"`{name}` must be an int >= 0 (0: no fusion). Received: {name}={fusion!r}")
    return fusion


class _Bucket:
    """The deferred members of one fusion group on one device."""

    __slots__ = ("fusion", "call", "op", "kind", "launch", "inputs", "stand_ins", "names")

    def __init__(self, fusion, call, op, kind, launch):
        self.fusion = fusion
        self.call = call
        self.op = op
        self.kind = kind
        self.launch = launch
        self.inputs = []
        self.stand_ins = []
        self.names = []


class _Scope:
    """Pending buckets of one graph; shared by the replica threads tracing it."""

    def __init__(self, graph):
        self.graph = graph
        self.depth = 0
        self.buckets = {}  # key -> _Bucket, in creation order
        self.stand_in_ops = {}  # stand-in op -> its bucket key
        self.first_id = None  # smallest stand-in op id (older ops cannot depend on one)
        # Ops known to reach no pending stand-in. Every search ends by
        # flushing the buckets it reached, so everything it visited is clean
        # from then on: the searches of one step visit each op once.
        self.clean = set()


def _scope_of(graph):
    return getattr(graph, _SCOPE_ATTR, None)


@contextlib.contextmanager
def fusion_scope():
    """Fuses the `fusion` groups of the all-reduces traced inside it.

    Use it around the body of a `tf.function` step (forward and backward
    pass) that contains `keras_comm` all-reduces or mirror operators with a
    ``fusion`` id > 0. `model.fit`, `evaluate` and `predict` open it for
    you. Nested scopes on one graph act as one, closed by the outermost.
    In eager mode it does nothing (each call communicates when it runs).

    Example:

    ```python
    @tf.function
    def step(x):
        def replica_step(x):
            with tf.GradientTape() as tape:
                loss = model(x)
            return tape.gradient(loss, model.trainable_variables)
        with keras_comm.ops.fusion_scope():
            return strategy.run(replica_step, args=(x,))
    ```
    """
    if tf.executing_eagerly():
        yield
        return
    graph = tf_api.default_graph()
    with _lock:
        scope = _scope_of(graph)
        if scope is None:
            scope = _Scope(graph)
            setattr(graph, _SCOPE_ATTR, scope)
        scope.depth += 1
    failed = False
    try:
        yield
    except BaseException:
        failed = True  # the trace is abandoned: nothing to issue
        raise
    finally:
        with _lock:
            scope.depth -= 1
            last = scope.depth == 0
        if last:
            try:
                if not failed:
                    with graph.as_default():
                        _flush(scope, list(scope.buckets))
            finally:
                delattr(graph, _SCOPE_ATTR)


KINDS = ("all_reduce", "all_gather", "reduce_scatter")


def _stand_in_value(x, call, kind):
    """A tensor with the collective's output shape, from `x` (never run).

    The stand-in is an ``Identity`` of it until the flush rewires the
    identity to read the packed result, so only its static shape matters.
    """
    if kind == "all_gather":
        return tf.concat([x] * call.size, 0)
    if kind == "reduce_scatter":
        n = call.size
        shape = tf.shape(x)
        return tf.reshape(x, tf.concat([[n, shape[0] // n], shape[1:]], 0))[0]
    return x


def defer(x, call, op, fusion, kind, launch):
    """The collective `kind` of `x` as a deferred member of group `fusion`.

    `op` is the reduction ("sum" for reduce-scatter, None for all-gather).
    `launch(kind, packed, call, op)` issues the bucket's one collective when
    the scope flushes it (the primitives pass theirs in: this module sits
    below them). Returns a stand-in for the result, or None when this call
    cannot be deferred (the caller then issues the collective itself).
    """
    if not fusion or call.symbolic or tf.executing_eagerly() or config.get_check_calls():
        return None
    graph = tf_api.default_graph()
    scope = _scope_of(graph)
    if scope is None:
        return None
    settle([x])
    key = (kind, fusion, call.group.key, op, x.dtype, call.device, call.timeout)
    with _lock:
        bucket = scope.buckets.get(key)
        if bucket is None:
            bucket = scope.buckets[key] = _Bucket(fusion, call, op, kind, launch)
        with tf.device(call.device):
            stand_in = tf.identity(_stand_in_value(x, call, kind), name="fusion_pending")
        bucket.inputs.append(x)
        bucket.stand_ins.append(stand_in)
        bucket.names.append(call.name)
        scope.stand_in_ops[stand_in.op] = key
        if scope.first_id is None:
            scope.first_id = tf_api.op_id(stand_in.op)
    return stand_in


def settle(tensors):
    """Flushes the pending buckets that a collective on `tensors` must follow.

    Called by every collective primitive before it is created.
    """
    if tf.executing_eagerly():
        return  # nothing is deferred in eager mode
    graph = tf_api.default_graph()
    scope = _scope_of(graph)
    if scope is not None:
        if scope.buckets:
            _flush(scope, _keys_reached(scope, tensors))
        return
    # A nested graph: the op calling it takes the ordering token in an
    # enclosing graph, so everything pending there must come first.
    outer = tf_api.outer_graph(graph)
    while outer is not None:
        scope = _scope_of(outer)
        if scope is not None and scope.buckets:
            with outer.as_default():
                _flush(scope, list(scope.buckets))
        outer = tf_api.outer_graph(outer)


def _keys_reached(scope, tensors):
    """Keys of the buckets with a stand-in among the ancestors of `tensors`."""
    first = scope.first_id
    clean = scope.clean
    found = set()
    seen = set()
    stack = [t.op for t in tensors if isinstance(t, tf.Tensor) and t.graph is scope.graph]
    while stack:
        op = stack.pop()
        if op in seen or op in clean or tf_api.op_id(op) < first:
            continue
        seen.add(op)
        key = scope.stand_in_ops.get(op)
        if key is not None:
            found.add(key)
        stack.extend(t.op for t in op.inputs)
        stack.extend(op.control_inputs)
    clean.update(seen)  # the caller flushes everything found
    return [k for k in scope.buckets if k in found]


def _flush(scope, keys):
    """Issues one all-reduce per bucket in `keys` and rewires its stand-ins."""
    for key in keys:
        with _lock:
            bucket = scope.buckets.pop(key, None)
            if bucket is None:
                continue
            for stand_in in bucket.stand_ins:
                del scope.stand_in_ops[stand_in.op]
            if not scope.stand_in_ops:
                scope.first_id = None
        call = type(bucket.call)(
            bucket.call.replica,
            bucket.call.group,
            bucket.call.timeout,
            _packed_name(bucket),
        )

        def launch(t, bucket=bucket, call=call):
            return bucket.launch(bucket.kind, t, call, bucket.op)

        # Built outside any caller's control-dependency block and tape: the
        # packed op depends on its inputs only, and is never differentiated
        # (each member's gradient is its own custom_gradient).
        with tf.control_dependencies(None), tf_api.stop_recording(), tf.device(call.device):
            if bucket.kind == "all_gather":
                results = packing.packed_gather(bucket.inputs, launch, call.size)
            elif bucket.kind == "reduce_scatter":
                results = packing.packed_scatter(bucket.inputs, launch, call.size)
            else:
                results = packing.packed(bucket.inputs, launch)
        for stand_in, result in zip(bucket.stand_ins, results):
            tf_api.rewire_input(stand_in.op, 0, result)


def _packed_name(bucket):
    names = [n for n in bucket.names if n]
    label = f"fusion{bucket.fusion}"
    if names:
        label += "_" + "_".join(dict.fromkeys(names))
    return label[:200]
