"""The private primitive tier: one function per TensorFlow collective.

Everything here runs on one replica, takes a resolved `Group` the replica is a
member of, and returns the raw collective's result. No gradients, no Keras:
`keras_comm.ops` wraps these with `tf.custom_gradient`.

Two rules keep in-process and multi-process runs alike from hanging:

* every op is placed on its replica's device, and
* every op on a device is ordered behind the previous one through that
  device's *ordering token* (a resource variable), as tf.distribute's own
  ``CollectiveReplicaLauncher`` does. Broadcast send/recv take no token, so
  they are chained to it by a read before and a write after.

Eager execution with several replicas in one process needs one more step:
tf.distribute runs those replicas' Python one thread at a time, so a
collective issued directly would wait forever for its local peers. `run`
hands every local replica's collective to one ``merge_call`` that launches
them concurrently. This is why every replica must call `run` at the same
points of the program (SPMD), members of the group or not.
"""

import concurrent.futures
import functools
import threading
import zlib

import tensorflow as tf

from keras_comm import config
from keras_comm import errors
from keras_comm import topology
from keras_comm import watchdog
from keras_comm._private import keras_api
from keras_comm._private import tf_api
from keras_comm.ops import _fusion

_MERGE_OPS = {"sum": "Add", "prod": "Mul", "max": "Max", "min": "Min"}

_tokens = {}
_tokens_lock = threading.Lock()


def _ordering_token(device):
    with _tokens_lock:
        token = _tokens.get(device)
        if token is None:
            token = _tokens[device] = tf_api.ordering_token_variable(device)
        return token


def _handle_in_graph(token):
    # Nested graphs (cond branches, their gradients) must capture the token
    # through the outermost function; see tf_api.capture_in_outermost_function.
    return tf_api.capture_in_outermost_function(token.handle)


def _local_replica_count():
    extended = tf.distribute.get_strategy().extended
    return len(getattr(extended, "worker_devices", ()) or ()) or 1


def run(thunk):
    """Runs this replica's collective `thunk` (a no-argument callable).

    Every replica must call `run` at the same program points, each with its
    own thunk (non-members of a group pass one that returns their
    pass-through value). In graph mode, or with one replica per process, this
    is just ``thunk()``.
    """
    if not tf.executing_eagerly():
        return thunk()
    # Eager collectives run here and now: the process watchdog bounds them
    # (see keras_comm.watchdog), not a per-op TensorFlow timeout.
    with watchdog.guard(_EAGER_SITE):
        ctx = tf.distribute.get_replica_context()
        if ctx is None or _local_replica_count() == 1 or tf.distribute.in_cross_replica_context():
            return thunk()
        return ctx.merge_call(_run_concurrently, args=(thunk,))


_EAGER_SITE = watchdog.Site("an eager keras_comm collective")


def _run_concurrently(strategy, thunks):
    thunks = strategy.experimental_local_results(thunks)
    with concurrent.futures.ThreadPoolExecutor(len(thunks)) as pool:
        results = list(pool.map(lambda f: f(), thunks))
    return tf_api.per_replica(results)


def _hint():
    """The strategy's communication implementation ('auto', 'ring', 'nccl')."""
    return tf_api.communication_implementation(tf.distribute.get_strategy())


def _timeout(timeout):
    return config.get_timeout() if timeout is None else timeout


def _op_timeout(call):
    """The timeout TensorFlow enforces per op: none under a watchdog guard.

    TF's per-op timeout costs threads for its whole duration (see
    keras_comm.watchdog); a layer's explicit `timeout=` always gets it.
    """
    if call.timeout is None and watchdog.covers():
        return 0
    return _timeout(call.timeout)


def _op_name(name, kind):
    # TF op names may not contain some characters Keras layer names allow.
    base = "".join(c if c.isalnum() or c in "_.-" else "_" for c in (name or ""))
    return f"{base}_{kind}" if base else kind


