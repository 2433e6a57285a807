"""Collective failures in the user's words: which layer, which group, why.

TensorFlow reports a stuck or mismatched collective with its own vocabulary
("Collective has timed out during execution. [[{{node
functional_1/my_allreduce_1/my_allreduce_all_reduce}}]]", or in eager mode
only "Exception encountered when calling AllReduce.call()"). This module turns
such errors into messages that name the keras_comm layer, the collective, the
group of ranks and the timeout, and say what to do:

* in **eager** execution keras_comm translates errors itself, where the
  collective runs;
* the steps keras_comm compiles (`model.fit`, `evaluate` and `predict`
  under MultiWorkerMirroredStrategy, `ParallelOptimizer`'s; see
  `keras_comm.training.step`) translate their errors too;
* around other **compiled** functions (your own `tf.function`, Keras's
  steps under other strategies), TensorFlow raises from the function call.
  Wrap the call with `collective_errors()` (a context manager and
  decorator), or pass `CollectiveErrors()` to `model.fit(callbacks=...)`.

Translated errors keep TensorFlow's exception class (`except
tf.errors.DeadlineExceededError` still works) and chain the original.

Every keras_comm collective records, when traced, the op name TensorFlow
will report (``<layer name>_<collective>``) with its layer, group and timeout,
so the translation works from the op name alone.

Example:

```python
keras_comm.set_timeout(60)
with keras_comm.errors.collective_errors():
    model.fit(dataset, epochs=3)
# or: model.fit(dataset, epochs=3, callbacks=[keras_comm.errors.CollectiveErrors()])
```
"""

import contextlib
import dataclasses
import re
import threading

import keras
import tensorflow as tf

_MARK = "keras_comm: "

_lock = threading.Lock()
_ops = {}


@dataclasses.dataclass(frozen=True)
class CollectiveInfo:
    """What keras_comm knows about one traced collective.

    Attributes:
        op_name: the TF op (or name scope) name, ``<layer>_<kind>``.
        layer: the layer (or ops-function) name, or None.
        kind: "all_reduce", "all_gather", "all_to_all", "reduce_scatter",
            "broadcast", "send", "recv" or "check" (the checked-mode
            fingerprint exchange).
        group: the global ranks of the group, ascending.
        timeout: seconds.
        rank: the global rank that traced it, or None if several did.
    """

    op_name: str
    layer: object
    kind: str
    group: tuple
    timeout: float
    rank: object = None

    def describe(self):
        who = f"layer {self.layer!r}" if self.layer else "an unnamed keras_comm op"
        rank = "" if self.rank is None else f", seen on rank {self.rank}"
        return (
            f"{who} ({self.kind} over group {list(self.group)}, "
            f"timeout {self.timeout:g} s{rank})"
        )


def record(info):
    """Remembers `info` under its op name (called by the primitive tier)."""
    with _lock:
        old = _ops.get(info.op_name)
        if old is not None and old.rank != info.rank:
            # Several local replicas traced it: the rank is not known.
            info = dataclasses.replace(info, rank=None)
        _ops[info.op_name] = info


def lookup(op_name):
    """The `CollectiveInfo` recorded under `op_name`, or None."""
    with _lock:
        return _ops.get(op_name)


_NODE = re.compile(r"\{\{node ([^}]+)\}\}")
_UNIQUIFIED = re.compile(r"_\d+$")


def find(message):
    """The collectives a TensorFlow error message names, in order."""
    found = []
    for node in _NODE.findall(message):
        # A node path is scopes/op; keras_comm's name is the op (token-ordered
        # collectives) or a scope (broadcast, send, recv). TF may add `_1`.
        for part in reversed(node.split("/")):
            info = lookup(part) or lookup(_UNIQUIFIED.sub("", part))
            if info is not None:
                if info not in found:
                    found.append(info)
                break
    return found


TIMEOUT_ADVICE = (
    "timed out: a peer did not reach the same collective in time. It "
    "stopped, crashed, is much slower, or runs different code (another "
    "layer order, a skipped step). If the peers are only slow, raise "
    "keras_comm.set_timeout() or the layer's `timeout=`."
)
RESTART_ADVICE = (
    "TensorFlow aborts every later collective in this process after such an "
    "error: restart the job."
)


def _advice(error):
    if isinstance(error, tf.errors.DeadlineExceededError):
        return TIMEOUT_ADVICE
    if isinstance(error, (tf.errors.InvalidArgumentError, tf.errors.InternalError)):
        return (
            "the ranks of the group called collectives that do not match "
            "(different shapes, dtypes or collectives in the same position). "
            "keras_comm.set_check_calls(True) on every worker names both sides."
        )
    if isinstance(error, (tf.errors.UnavailableError, tf.errors.AbortedError,
                          tf.errors.CancelledError)):
        return "failed: a peer became unreachable or the collective was aborted."
    return "failed."


