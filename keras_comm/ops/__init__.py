"""Differentiable collectives (no Keras): forward plus an exact backward."""

from keras_comm.ops.all_reduce import all_reduce
from keras_comm.ops.reduce_op import ReduceOp

__all__ = [
    "ReduceOp",
    "all_reduce",
]