class Call:
    """Everything a primitive needs about one collective call.

    Build it with `resolve` in the ops tier.

    Attributes:
        replica: the calling `topology.Replica`.
        group: the resolved `topology.Group` (the whole world for None).
        timeout: seconds before DeadlineExceeded, or None for the default.
        name: a name for the op (the layer's name), shown in traces.
    """

    __slots__ = ("replica", "group", "timeout", "name", "symbolic")

    def __init__(self, replica, group, timeout=None, name=None, symbolic=False):
        self.replica = replica
        self.group = group
        self.timeout = timeout
        self.name = name
        # Keras's symbolic build (shapes only, cross-replica): primitives
        # return stand-ins of the right shape and dtype, nothing is sent.
        self.symbolic = symbolic

    @property
    def device(self):
        return self.replica.device

    @property
    def size(self):
        return self.group.size

    @property
    def member(self):
        """Whether the calling replica belongs to the group."""
        return self.replica.rank in self.group

    @property
    def index(self):
        """The caller's position in the group."""
        return self.group.index(self.replica.rank)

    @property
    def trivial(self):
        """True when no data needs to move (a group of one)."""
        return self.group.size == 1

    def _keys(self, key=None):
        """(group key, instance key, TF timeout) for one collective op."""
        key = self.group.key if key is None else key
        timeout = _op_timeout(self)
        # Traced without a TF timeout: the watchdog must cover every call.
        check = watchdog.check_guarded if timeout == 0 else None
        return key, topology.instance_keys.next(key, self.device, check), timeout


def resolve(group=None, timeout=None, name=None):
    """Resolves the calling replica and `group` into a `Call`.

    Args:
        group: None (the whole world), a rank list or a `topology.Group`.
        timeout: seconds, or None for `keras_comm.get_timeout()` at trace time.
        name: the layer or op name, used in op names and error messages.

    Raises:
        ValueError: if the group names ranks outside the world.
        RuntimeError: in cross-replica context of a multi-replica strategy.
    """
    what = f"keras_comm op {name!r}" if name else "keras_comm collectives"
    symbolic = keras_api.in_symbolic_build()
    if symbolic:
        replica = topology.Replica(0, tf.distribute.get_strategy().num_replicas_in_sync, "")
    else:
        replica = topology.current_replica(what)
    group = topology.as_group(group)
    if group is None:
        group = topology.Group(range(replica.world_size))
    else:
        try:
            group.check_world(replica.world_size)
        except ValueError as e:
            raise ValueError(f"{what}: {e}") from None
    return Call(replica, group, timeout, name, symbolic)