def translate(error, info=None):
    """Returns `error` with a message naming the keras_comm collective.

    Args:
        error: any exception. Only `tf.errors.OpError`s from (or naming) a
            keras_comm collective are translated; anything else, and errors
            already translated, are returned unchanged.
        info: the `CollectiveInfo` of the failing collective when known
            (eager execution); else it is found from the node names in the
            message.

    Returns:
        An exception of the same class as `error`. Raise it ``from error``.
    """
    if not isinstance(error, tf.errors.OpError):
        return error
    message = error.message or ""
    if message.startswith(_MARK) or f"aborted by: {_MARK}" in message:
        return error  # ours already (or keras_comm.watchdog's abort)
    infos = [info] if info is not None else find(message)
    if infos:
        what = "; ".join(i.describe() for i in infos)
    elif "ollective" in message:
        what = (
            "TensorFlow's own (not a keras_comm layer: e.g. the strategy's "
            "gradient or metric all-reduce; its timeout is the strategy's "
            "CommunicationOptions, see keras_comm.communication_options())"
        )
    else:
        return error
    text = (
        f"{_MARK}collective of {what} {_advice(error)} {RESTART_ADVICE}"
        f"\nTensorFlow's error: {message}"
    )
    new = type(error)(error.node_def, error.op, text)
    return new


@contextlib.contextmanager
def _translating(info=None):
    try:
        yield
    except tf.errors.OpError as e:
        new = translate(e, info)
        if new is e:
            raise
        raise new from e


class collective_errors(contextlib.ContextDecorator):  # noqa: N801 (reads like a function)
    """Context manager and decorator: translate collective errors raised inside.

    Example:

    ```python
    with keras_comm.errors.collective_errors():
        model.fit(dataset)

    @keras_comm.errors.collective_errors()
    def train_step(): ...
    ```
    """

    def __enter__(self):
        return self

    def __exit__(self, exc_type, exc, tb):
        if isinstance(exc, tf.errors.OpError):
            new = translate(exc)
            if new is not exc:
                raise new from exc
        return False


_WRAPPED = ("train_function", "test_function", "predict_function")


class CollectiveErrors(keras.callbacks.Callback):
    """`model.fit`/`evaluate`/`predict` callback: translate collective errors.

    Wraps the model's compiled step functions for the duration of the call,
    so an error raised by a keras_comm collective names its layer and group.
    The steps keras_comm compiles already translate (see
    `keras_comm.training.step`); this covers the others (`predict`, and
    strategies whose steps Keras compiles), and translating twice changes
    nothing.
    """

    def _wrap(self):
        for attr in _WRAPPED:
            fn = getattr(self.model, attr, None)
            if fn is None or getattr(fn, "_keras_comm_wrapped", False):
                continue

            def wrapped(*args, _fn=fn, **kwargs):
                with collective_errors():
                    return _fn(*args, **kwargs)

            wrapped._keras_comm_wrapped = True
            wrapped._keras_comm_original = fn
            setattr(self.model, attr, wrapped)

    def _unwrap(self):
        for attr in _WRAPPED:
            fn = getattr(self.model, attr, None)
            if getattr(fn, "_keras_comm_wrapped", False):
                setattr(self.model, attr, fn._keras_comm_original)

    def on_train_begin(self, logs=None):
        self._wrap()

    def on_test_begin(self, logs=None):
        self._wrap()

    def on_predict_begin(self, logs=None):
        self._wrap()

    def on_train_end(self, logs=None):
        self._unwrap()

    def on_test_end(self, logs=None):
        # evaluate() inside fit (validation) must not unwrap fit's function.
        fn = getattr(self.model, "test_function", None)
        if getattr(fn, "_keras_comm_wrapped", False):
            self.model.test_function = fn._keras_comm_original

    def on_predict_end(self, logs=None):
        fn = getattr(self.model, "predict_function", None)
        if getattr(fn, "_keras_comm_wrapped", False):
            self.model.predict_function = fn._keras_comm_original


# --- checked mode: call fingerprints ---------------------------------------

MAX_DIMS = 6
_FIELDS = 4  # op hash, dtype enum, ndims, global rank
FINGERPRINT_SIZE = _FIELDS + MAX_DIMS

_fingerprints = {}


def remember_fingerprint(op_hash, text):
    """Records the text of a call fingerprint, to name the other side."""
    with _lock:
        _fingerprints[int(op_hash)] = text


def describe_fingerprint(row):
    """Human text for one gathered fingerprint row."""
    op_hash, dtype_enum, ndims, rank = (int(v) for v in row[:_FIELDS])
    with _lock:
        op = _fingerprints.get(op_hash, f"an op unknown here (id {op_hash:#x})")
    try:
        dtype = tf.dtypes.as_dtype(dtype_enum).name
    except (TypeError, ValueError):
        dtype = f"dtype#{dtype_enum}"
    dims = [int(d) for d in row[_FIELDS:_FIELDS + min(ndims, MAX_DIMS)]]
    shape = str(dims) if ndims <= MAX_DIMS else f"{dims[:-1] + ['...']} (rank {ndims})"
    return f"rank {rank}: {op}, {dtype}{shape}"


def mismatch_message(rows, my_row_index):
    """The (one-line) error text for gathered fingerprints that disagree."""
    mine = rows[my_row_index]
    sides = " | ".join(describe_fingerprint(r) for r in rows)
    return (
        f"{_MARK}ranks called mismatched collectives (checked mode, seen by rank "
        f"{int(mine[3])}): {sides}. Every rank must call the same keras_comm "
        "layers in the same order with the same dtypes and shapes."
    )
