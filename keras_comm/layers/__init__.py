"""Keras layers wrapping keras_comm's collectives."""

from keras_comm.layers.all_reduce import AllReduce
from keras_comm.layers.all_swap import AllSwap
from keras_comm.layers.all_to_all import AlltoAll
from keras_comm.layers.broadcast import Broadcast
from keras_comm.layers.broadcast import Reduce
from keras_comm.layers.gather_scatter import AllGather
from keras_comm.layers.gather_scatter import CollectiveGather
from keras_comm.layers.gather_scatter import CollectiveScatter
from keras_comm.layers.gather_scatter import ReduceScatter
from keras_comm.layers.host import HostAllGather
from keras_comm.layers.host import HostReduceScatter
from keras_comm.layers.mirror import MicroStepAllGather
from keras_comm.layers.mirror import MiniStepAllGather
from keras_comm.layers.mirror import MirrorMicroStepOperator
from keras_comm.layers.mirror import MirrorMiniStepOperator
from keras_comm.layers.mirror import MirrorOperator
from keras_comm.layers.neighbor import HaloExchange
from keras_comm.layers.neighbor import NeighborExchange
from keras_comm.layers.neighbor import NeighborExchangeV2
from keras_comm.layers.point_to_point import Receive
from keras_comm.layers.point_to_point import Send
from keras_comm.layers.virtual import GetTensorSlice
from keras_comm.layers.virtual import VirtualAccuGrad
from keras_comm.layers.virtual import VirtualAdd
from keras_comm.layers.virtual import VirtualAssignAdd
from keras_comm.layers.virtual import VirtualDiv

__all__ = [
    "AllGather",
    "AllReduce",
    "AllSwap",
    "AlltoAll",
    "Broadcast",
    "CollectiveGather",
    "CollectiveScatter",
    "GetTensorSlice",
    "HaloExchange",
    "HostAllGather",
    "HostReduceScatter",
    "MicroStepAllGather",
    "MiniStepAllGather",
    "MirrorMicroStepOperator",
    "MirrorMiniStepOperator",
    "MirrorOperator",
    "NeighborExchange",
    "NeighborExchangeV2",
    "Receive",
    "Reduce",
    "ReduceScatter",
    "Send",
    "VirtualAccuGrad",
    "VirtualAdd",
    "VirtualAssignAdd",
    "VirtualDiv",
]
