"""Who is where: world size, this replica's rank, groups, and collective keys.

A *replica* is one copy of the model running on one device. Under
`tf.distribute.MultiWorkerMirroredStrategy` the global rank of a replica is
``task_index * replicas_per_worker + local_index``, TensorFlow's
``replica_id_in_sync_group``. A *group* is a set of global ranks; inside a group
a replica's position is its index in the ascending list of ranks.

Collective keys are what TensorFlow uses to match the ops of one collective on
different devices. They must agree on every worker without any communication:

* group keys are derived from the group's ranks alone (a hash into a range that
  tf.distribute's own keys, which count up from 1, never reach);
* instance keys are drawn per (group, device) **when the step function is
  called**, not when it is traced (``capture_call_time_value``), exactly as
  `tf.distribute`'s own ``CollectiveReplicaLauncher`` does. All workers call
  their step functions in the same order, so the keys agree even when one
  worker retraces a function and another does not.
"""

import dataclasses
import json
import os
import threading
import warnings
import zlib

import numpy as np
import tensorflow as tf

from keras_comm import _validation
from keras_comm._private import tf_api
from keras_comm_run import cluster as _cluster_config

# tf.distribute allocates group keys from 1 upwards, one per device set; ours
# live far above so the two can never collide.
_GROUP_KEY_BASE = 1 << 24
_GROUP_KEY_SPAN = (1 << 30) - _GROUP_KEY_BASE


class Group:
    """An immutable set of global replica ranks that communicate together.

    Args:
        ranks: a non-empty sequence of distinct non-negative ints. The order
            given does not matter: a replica's rank *within* the group is its
            index in the sorted ranks.

    Raises:
        TypeError: if `ranks` is not a sequence of ints.
        ValueError: if `ranks` is empty, has duplicates or negative ranks.

    Example:

    >>> g = keras_comm.Group([2, 0])
    >>> g.ranks, g.size, g.index(2)
    ((0, 2), 2, 1)
    """

    __slots__ = ("_ranks",)

    def __init__(self, ranks):
        if isinstance(ranks, Group):
            ranks = ranks.ranks
        self._ranks = _validation.ranks(ranks, "group")

    @property
    def ranks(self):
        """The global ranks, ascending."""
        return self._ranks

    @property
    def size(self):
        return len(self._ranks)

    def __contains__(self, rank):
        return rank in self._ranks

    def index(self, rank):
        """Returns the position of global `rank` within the group."""
        try:
            return self._ranks.index(rank)
        except ValueError:
            raise ValueError(
                f"Rank {rank} is not in group {list(self._ranks)}."
            ) from None

    def check_world(self, world_size, name="group"):
        """Raises ValueError if a rank is outside ``range(world_size)``."""
        bad = [r for r in self._ranks if r >= world_size]
        if bad:
            raise ValueError(
                f"`{name}` has ranks {bad} outside the world of {world_size} "
                f"replica(s) (valid ranks: 0..{world_size - 1}). "
                f"Received: {name}={list(self._ranks)}"
            )

    @property
    def key(self):
        """The TensorFlow collective group key; the same on every worker."""
        return group_key(self._ranks)

    def __eq__(self, other):
        return isinstance(other, Group) and other._ranks == self._ranks

    def __hash__(self):
        return hash(self._ranks)

    def __repr__(self):
        return f"Group({list(self._ranks)})"

    def get_config(self):
        return list(self._ranks)


def as_group(group, name="group"):
    """Converts None, a rank list or a Group to a Group (or None = world)."""
    if group is None or isinstance(group, Group):
        return group
    try:
        return Group(group)
    except (TypeError, ValueError) as e:
        raise type(e)(str(e).replace("`group`", f"`{name}`")) from None


_group_key_owner = {}
_group_key_lock = threading.Lock()


def group_key(ranks):
    """Deterministic TF collective group key for a tuple of sorted ranks."""
    ranks = tuple(ranks)
    digest = zlib.crc32(",".join(map(str, ranks)).encode())
    key = _GROUP_KEY_BASE + digest % _GROUP_KEY_SPAN
    with _group_key_lock:
        owner = _group_key_owner.setdefault(key, ranks)
    if owner != ranks:
        # Astronomically unlikely; fail loudly rather than mix two groups.
        raise ValueError(
            f"Groups {list(owner)} and {list(ranks)} hash to the same collective "
            "group key; use a different group."
        )
    return key


@dataclasses.dataclass(frozen=True)
class Replica:
    """The replica the current code runs as.

    Attributes:
        rank: global rank, ``0 .. world_size - 1``.
        world_size: number of replicas in sync across all workers.
        device: the device string this replica's ops run on.
    """

    rank: int
    world_size: int
    device: str


def _strategy_and_context():
    strategy = tf.distribute.get_strategy()
    ctx = tf.distribute.get_replica_context()
    return strategy, ctx


def validate_tf_config(text=None):
    """Checks the TF_CONFIG that MultiWorkerMirroredStrategy will read.

    Call it before creating the strategy to get a clear error for a
    malformed TF_CONFIG (bad JSON, no "cluster" or "task", a task index out
    of range) instead of TensorFlow's. `keras-comm-run` always sets a valid
    one.

    Args:
        text: the TF_CONFIG string; None reads the environment variable.

    Returns:
        The parsed dict, or None if TF_CONFIG is unset or empty.

    Raises:
        ValueError: naming what is wrong.
    """
    if text is None:
        text = os.environ.get("TF_CONFIG", "")
        if not text.strip():
            return None
    return _cluster_config.validate_tf_config(text)


def world_size():
    """Number of replicas kept in sync (1 outside any strategy)."""
    return tf.distribute.get_strategy().num_replicas_in_sync


