"""A preemption notice (SIGTERM) to any worker: every worker saves at one step, then stops.

What `BackupAndRestore(save_before_preemption=True)` runs, after TensorFlow's
`PreemptionCheckpointHandler` (tensorflow/python/distribute/failure_handling):
no per-step collective and no per-step host sync; the step is agreed through
the coordination service's key-value store, only once a notice arrives.

Why one step ahead is always safe: every `fit` step under
MultiWorkerMirroredStrategy runs collectives across all workers (at least the
distributed iterator's end-of-data agreement when its batch is pulled), so
no worker can finish step ``c + 1`` before every worker has started it. A
worker that has completed ``c`` steps and not begun the next therefore knows
that no peer has completed more than ``c``: a save "after step ``c + 1``"
is still ahead of everyone.

The protocol (keys are per `fit` call, numbered the same on every worker):

1. SIGTERM runs `_on_sigterm` in the main thread: it only records the notice
   and puts the previous SIGTERM handler back, so a second SIGTERM stops the
   worker at once, as without the option.
2. At the next step boundary (`before_step`, with ``c`` steps done) the
   signalled worker inserts ``<prefix>/step = c + 1``. The insert is atomic:
   when several workers were signalled (a launcher's stop reaches them all),
   the first one leads and the others follow. The leader then waits -- once
   -- until every worker has acknowledged, with keras_comm's collective
   timeout: no peer can pass step ``c + 1`` without the leader, so every
   worker knows the step before it gets there.
3. Each worker's watcher thread blocks in the store's `get` of that key (a
   thread, no per-step cost); when the key appears it records the step and
   acknowledges.
4. At the agreed step every worker saves (a collective when state is
   sharded), the workers check together that the chief committed the file,
   and every worker stops (`stop`): as its previous SIGTERM handler would
   stop it (under `keras-comm-run`, `SystemExit(143)` after cleanup), else
   with `SystemExit(143)`, TensorFlow's "restartable" status.

One process (no coordination service; in-process replicas): the notice sets
the step directly.
"""

import atexit
import itertools
import signal
import sys
import threading
import weakref

import tensorflow as tf

from keras_comm import config
from keras_comm._private import tf_api

#: The exit status after a preemption backup (TensorFlow's restartable code).
EXIT_STATUS = 128 + signal.SIGTERM

_STOP = "stop"
# Every worker calls `fit` the same number of times, so the n-th watched fit
# of each process uses the same keys (the store lives as long as the job).
_fits = itertools.count()
# Watches whose watcher thread may still be blocked in the store (a `fit`
# that raised never reaches on_train_end): closed at exit, before Python's
# finalization, which would end a daemon thread returning from TensorFlow's
# C++ through those frames (SIGABRT, "exception not rethrown").
_open_watches = weakref.WeakSet()


class _TfStore:
    """The coordination service's key-value store (see `tf_api`)."""

    insert = staticmethod(tf_api.key_value_insert)
    get = staticmethod(tf_api.key_value_get)


class Preempted(SystemExit):
    """Raised on every worker once the preemption backup is saved (or cannot be)."""


