"""Keras layers wrapping keras_comm's collectives."""

from keras_comm.layers.all_reduce import AllReduce
from keras_comm.layers.mirror import MicroStepAllGather
from keras_comm.layers.mirror import MiniStepAllGather
from keras_comm.layers.mirror import MirrorMicroStepOperator
from keras_comm.layers.mirror import MirrorMiniStepOperator
from keras_comm.layers.mirror import MirrorOperator
from keras_comm.layers.virtual import GetTensorSlice
from keras_comm.layers.virtual import VirtualAccuGrad
from keras_comm.layers.virtual import VirtualAdd
from keras_comm.layers.virtual import VirtualAssignAdd
from keras_comm.layers.virtual import VirtualDiv

__all__ = [
    "AllReduce",
    "GetTensorSlice",
    "MicroStepAllGather",
    "MiniStepAllGather",
    "MirrorMicroStepOperator",
    "MirrorMiniStepOperator",
    "MirrorOperator",
    "VirtualAccuGrad",
    "VirtualAdd",
    "VirtualAssignAdd",
    "VirtualDiv",
]
