"""Differentiable point-to-point transfers: `send` and `receive`.

Every replica runs the same program (SPMD), so a send or a receive names the
ranks on which it is *active*:

* ``send(x, dest, src=...)`` sends `x` from each sending rank to its
  destination and returns `x` (the send's own output, so tf.function keeps
  the send); on other ranks it returns `x` unchanged.
* ``receive(x, src, dest=...)`` returns, on each receiving rank, the tensor
  its source sent (`x` only supplies the shape and dtype); on other ranks it
  returns `x` unchanged.

Routes are given either as one int plus the active ranks, or as a dict:
``send(x, {0: 1, 2: 3})`` means rank 0 sends to 1 and rank 2 sends to 3;
``receive(x, {1: 0, 3: 2})`` means rank 1 receives from 0 and rank 3 from 2.
With an int and no active ranks, the world must have two replicas and the
active rank is "the other one" (the two-stage pipeline case).

With a world of one replica (or outside any strategy) both are the identity,
so a pipeline model builds, trains and saves on one machine as the
single-process model it distributes.

Matching rule: the n-th send from rank a to rank b with tag t is received by
the n-th receive at b from a with tag t. Sends block until they are received
(rendezvous), so within one compiled step a rank must not wait on a receive
whose sender is itself waiting on a send to that rank issued later (the
classic blocking-ring deadlock): use `neighbor_exchange` for exchanges, which
orders the transfers so that no deadlock is possible. In eager mode sends are
posted to a per-device queue and return at once (like MPI ``isend``); the
queue runs each device's transfers in program order, as the ordering token
does in a compiled step.

Private helpers here (`_Transfer`, `_run_transfers`, `_after`) are shared
with `neighbor`.
"""

import collections
import concurrent.futures
import threading

import tensorflow as tf

from keras_comm import _validation
from keras_comm.ops import _checks
from keras_comm.ops import _collective
from keras_comm.ops import _differentiable as D

# Tags < 0 are reserved for keras_comm's own exchanges (user tags are >= 0),
# so their pair keys, and hence instance-key counters, never mix with users'.
NEIGHBOR_TAG = -1
NEIGHBOR_V2_TAG = -2

# Shared with the layers.
validate_rank = _validation.rank
validate_tag = _checks.check_tag


def routes(peer, active, peer_name, active_name, role):
    """Normalizes (peer, active ranks) into a dict {active rank: peer rank}.

    Args:
        peer: an int rank, or a dict {active rank: peer rank}.
        active: with an int `peer`: None, an int or a list of ints (the ranks
            where the op is active). Must be None with a dict `peer`.
        peer_name, active_name: argument names for error messages.
        role: "sends to" / "receives from", for error messages.

    Returns:
        A dict {active rank: peer rank}, or None when `active` is None with an
        int `peer` (resolved at trace time: "the other rank" in a world of 2).
    """
    if isinstance(peer, dict):
        if active is not None:
            raise ValueError(
                f"`{active_name}` must be None when `{peer_name}` is a dict "
                f"{{{active_name}: {peer_name}}}. Received: {active_name}={active!r}"
            )
        out = {}
        for a, p in peer.items():
            a = validate_rank(a, f"{peer_name} key")
            p = validate_rank(p, f"{peer_name}[{a}]")
            if a == p:
                raise ValueError(
                    f"`{peer_name}` maps rank {a} to itself: a rank never "
                    f"{role} itself. Received: {peer_name}={peer!r}"
                )
            out[a] = p
        if not out:
            raise ValueError(f"`{peer_name}` must not be empty. Received: {peer_name}={peer!r}")
        return out
    peer = validate_rank(peer, peer_name)
    if active is None:
        return None
    ranks = [active] if isinstance(active, int) and not isinstance(active, bool) else active
    if isinstance(ranks, (str, bytes)) or not hasattr(ranks, "__iter__"):
        raise TypeError(
            f"`{active_name}` must be None, an int rank or a list of ranks. "
            f"Received: {active_name}={active!r}"
        )
    ranks = [validate_rank(r, active_name) for r in ranks]
    if not ranks or len(set(ranks)) != len(ranks):
        raise ValueError(
            f"`{active_name}` must be a non-empty list of distinct ranks. "
            f"Received: {active_name}={active!r}"
        )
    if peer in ranks:
        raise ValueError(
            f"`{active_name}` contains `{peer_name}`={peer}: a rank never {role} "
            f"itself. Received: {active_name}={active!r}"
        )
    return {a: peer for a in ranks}