class Watch:
    """Watches for SIGTERM during one `fit` and agrees on the step to save at.

    Args:
        strategy: the model's strategy.
        fit_code: the code object of the running `fit` (a SIGTERM outside it,
            e.g. after `fit` raised, goes to the previous handler at once).
        store: the key-value store; None for TensorFlow's coordination service.
        task: this worker's index; num_workers: how many there are (None:
            from the strategy).
    """

    def __init__(self, strategy, fit_code=None, store=None, task=None, num_workers=None):
        resolver = getattr(strategy, "cluster_resolver", None)
        if task is None:
            task = int(getattr(resolver, "task_id", None) or 0)
        if num_workers is None:
            num_workers = _num_workers(resolver)
        self.task = task
        self.num_workers = num_workers
        self.local = num_workers <= 1 or (store is None and not tf_api.has_coordination_service())
        self._store = store or _TfStore()
        self._prefix = f"keras_comm/preemption/{next(_fits)}"
        self._fit_code = fit_code
        self._previous = None
        self._installed = False
        self._watcher = None
        #: Set by this worker's own SIGTERM.
        self.noticed = threading.Event()
        self._tried_to_lead = False
        #: The agreed number of completed steps after which to save, or None.
        self.target = None
        self.leader = None

    # --- setup and teardown -------------------------------------------------

    def start(self):
        if threading.current_thread() is not threading.main_thread():
            raise ValueError(
                "BackupAndRestore(save_before_preemption=True) needs `fit` to run "
                "in the main thread: Python delivers SIGTERM only there. Received: "
                f"fit in thread {threading.current_thread().name!r}"
            )
        self._previous = signal.getsignal(signal.SIGTERM)
        signal.signal(signal.SIGTERM, self._on_sigterm)
        self._installed = True
        if not self.local:
            self._watcher = threading.Thread(
                target=self._watch, name="keras_comm preemption watcher", daemon=True
            )
            self._watcher.start()
            _open_watches.add(self)

    def close(self):
        """Restores the SIGTERM handler and releases the watcher thread."""
        self._restore_handler()
        if self._watcher is not None:
            try:
                # Wakes every worker's watcher; refused once a step is set.
                self._store.insert(self._key("step"), _STOP)
            except tf.errors.OpError:
                pass
            self._watcher.join(timeout=5.0)
            self._watcher = None
        _open_watches.discard(self)

    def _restore_handler(self):
        if self._installed and signal.getsignal(signal.SIGTERM) == self._on_sigterm:
            # A handler installed outside Python (getsignal gives None: TF's
            # coordination service records SIGTERM and ignores it) cannot be
            # put back; the default lets a second SIGTERM stop the worker.
            previous = signal.SIG_DFL if self._previous is None else self._previous
            signal.signal(signal.SIGTERM, previous)
        self._installed = False

    # --- the notice ---------------------------------------------------------

    def _on_sigterm(self, signum, frame):
        self._restore_handler()
        if not _running(frame, self._fit_code):
            # `fit` is over (it raised, so on_train_end never came).
            self._forward(signum, frame)
            return
        self.noticed.set()
        _say(
            f"SIGTERM on worker {self.task}: every worker saves a backup at the next "
            "agreed step, then stops (a second SIGTERM stops this worker now)."
        )

    def _forward(self, signum, frame):
        previous = signal.getsignal(signal.SIGTERM)
        if callable(previous):
            previous(signum, frame)
        elif previous == signal.SIG_DFL:
            raise SystemExit(EXIT_STATUS)

    def before_step(self, done):
        """At a step boundary with `done` steps completed and the next not begun."""
        if self.target is not None or not self.noticed.is_set() or self._tried_to_lead:
            return
        self._tried_to_lead = True
        step = done + 1
        if self.local:
            self.target, self.leader = step, self.task
            return
        try:
            self._store.insert(self._key("step"), f"{step} {self.task}")
        except tf.errors.AlreadyExistsError:
            return  # another worker leads (or `fit` is ending); the watcher follows
        self.target, self.leader = step, self.task
        self._wait_for_acknowledgements()

    def _wait_for_acknowledgements(self):
        timeout = config.get_timeout()
        missing = []
        for task in range(self.num_workers):
            try:
                self._store.get(self._key(f"ack/{task}"), timeout)
            except tf.errors.OpError:
                missing.append(task)
        if missing:
            self.fail(
                f"worker(s) {missing} did not acknowledge the step to save at within "
                f"{timeout:g} s (keras_comm's collective timeout): stopped or "
                "unreachable. No preemption backup was saved"
            )

    def _watch(self):
        try:
            value = self._store.get(self._key("step"))
            if value == _STOP:
                return
            step, leader = (int(v) for v in value.split())
            if self.target is None:
                self.target, self.leader = step, leader
            self._store.insert(self._key(f"ack/{self.task}"), "1")
        except (tf.errors.OpError, ValueError):
            # The service went away (the job is ending): nothing to agree on.
            return

    def _key(self, name):
        return f"{self._prefix}/{name}"

    def due(self, done):
        """Whether to save now, with `done` steps completed."""
        return self.target is not None and done >= self.target

    def stop(self, message):
        """Stops this worker after the preemption backup; `message` says what was saved.

        As the SIGTERM handler that was installed before `fit` would stop it
        (keras-comm-run's: `SystemExit(143)`, cleanup, a prompt exit), else
        with `Preempted` (a `SystemExit(143)`).
        """
        self.close()
        _say(message)
        previous = self._previous
        if callable(previous) and previous != self._on_sigterm:
            previous(signal.SIGTERM, sys._getframe())
        raise Preempted(EXIT_STATUS)

    def fail(self, why):
        """Stops this worker when no backup could be agreed on or saved."""
        self.stop(f"{why}; stopping (exit status {EXIT_STATUS}).")


@atexit.register
def _close_open_watches():
    for watch in list(_open_watches):
        watch.close()


def _num_workers(resolver):
    if resolver is None:
        return 1
    try:
        spec = resolver.cluster_spec()
    except (ValueError, RuntimeError):
        return 1
    return sum(spec.num_tasks(job) for job in spec.jobs if job in ("chief", "worker")) or 1


def _running(frame, code):
    """Whether `code` (the running fit's) is on the stack below `frame`."""
    if code is None:
        return True
    while frame is not None:
        if frame.f_code is code:
            return True
        frame = frame.f_back
    return False


def _say(text):
    print(f"keras_comm.callbacks.BackupAndRestore: {text}", file=sys.stderr, flush=True)
