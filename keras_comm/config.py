"""Package-wide settings.

* The collective timeout (`set_timeout`, default 300 s, always finite): a
  peer that never arrives turns into a ``tf.errors.DeadlineExceededError``
  on every waiting rank after at most that long, instead of a hang. Under
  `model.fit`/`evaluate`/`predict` and in eager mode it bounds each step or
  call through one watchdog thread (`keras_comm.watchdog`); in a
  `tf.function` you call yourself it is TensorFlow's per-op timeout, which
  costs threads (wrap such calls in `keras_comm.watchdog.guard`). TensorFlow's own collectives
  (e.g. MWMS's gradient all-reduce in `model.fit`) take theirs from
  ``tf.distribute.experimental.CommunicationOptions(timeout_seconds=...)``.
  After a timeout TensorFlow aborts every later collective of the process:
  the job must restart.
* Checked calls (`set_check_calls`, default off): before each collective the
  members exchange a small fingerprint (op, dtype, shape) and raise an error
  naming both sides when they differ. Off by default because it costs one
  extra small all-gather per collective.

* Gradient buckets (`set_gradient_bucket_bytes`, default 8 MiB; 0: one
  pack): the size of the buckets in which `model.fit`'s optimizer
  all-reduces the gradients, issued last layer first so each can start
  while the backward of earlier layers still runs
  (`keras_comm.training.reduction`).

All are read when the training function (or collective) is traced: set them
the same way on every worker, before building the training function.
"""

__all__ = [
    "communication_options",
    "get_check_calls",
    "get_gradient_bucket_bytes",
    "get_timeout",
    "set_check_calls",
    "set_gradient_bucket_bytes",
    "set_timeout",
]

import threading

from keras_comm import _validation

_DEFAULT_TIMEOUT_SECONDS = 300.0

_lock = threading.Lock()
_timeout_seconds = _DEFAULT_TIMEOUT_SECONDS


# The check lives with the package's other argument checks.
validate_timeout = _validation.timeout


def get_timeout():
    """Returns the default collective timeout in seconds (300 unless changed)."""
    return _timeout_seconds


def set_timeout(seconds):
    """Sets the default timeout, in seconds, of every keras_comm collective.

    Layers built with an explicit ``timeout=`` keep their own value. The value
    is read when a collective is traced, so set it before building the
    training function.

    Args:
        seconds: a finite number > 0.

    Raises:
        TypeError, ValueError: if `seconds` is not a finite positive number.
    """
    global _timeout_seconds
    seconds = validate_timeout(seconds, "seconds")
    with _lock:
        _timeout_seconds = seconds


_check_calls = False


def get_check_calls():
    """Whether collectives check that every member made the same call."""
    return _check_calls


def set_check_calls(enabled):
    """Turns the cross-rank call check on or off (default off).

    When on, each keras_comm collective first all-gathers a fingerprint of
    the call (layer and collective, dtype, shape) over its group; if members
    differ, every member raises ``tf.errors.InvalidArgumentError`` naming each
    rank's call, instead of TensorFlow's partial checks (dtype mismatches and
    two same-shaped collectives swapped go unnoticed there; a shape mismatch
    raises on one rank while the others wait for the timeout). Point-to-point
    send/receive are not checked. Set it the same on every worker, before
    the training function is traced.

    Args:
        enabled: a bool.

    Raises:
        TypeError: if `enabled` is not a bool.
    """
    global _check_calls
    if not isinstance(enabled, bool):
        raise TypeError(f"`enabled` must be a bool. Received: enabled={enabled!r}")
    with _lock:
        _check_calls = enabled


#: The default bucket size; docs/performance.md ("Gradient buckets") compares sizes.
DEFAULT_GRADIENT_BUCKET_BYTES = 8 << 20
_gradient_bucket_bytes = DEFAULT_GRADIENT_BUCKET_BYTES


def get_gradient_bucket_bytes():
    """The gradient bucket size in bytes (default 8 MiB); 0 is one pack."""
    return _gradient_bucket_bytes


def set_gradient_bucket_bytes(nbytes):
    """Splits the optimizer's gradient all-reduce into buckets of `nbytes`.

    With ``nbytes=0`` `model.fit` under MultiWorkerMirroredStrategy sums
    all gradients in one packed all-reduce (upstream's way), which starts
    only once the whole backward has run. With ``nbytes > 0`` (default
    8 MiB: `DEFAULT_GRADIENT_BUCKET_BYTES`) the gradients are grouped in
    reverse variable order (the order backward makes them, as DDP's buckets
    and Horovod's tensor fusion do) into buckets of at least `nbytes` each
    (a larger gradient is a bucket of its own), and each bucket is one
    all-reduce, issued last layer first, that may start as soon as its
    gradients exist. The sums are the same numbers either way: every
    element is summed over the same replicas (on more than 2 replicas the
    ring's chunks, hence the round-off, may differ). A model whose
    gradients total less than `nbytes` gets one bucket: one pack. See
    docs/performance.md ("Gradient buckets") for how bucket sizes compare.

    Variables with their own reduction (`mark_gradient_reduced`, sharded
    weights) are not bucketed. `ParallelOptimizer` has its own buckets.
    Read when the training function is traced: set it the same on every
    worker, before `fit`.

    Args:
        nbytes: an int >= 0; 0 for one pack.

    Raises:
        TypeError: if `nbytes` is not an int.
        ValueError: if `nbytes` is negative.
    """
    global _gradient_bucket_bytes
    if isinstance(nbytes, bool) or not isinstance(nbytes, int):
        raise TypeError(
            "`nbytes` must be an int number of bytes (0 for one pack). "
            f"Received: nbytes={nbytes!r}"
        )
    if nbytes < 0:
        raise ValueError(
            f"`nbytes` must be >= 0 (0 for one pack). Received: nbytes={nbytes!r}"
        )
    with _lock:
        _gradient_bucket_bytes = nbytes


def communication_options(**kwargs):
    """`CommunicationOptions` for the strategy, with keras_comm's timeout.

    Under `model.fit` keras_comm's watchdog bounds each whole step, the
    strategy's own collectives (gradient and metric all-reduces) included.
    In custom loops not wrapped in `keras_comm.watchdog.guard`, TensorFlow's
    collectives wait forever unless the strategy has a timeout too. That is
    TensorFlow's per-op timeout: two threads per collective for the whole
    timeout, fine for a few collectives per second:

    ```python
    keras_comm.set_timeout(120)
    strategy = tf.distribute.MultiWorkerMirroredStrategy(
        communication_options=keras_comm.communication_options())
    ```

    Args:
        **kwargs: other `tf.distribute.experimental.CommunicationOptions`
            arguments (`bytes_per_pack`, `implementation`); `timeout_seconds`
            overrides `get_timeout()`.
    """
    import tensorflow as tf  # Here, not at import: config stays TF-free.

    kwargs.setdefault("timeout_seconds", get_timeout())
    return tf.distribute.experimental.CommunicationOptions(**kwargs)
