"""Package-wide settings.

Only one setting today: the collective timeout. Every keras_comm collective
passes it to TensorFlow, so a peer that never arrives turns into a
``tf.errors.DeadlineExceededError`` instead of a hang.
"""

import math
import threading

_DEFAULT_TIMEOUT_SECONDS = 300.0

_lock = threading.Lock()
_timeout_seconds = _DEFAULT_TIMEOUT_SECONDS


def validate_timeout(timeout, name="timeout"):
    """Returns `timeout` as a float, or raises if it is not a positive number.

    Args:
        timeout: seconds, a finite number > 0.
        name: the argument name to use in the error message.

    Raises:
        TypeError: if `timeout` is not a number.
        ValueError: if `timeout` is not finite and > 0.
    """
    if isinstance(timeout, bool) or not isinstance(timeout, (int, float)):
        raise TypeError(
            f"`{name}` must be a number of seconds. Received: {name}={timeout!r}"
        )
    if not math.isfinite(timeout) or timeout <= 0:
        raise ValueError(
            f"`{name}` must be a finite number of seconds > 0, so that a missing "
            f"peer raises an error instead of hanging. Received: {name}={timeout!r}"
        )
    return float(timeout)


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
