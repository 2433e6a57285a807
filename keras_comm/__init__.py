"""keras_comm: explicit distributed-training communication for Keras 3 on TensorFlow.

Collectives are Keras layers (`keras_comm.layers`) and differentiable
functions (`keras_comm.ops`) with exact backward rules, running on
`tf.distribute.MultiWorkerMirroredStrategy` collectives. Importing the
package also applies `keras_comm.compat`, which makes Keras 3's `model.fit`
work (exactly) under that strategy.

Settings live in `keras_comm.config` (as Keras's do in `keras.config`):
`keras_comm.config.set_timeout(60)`. The same functions are importable from
the package itself (`keras_comm.set_timeout`), the names they had first.
"""

import warnings as _warnings

from keras_comm import compat as _compat

# Before anything that builds on Keras's trainer: the one Keras x MWMS fix.
if not _compat.apply():
    # Not an error: collectives, layers and single-replica use still work;
    # only `fit` under MultiWorkerMirroredStrategy runs stock (broken) Keras.
    _warnings.warn(_compat.unsupported_message(), stacklevel=2)

# AutoGraph calls keras_comm's functions as written, as it does TensorFlow's
# and Keras's, instead of converting each inside every traced function
# (keras_comm._private.tf_api.leave_unconverted_by_autograph says why).
from keras_comm._private import tf_api as _tf_api  # noqa: E402

_tf_api.leave_unconverted_by_autograph("keras_comm")

from keras_comm import callbacks  # noqa: E402
from keras_comm import config  # noqa: E402
from keras_comm import distribution  # noqa: E402
from keras_comm import errors  # noqa: E402
from keras_comm import layers  # noqa: E402
from keras_comm import ops  # noqa: E402
from keras_comm import parallel  # noqa: E402
from keras_comm import watchdog  # noqa: E402
# The settings' first names (see the module docstring).
from keras_comm.config import communication_options  # noqa: E402
from keras_comm.config import get_check_calls  # noqa: E402
from keras_comm.config import get_gradient_bucket_bytes  # noqa: E402
from keras_comm.config import get_timeout  # noqa: E402
from keras_comm.config import set_check_calls  # noqa: E402
from keras_comm.config import set_gradient_bucket_bytes  # noqa: E402
from keras_comm.config import set_timeout  # noqa: E402
from keras_comm.topology import Group  # noqa: E402
from keras_comm.topology import rank  # noqa: E402
from keras_comm.topology import world_size  # noqa: E402

__version__ = "0.1.0"

__all__ = [
    "Group",
    "callbacks",
    "config",
    "distribution",
    "errors",
    "layers",
    "ops",
    "parallel",
    "rank",
    "watchdog",
    "world_size",
]
