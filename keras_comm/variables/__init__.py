"""What keras_comm knows about a variable, and how variables travel packed.

The tier below `keras_comm.layers` and `keras_comm.parallel` that both the
parallel layers (which declare how their weights are split and reduced) and
the training step (which honours those declarations) read:

* `annotations`: per-variable declarations -- the shard spec, the gradient
  hook, the data group, "kept per replica", the composite weights that stand
  for several full weights, and optimizers whose slots live elsewhere;
* `packing`: flat shards (shard size, padding, member-major pack and
  unpack) and the concatenation that fuses several tensors into one
  collective.

Neither module communicates; they import TensorFlow, Keras and
`keras_comm._private` only.
"""

from keras_comm.variables import annotations
from keras_comm.variables import packing

__all__ = ["annotations", "packing"]