def _resolve_routes(route_map, peer, world, what, peer_name):
    """The trace-time {active: peer} dict, checked against the world."""
    if route_map is None:
        if world != 2:
            raise ValueError(
                f"{what}: without explicit active ranks, `{peer_name}`={peer} "
                f"is only meaningful in a world of 2 replicas (the other rank "
                f"is the active one); this world has {world}. Pass a dict "
                f"{{active rank: {peer_name}}}."
            )
        route_map = {1 - peer: peer}
    for a, p in route_map.items():
        for r in (a, p):
            if r >= world:
                raise ValueError(
                    f"{what}: rank {r} is outside the world of {world} "
                    f"replica(s) (valid ranks: 0..{world - 1}). "
                    f"Received: routes={route_map!r}"
                )
    return route_map


# ---------------------------------------------------------------------------
# Transfers: one ordered batch of sends and receives on one replica.
# ---------------------------------------------------------------------------

_Transfer = collections.namedtuple("_Transfer", "kind peer tag value shape dtype")
"""kind "send" (value = tensor) or "recv" (shape, dtype)."""


class _DeviceQueue:
    """One worker thread per device: eager transfers in program order.

    Eager collectives block until their peers arrive. Posting each device's
    transfers to its own FIFO thread lets a send return at once (the peer
    receives it later, perhaps in another `merge_call`), while the FIFO keeps
    the per-device order a compiled step gets from the ordering token, so
    instance keys are drawn in the same order as in graph mode.
    """

    _queues = {}
    _lock = threading.Lock()

    @classmethod
    def get(cls, device):
        with cls._lock:
            queue = cls._queues.get(device)
            if queue is None:
                queue = cls()
                cls._queues[device] = queue
            return queue

    def __init__(self):
        self._pool = concurrent.futures.ThreadPoolExecutor(1, "keras_comm_p2p")
        self._pending_sends = []

    def check_sends(self):
        """Raises the error of any earlier send on this device that failed."""
        still = []
        for f in self._pending_sends:
            if f.done():
                f.result()
            else:
                still.append(f)
        self._pending_sends = still

    def submit(self, fn, is_send):
        future = self._pool.submit(fn)
        if is_send:
            self._pending_sends.append(future)
        return future


def _one(call, t):
    if t.kind == "send":
        return D.send(t.value, call, t.peer, t.tag)
    return D.recv(t.shape, t.dtype, call, t.peer, t.tag)


def _run_transfers(call, transfers):
    """Runs `transfers` (in order) on this replica.

    Call inside a `_collective.run` thunk. Returns one result per transfer:
    a receive's tensor, or for a send a tensor that depends on the send
    (graph mode) or the sent value (eager mode, where the send is queued).
    Callers make every send's result reach their outputs.
    """
    if not tf.executing_eagerly():
        with tf.device(call.device):
            return [_one(call, t) for t in transfers]
    queue = _DeviceQueue.get(call.device)
    queue.check_sends()
    futures = [
        queue.submit(lambda t=t: _one(call, t), t.kind == "send") for t in transfers
    ]
    return [t.value if t.kind == "send" else f.result() for t, f in zip(transfers, futures)]


def _after(tensor, deps):
    """`tensor`, computed after every tensor in `deps` (keeps sends alive)."""
    deps = [d for d in deps if d is not None]
    if not deps or tf.executing_eagerly():
        return tensor
    with tf.control_dependencies(deps):
        return tf.identity(tensor)


# ---------------------------------------------------------------------------
# send / receive.
# ---------------------------------------------------------------------------


