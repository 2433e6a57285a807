"""One watchdog thread per process enforces keras_comm's collective timeout.

TensorFlow implements a collective's ``timeout`` by starting threads that
sleep for the whole timeout: two per collective call, alive whether the call
finished in a millisecond or not (measured on TF 2.21; TensorFlow's
``CommunicationOptions`` says the timeout "should only be used for debugging
since it creates a new thread for each collective"). With a timeout on every
collective that is ``2 x collectives per second x timeout`` threads: 200
steps of one all-reduce on 2 replicas leave 800 threads behind, and a
training loop soon exhausts the process's threads and aborts.

So keras_comm enforces its default timeout on *host calls* instead:
`guard` watches a call that runs collectives (`model.fit`'s, `evaluate`'s
and `predict`'s compiled steps, every eager keras_comm collective, or a step
you wrap yourself). If the call has not returned `keras_comm.get_timeout()`
seconds after it started (after tracing, for a compiled step), the watchdog
aborts every collective of the process with a ``DeadlineExceededError``
naming the call and the keras_comm layers traced in it -- as TensorFlow's own
timeout would, since that aborts every later collective too.

Which timeout a keras_comm collective gets:

* traced or run inside a guard, layer without ``timeout=``: none of its own
  (no threads); the guard's deadline covers it;
* a layer with an explicit ``timeout=``: always TensorFlow's per-op
  timeout, in or out of a guard;
* outside any guard (a `tf.function` you call yourself): TensorFlow's
  per-op timeout, with its threads. Wrap such steps in `guard` -- every call,
  since the choice is made when the function is traced (a function traced
  in a guard and called outside one warns once: it has no timeout then).

Example:

```python
step = tf.function(lambda: strategy.run(replica_step))
for _ in range(steps):
    with keras_comm.watchdog.guard("custom train step"):
        step()
```
"""

import contextlib
import sys
import threading
import time
import traceback
import warnings

import tensorflow as tf

from keras_comm import config
from keras_comm import errors
from keras_comm._private import tf_api

_MAX_NAMED = 8

_cv = threading.Condition()
_entries = {}  # key -> _Entry
_thread = None
_active = 0
_warned_unguarded = False


class Site:
    """A recurring host call under the watchdog (e.g. one compiled step).

    Keeps the keras_comm collectives traced while it ran, so a timeout can
    name them on later calls too.

    Args:
        what: how an error names the call, e.g. "the model.fit train step".
    """

    def __init__(self, what):
        self.what = what
        self.infos = []


class _Entry:
    __slots__ = ("site", "seconds", "deadline", "fired")

    def __init__(self, site, seconds):
        self.site = site
        self.seconds = seconds
        self.deadline = time.monotonic() + seconds
        self.fired = False


def covers():
    """True while a guard is open (collectives then take no TF timeout)."""
    return _active > 0


@tf.autograph.experimental.do_not_convert
def check_guarded():
    """Warns (once) when a function traced under a guard is called outside one.

    Runs at every call of a compiled function, for each collective that was
    traced without a TensorFlow timeout.
    """
    global _warned_unguarded
    if _active == 0 and not _warned_unguarded:
        _warned_unguarded = True
        warnings.warn(
            "keras_comm: a compiled function whose keras_comm collectives were "
            "traced inside keras_comm.watchdog.guard (model.fit's steps, or "
            "your own) is called outside any guard: those collectives have no "
            "timeout and would wait forever for a missing peer. Call it inside "
            "keras_comm.watchdog.guard(...) every time.",
            RuntimeWarning,
            stacklevel=2,
        )


def note(info):
    """Adds a traced collective's `CollectiveInfo` to the open guards' sites."""
    with _cv:
        for entry in _entries.values():
            infos = entry.site.infos
            if info not in infos and len(infos) < 4 * _MAX_NAMED:
                infos.append(info)


def restart():
    """Restarts the open guards' clocks (called when a step finishes tracing)."""
    with _cv:
        now = time.monotonic()
        for entry in _entries.values():
            entry.deadline = now + entry.seconds
        _cv.notify_all()


@contextlib.contextmanager
def guard(site, timeout=None):
    """Watches the enclosed host call; aborts the process's collectives if it hangs.

    Args:
        site: a `Site`, or a string naming the call.
        timeout: seconds; None for `keras_comm.get_timeout()` (read on entry).

    Yields:
        The `Site`.
    """
    global _active
    if not isinstance(site, Site):
        site = Site(str(site))
    seconds = config.get_timeout() if timeout is None else config.validate_timeout(timeout)
    key = object()
    with _cv:
        _ensure_thread()
        _entries[key] = _Entry(site, seconds)
        _active += 1
        _cv.notify_all()
    try:
        yield site
    except tf.errors.OpError as e:
        with _cv:
            fired = _entries[key].fired
        if not fired or (e.message or "").startswith(errors._MARK):
            raise
        # TF reports the abort inside its own text; lead with ours.
        text = f"{message(site, seconds)}\nTensorFlow's error: {e.message}"
        raise type(e)(e.node_def, e.op, text) from e
    finally:
        with _cv:
            del _entries[key]
            _active -= 1


def _ensure_thread():
    global _thread
    if _thread is None or not _thread.is_alive():
        _thread = threading.Thread(target=_watch, name="keras_comm_watchdog", daemon=True)
        _thread.start()


def _watch():
    while True:
        with _cv:
            now = time.monotonic()
            due = [e for e in _entries.values() if not e.fired and e.deadline <= now]
            if not due:
                pending = [e.deadline for e in _entries.values() if not e.fired]
                _cv.wait(None if not pending else max(min(pending) - now, 0.01))
                continue
            for entry in due:
                entry.fired = True
        _abort(due[0])


def message(site, seconds):
    """The error text of a watchdog timeout of `site`."""
    infos = site.infos[:_MAX_NAMED]
    if infos:
        named = "; ".join(i.describe() for i in infos)
        if len(site.infos) > _MAX_NAMED:
            named += f"; and {len(site.infos) - _MAX_NAMED} more"
        inside = f" Its keras_comm collectives: {named}."
    else:
        inside = ""
    return (
        f"{errors._MARK}{site.what} did not finish within {seconds:g} s "
        f"(keras_comm's collective timeout): {errors.TIMEOUT_ADVICE}{inside} "
        f"{errors.RESTART_ADVICE}"
    )


def _abort(entry):
    text = message(entry.site, entry.seconds)
    # Where the host was when the deadline passed: which call the main
    # thread waited in, and what any other thread (a callback's, an input
    # pipeline's) was doing. Written before the abort, which may wake them.
    sys.stderr.write(f"{text}\n{thread_stacks()}")
    sys.stderr.flush()
    tf_api.abort_collective_ops(tf.errors.DEADLINE_EXCEEDED, text)


def thread_stacks():
    """Every Python thread's stack, as text (the watchdog's own left out)."""
    names = {t.ident: t.name for t in threading.enumerate()}
    me = threading.get_ident()
    parts = []
    for ident, frame in sys._current_frames().items():
        if ident != me:
            stack = "".join(traceback.format_stack(frame))
            parts.append(f"keras_comm: thread {names.get(ident, ident)!r} at the timeout:\n{stack}")
    return "".join(parts)
