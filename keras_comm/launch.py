"""The launcher under its historical name: `keras_comm_run` re-exported.

The launcher lives in the top-level, standard-library-only package
`keras_comm_run`, so that `keras-comm-run` starts without importing
TensorFlow (importing anything inside `keras_comm` imports the package, and
with it TensorFlow). Everything importable from here before still is.

`python -m keras_comm.launch` and `python keras_comm/launch.py` still run the
command line; the first pays for importing keras_comm (and TensorFlow) first,
so prefer `keras-comm-run` or `python -m keras_comm_run`.
"""

import os
import sys

if __name__ == "__main__" and __package__ in (None, ""):
    # `python keras_comm/launch.py` from a source tree: the launcher package
    # sits beside keras_comm/, which is not on sys.path when run as a file.
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from keras_comm_run import EXIT_TIMEOUT  # noqa: E402
from keras_comm_run import EXIT_USAGE  # noqa: E402
from keras_comm_run import PROG  # noqa: E402
from keras_comm_run import LaunchError  # noqa: E402
from keras_comm_run import main  # noqa: E402
from keras_comm_run import pick_ports  # noqa: E402
from keras_comm_run import run  # noqa: E402
from keras_comm_run import tf_config  # noqa: E402
from keras_comm_run import validate_tf_config  # noqa: E402
from keras_comm_run import worker_env  # noqa: E402
from keras_comm_run.cluster import check_host as _check_host  # noqa: E402,F401  (old private name)

__all__ = [
    "EXIT_TIMEOUT",
    "EXIT_USAGE",
    "LaunchError",
    "PROG",
    "main",
    "pick_ports",
    "run",
    "tf_config",
    "validate_tf_config",
    "worker_env",
]

if __name__ == "__main__":
    sys.exit(main())