def worker_count(strategy=None):
    """How many worker processes `strategy` spans (1 outside MultiWorkerMirroredStrategy)."""
    strategy = strategy or tf.distribute.get_strategy()
    if strategy.num_replicas_in_sync == 1:
        return 1  # (the default strategy has no `worker_devices`)
    devices = len(strategy.extended.worker_devices) or 1
    return max(1, strategy.num_replicas_in_sync // devices)


def is_multi_worker(strategy=None):
    """Whether `strategy` spans more than one worker process."""
    return worker_count(strategy) > 1


def task_id(strategy=None):
    """This process's worker index in `strategy`'s cluster (0 outside one)."""
    strategy = strategy or tf.distribute.get_strategy()
    task = getattr(getattr(strategy, "cluster_resolver", None), "task_id", None)
    return 0 if task is None else int(task)


def is_chief(strategy=None):
    """Whether this process is the chief: it holds replica 0 and writes checkpoints.

    True outside MultiWorkerMirroredStrategy and on its worker 0.
    """
    strategy = strategy or tf.distribute.get_strategy()
    return bool(getattr(strategy.extended, "should_checkpoint", True))


_warned_no_strategy = False


def job_workers(environ=None):
    """The number of workers the environment says this job has (1 if none).

    Read from what `keras-comm-run` sets (``KERAS_COMM_WORLD_SIZE``, then
    ``WORLD_SIZE``) or, failing that, the TF_CONFIG cluster's chief and
    workers. Malformed values count as 1: this only decides a warning.
    """
    environ = os.environ if environ is None else environ
    for name in ("KERAS_COMM_WORLD_SIZE", "WORLD_SIZE"):
        value = environ.get(name, "").strip()
        if value.isdigit():
            return int(value)
    try:
        cluster = json.loads(environ.get("TF_CONFIG", "") or "{}").get("cluster", {})
        return sum(len(cluster.get(job, ())) for job in ("chief", "worker")) or 1
    except (ValueError, AttributeError, TypeError):
        return 1


def _warn_if_job_has_other_workers(what):
    """Warns once when a collective runs alone inside a multi-worker job.

    Outside any strategy a collective is its one-rank case (the identity),
    right for single-process use and for code a worker runs on its own
    (chief-only evaluation or export). Inside a job of several workers it is
    far more often a forgotten ``with strategy.scope()`` / `strategy.run`:
    every worker then trains alone, silently. A warning, not an error
    (Horovod raises), because the one-rank answer is correct for that
    deliberate single-worker code and raising would break it.
    """
    global _warned_no_strategy
    if _warned_no_strategy:
        return
    workers = job_workers()
    if workers > 1:
        _warned_no_strategy = True
        warnings.warn(
            f"{what} ran outside any tf.distribute strategy, but this process is "
            f"one of {workers} workers (TF_CONFIG / keras-comm-run): every "
            "keras_comm collective acts as its one-replica case (the identity) "
            "and each worker computes alone. Create "
            "tf.distribute.MultiWorkerMirroredStrategy() and build and train the "
            "model under `strategy.scope()` (model.fit) or call collectives "
            "inside `strategy.run`. Warned once per process.",
            RuntimeWarning,
            stacklevel=3,
        )


def current_replica(what="keras_comm collectives"):
    """Returns the `Replica` the caller runs as.

    Outside any strategy, or under a strategy with one replica, this is rank 0
    of a world of 1 (so layers act as their one-rank case); outside any
    strategy in a job of several workers, that warns once (see
    `job_workers`).

    Raises:
        RuntimeError: in cross-replica context of a strategy with several
            replicas, where "this replica" has no meaning.
    """
    strategy, ctx = _strategy_and_context()
    n = strategy.num_replicas_in_sync
    if n == 1:
        if not tf.distribute.has_strategy():
            _warn_if_job_has_other_workers(what)
        return Replica(0, 1, tf_api.current_device() or "")
    if ctx is None:
        raise RuntimeError(
            f"{what} run once per replica: call them inside `strategy.run`, "
            "`model.fit`, `model.evaluate` or `model.predict`, not in "
            f"cross-replica context (the strategy has {n} replicas)."
        )
    rid = tf_api.replica_id(ctx)
    if not isinstance(rid, int):
        rid = tf.get_static_value(rid)
        if rid is None:
            raise RuntimeError(
                f"{what} need a static replica id; this strategy "
                f"({type(strategy).__name__}) does not provide one."
            )
    return Replica(int(rid), n, tf_api.current_device())


def rank():
    """This replica's global rank (0 outside any strategy)."""
    return current_replica("keras_comm.rank()").rank


class _InstanceKeys:
    """Per-(group key, device) counters, advanced when functions are *called*."""

    def __init__(self):
        self._lock = threading.Lock()
        self._next = {}

    def _take(self, group_key_, device):
        with self._lock:
            key = self._next.get((group_key_, device), 1)
            self._next[(group_key_, device)] = key + 1
            return key

    def next(self, group_key_, device, on_call=None):
        """Returns an int32 instance-key tensor valid for the current call.

        `on_call`, if given, runs (in Python) each time a compiled function
        holding the key is called, before the key is drawn.
        """
        # A NumPy scalar, not an eager constant: cheaper per call (no
        # eager op to create each time the compiled function runs).
        @tf.autograph.experimental.do_not_convert
        def key():
            if on_call is not None:
                on_call()
            return np.int32(self._take(group_key_, device))

        captured = tf_api.capture_call_time_value(key, tf.TensorSpec([], tf.int32))
        if captured is not None:
            return captured
        return self._eager_key(group_key_, device)

    def _eager_key(self, group_key_, device):
        with tf.device("CPU:0"):
            return tf.constant(self._take(group_key_, device), tf.int32)


instance_keys = _InstanceKeys()