def _stand_in(kind, x, call):
    """Shape-and-dtype stand-in for a collective's output (symbolic build)."""
    if kind == "all_gather":
        return tf.concat([x] * call.size, axis=0)
    if kind == "reduce_scatter":
        return x[: tf.shape(x)[0] // call.size]
    return tf.identity(x)


def _record(call, kind):
    """Records the op name TF will report, for `keras_comm.errors`."""
    info = errors.CollectiveInfo(
        op_name=_op_name(call.name, kind),
        layer=call.name,
        kind=kind,
        group=call.group.ranks,
        timeout=_timeout(call.timeout),
        rank=call.replica.rank,
    )
    errors.record(info)
    watchdog.note(info)
    return info


def _compare_fingerprints(rows, index):
    rows = rows.tolist()
    mine = rows[index]
    same = lambda r: r[:3] == mine[:3] and r[4:] == mine[4:]  # noqa: E731 (all but rank)
    if all(same(r) for r in rows):
        return b""
    return errors.mismatch_message(rows, index).encode()


def _check_call(x, call, kind, detail=""):
    """Checked mode: all members verify they make the same call.

    Gathers [op id, dtype, ndims, rank, dims...] from every member (one small
    all-gather) and raises, on every member, an error naming each rank's
    call if they differ. Returns the check's output, to order the real
    collective after it.
    """
    text = f"layer {call.name} {kind}{detail}" if call.name else f"{kind}{detail}"
    op_hash = zlib.crc32(text.encode())
    errors.remember_fingerprint(op_hash, text)
    size = errors.MAX_DIMS
    with tf.device(call.device):
        shape = tf.shape(x, out_type=tf.int64)[:size]
        dims = tf.concat([shape, tf.fill([size - tf.size(shape)], tf.constant(-1, tf.int64))], 0)
        head = tf.stack([
            tf.constant(op_hash, tf.int64),
            tf.constant(x.dtype.as_datatype_enum, tf.int64),
            tf.cast(tf.rank(x), tf.int64),
            tf.constant(call.replica.rank, tf.int64),
        ])
        fingerprint = tf.reshape(tf.concat([head, dims], 0), [1, errors.FINGERPRINT_SIZE])
    rows = _ordered(call, "check", tf_api.all_gather_v2, t=fingerprint)
    with tf.device(call.device):
        problem = tf.numpy_function(
            functools.partial(_compare_fingerprints, index=call.index),
            [rows],
            tf.string,
            stateful=True,
        )
        # An Assert, not an exception in Python: the message stays readable.
        return tf.debugging.Assert(
            tf.equal(problem, ""), [problem], name=_op_name(call.name, "check")
        )



def _statically_empty(x):
    """True when `x` has no elements whatever the data: nothing to move.

    TensorFlow's CPU collectives crash the process (SIGSEGV) on some empty
    inputs -- a broadcast of a [0] tensor between 2 in-process replicas
    every time, eager all-reduces intermittently -- so no collective is
    launched for them.
    The decision depends on the static shape only, so members that agree
    on the shape all skip, and keep drawing the same instance keys.
    """
    return x.shape.num_elements() == 0


def _ordered(call, kind, launch, **attrs):
    """Issues one token-ordered collective on the caller's device.

    `launch` is a TF collective taking (group_size, group_key, instance_key,
    communication_hint, timeout, ordering_token, name) by keyword.
    """
    if call.symbolic:
        return _stand_in(kind, attrs["t"], call)
    _fusion.settle([attrs["t"]])
    info = _record(call, kind)
    if kind != "check" and config.get_check_calls():
        detail = f" {attrs['merge_op']}" if "merge_op" in attrs else ""
        checked = _check_call(attrs["t"], call, kind, detail)
        with tf.device(call.device), tf.control_dependencies([checked]):
            attrs["t"] = tf.identity(attrs["t"])
    if _statically_empty(attrs["t"]):
        with tf.device(call.device):
            return _stand_in(kind, attrs["t"], call)
    key, instance, timeout = call._keys()
    token = _ordering_token(call.device)
    with tf.device(call.device), errors._translating(info):
        return launch(
            group_size=call.size,
            group_key=key,
            instance_key=instance,
            communication_hint=_hint(),
            timeout=timeout,
            ordering_token=_handle_in_graph(token),
            name=_op_name(call.name, kind),
            **attrs,
        )


def _unfused(kind, x, call, op):
    """Issues collective `kind` of `x` now: how `_fusion` sends a packed bucket."""
    if kind == "all_gather":
        return all_gather(x, call)
    if kind == "reduce_scatter":
        return reduce_scatter(x, call)
    return all_reduce(x, call, op)


def all_reduce(x, call, op="sum", fusion=0):
    """Elementwise reduction of `x` over the group; every member gets it.

    With ``fusion > 0`` inside a `_fusion.fusion_scope` (graph mode), the
    reduction is deferred and packed with the other members of that fusion
    group; see `keras_comm.ops._fusion`.
    """
    deferred = _fusion.defer(x, call, op, fusion, "all_reduce", _unfused) if fusion else None
    if deferred is not None:
        return deferred
    return _ordered(
        call,
        "all_reduce",
        tf_api.all_reduce_v2,
        t=x,
        merge_op=_MERGE_OPS[op],
        final_op="Id",
    )


def all_gather(x, call, fusion=0):
    """Concatenates every member's `x` (same shape everywhere) on axis 0.

    ``fusion > 0`` defers and packs it as `all_reduce` does.
    """
    deferred = _fusion.defer(x, call, None, fusion, "all_gather", _unfused) if fusion else None
    if deferred is not None:
        return deferred
    return _ordered(call, "all_gather", tf_api.all_gather_v2, t=x)


def all_to_all(x, call):
    """Sends ``x[i]`` to group member i; returns what each member sent here.

    `x` must have leading dimension equal to the group size.
    """
    return _ordered(call, "all_to_all", tf_api.all_to_all_v2, t=x)


def has_native_reduce_scatter(device):
    """TF has a reduce-scatter kernel only for NCCL (GPU) collectives."""
    return "GPU" in device.upper() and _hint() in ("auto", "nccl")


def reduce_scatter(x, call, fusion=0):
    """SUM over the group, keeping this member's 1/size slice of axis 0.

    ``fusion > 0`` defers and packs it as `all_reduce` does.

    On GPUs this is TF's native (NCCL) reduce-scatter. TF has no CPU kernel
    for it, so on CPUs it is an all-to-all followed by a local sum: each
    member sends and receives (n-1)/n of `x`, the same bytes as a ring
    reduce-scatter and half an all-reduce's.
    """
    deferred = _fusion.defer(x, call, "sum", fusion, "reduce_scatter", _unfused) if fusion else None
    if deferred is not None:
        return deferred
    if has_native_reduce_scatter(call.device):
        return _ordered(call, "reduce_scatter", tf_api.reduce_scatter_v2, t=x)
    n = call.size
    shape = tf.shape(x)
    chunks = tf.reshape(x, tf.concat([[n, shape[0] // n], shape[1:]], 0))
    received = all_to_all(chunks, call)
    with tf.device(call.device):
        return tf.reduce_sum(received, axis=0)


def _chained(call, fn):
    """Runs a token-less collective in order with the device's token chain."""
    token = _ordering_token(call.device)
    with tf.device(call.device):
        with tf.control_dependencies([token.read_value()]):
            out = fn()
        with tf.control_dependencies([out]):
            token.assign_add(0.0, read_value=False)
    return out


def broadcast(x, call, root_index):
    """Returns group member `root_index`'s `x` on every member.

    `x` gives the shape and dtype on receivers (its values are not used).
    """
    if call.size == 1 or call.symbolic:
        return tf.identity(x)
    _fusion.settle([x])
    info = _record(call, "broadcast")
    if config.get_check_calls():
        checked = _check_call(x, call, "broadcast", f" root {root_index}")
        with tf.device(call.device), tf.control_dependencies([checked]):
            x = tf.identity(x)
    if _statically_empty(x):
        with tf.device(call.device):
            return tf.identity(x)
    if call.index == root_index:
        # The send's output must be used, or tf.function prunes the op.
        launch = functools.partial(tf_api.broadcast_send_v2, x)
    else:
        launch = lambda **kw: tf_api.broadcast_recv_v2(tf.shape(x), x.dtype, **kw)  # noqa: E731
    return _broadcast_chained(call, "broadcast", info, launch, call.size)


def _broadcast_chained(call, kind, info, launch, group_size, key=None):
    """Issues one broadcast send or receive, ordered by `_chained`.

    `launch` is `tf_api.broadcast_send_v2` or `broadcast_recv_v2` with its
    tensor (or shape and dtype) bound; `key` is the group key (None: the
    call's group's). Serves `broadcast` and the point-to-point `send` and
    `recv` (two-member broadcasts).
    """
    key, instance, timeout = call._keys(key)

    def fn():
        return launch(
            group_size=group_size,
            group_key=key,
            instance_key=instance,
            communication_hint=_hint(),
            timeout=timeout,
        )

    with tf.name_scope(_op_name(call.name, kind)), errors._translating(info):
        return _chained(call, fn)


def _pair_key(a, b, tag):
    return topology.group_key(("p2p", min(a, b), max(a, b), int(tag)))


def send(x, call, dest, tag=0):
    """Sends `x` to global rank `dest` (a two-member broadcast).

    Returns the send's output (equal to `x`); callers must make it reach the
    function's outputs or a control dependency, or tf.function prunes it.
    """
    if call.symbolic:
        return tf.identity(x)
    _fusion.settle([x])
    info = _record(call, "send")
    launch = functools.partial(tf_api.broadcast_send_v2, x)
    return _broadcast_chained(call, "send", info, launch, 2, _pair_key(call.replica.rank, dest, tag))


def recv(shape, dtype, call, src, tag=0):
    """Receives a tensor of `shape`/`dtype` sent by global rank `src`."""
    if call.symbolic:
        return tf.zeros(shape, dtype)
    _fusion.settle([])
    info = _record(call, "recv")
    launch = functools.partial(tf_api.broadcast_recv_v2, shape, dtype)
    return _broadcast_chained(call, "recv", info, launch, 2, _pair_key(call.replica.rank, src, tag))
