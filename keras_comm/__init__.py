"""keras_comm: explicit distributed-training communication for Keras 3 on TensorFlow.

Collectives are Keras layers (`keras_comm.layers`) and differentiable
functions (`keras_comm.ops`) with exact backward rules, running on
`tf.distribute.MultiWorkerMirroredStrategy` collectives.
"""

from keras_comm.config import communication_options
from keras_comm.config import get_check_calls
from keras_comm.config import get_timeout
from keras_comm.config import set_check_calls
from keras_comm.config import set_timeout
from keras_comm.topology import Group
from keras_comm.topology import rank
from keras_comm.topology import world_size

from keras_comm import compat as _compat; _compat.apply()  # noqa: E702  Keras 3 x MWMS fix: see compat.py
from keras_comm import errors  # noqa: E402
from keras_comm import callbacks  # noqa: E402  (after compat: uses its fixed trainer)
from keras_comm import parallel  # noqa: E402  (after compat: its optimizer hook)

__version__ = "0.1.0"

__all__ = [
    "Group",
    "callbacks",
    "communication_options",
    "errors",
    "get_check_calls",
    "get_timeout",
    "parallel",
    "rank",
    "set_check_calls",
    "set_timeout",
    "world_size",
]