def _p2p_call(route_map, peer, peer_name, fn_name, timeout, name):
    """The call and this rank's peer (None where the op is not active).

    The call is None in a world of one, where send and receive are the
    identity and the routes are not checked.
    """
    call = _collective.resolve(None, timeout, name)
    world = call.replica.world_size
    if world == 1:
        return None, None
    route_map = _resolve_routes(route_map, peer, world, _checks.what(fn_name, name), peer_name)
    return call, route_map.get(call.replica.rank)


def send(x, dest, tag=0, *, src=None, timeout=None, name=None):
    """Sends `x` from the sending rank(s) to their destination.

    Forward: on each sending rank, sends `x` to its destination and returns
    `x`; on every other rank returns `x`. Backward: Receive reversed: a
    sending rank receives the gradient of the destination's received tensor
    and adds it to its own upstream gradient (dx = dy + d(dest's output));
    other ranks pass dy through. This is the exact adjoint of "keep `x` and
    deliver a copy to `dest`"; if the sending rank does not use the output,
    dx is just the received gradient. MindSpore: Send.

    Args:
        x: the tensor to send (the same shape on the matching receiver).
        dest: the destination global rank (int), or a dict
            ``{sending rank: destination rank}``.
        tag: an int >= 0; a receive matches sends with the same tag.
        src: with an int `dest`: the sending rank(s), an int or a list. None
            means the other rank of a world of two replicas.
        timeout: seconds before DeadlineExceeded (default
            `keras_comm.get_timeout()`).
        name: op name (the layer's name).

    Returns:
        `x` (on a sending rank, the send's output, so tf.function keeps it).

    Raises:
        ValueError: if a rank is outside the world or sends to itself, or the
            tag is negative.
    """
    tag = validate_tag(tag)
    route_map = routes(dest, src, "dest", "src", "sends to")
    call, peer = _p2p_call(route_map, dest, "dest", "send", timeout, name)
    x = tf.convert_to_tensor(x)

    def forward(x):
        (out,) = _run_transfers(call, [_Transfer("send", peer, tag, x, None, None)])
        return out

    def backward(dy, x, y):
        (g,) = _run_transfers(call, [_Transfer("recv", peer, tag, None, tf.shape(x), x.dtype)])
        return dy + g

    if call is None:
        return tf.identity(x)
    return D.collective(x, call, forward, backward, active=peer is not None)


def receive(x, src, tag=0, *, dest=None, timeout=None, name=None):
    """Receives, on the receiving rank(s), the tensor their source sent.

    Forward: on each receiving rank, returns the tensor sent by its source
    (`x` gives the shape and dtype; its values are unused); on every other
    rank returns `x`. Backward: Send reversed: a receiving rank sends dy back
    to the source and returns zeros for `x` (its values are unused); other
    ranks pass dy through. MindSpore: Receive.

    Args:
        x: the template (receiving ranks) / pass-through value (others).
        src: the source global rank (int), or a dict
            ``{receiving rank: source rank}``.
        tag: an int >= 0, matching the sender's tag.
        dest: with an int `src`: the receiving rank(s), an int or a list. None
            means the other rank of a world of two replicas.
        timeout: seconds before DeadlineExceeded.
        name: op name (the layer's name).

    Returns:
        The received tensor on receiving ranks, `x` elsewhere.

    Raises:
        ValueError: if a rank is outside the world or receives from itself,
            or the tag is negative.
    """
    tag = validate_tag(tag)
    route_map = routes(src, dest, "src", "dest", "receives from")
    call, peer = _p2p_call(route_map, src, "src", "receive", timeout, name)
    x = tf.convert_to_tensor(x)

    def forward(x):
        (out,) = _run_transfers(call, [_Transfer("recv", peer, tag, None, tf.shape(x), x.dtype)])
        return out

    def backward(dy, x, y):
        (sent,) = _run_transfers(call, [_Transfer("send", peer, tag, dy, None, None)])
        return _after(tf.zeros_like(x), [sent])

    if call is None:
        return tf.identity(x)
    return D.collective(x, call, forward, backward, active=peer is not None)


__all__ = ["receive", "send"]
