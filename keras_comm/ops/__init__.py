"""Differentiable collectives (no Keras): forward plus an exact backward."""

from keras_comm.ops._fusion import fusion_scope
from keras_comm.ops.all_reduce import all_reduce
from keras_comm.ops.all_swap import all_swap
from keras_comm.ops.all_to_all import all_to_all
from keras_comm.ops.broadcast import broadcast
from keras_comm.ops.broadcast import reduce
from keras_comm.ops.gather_scatter import all_gather
from keras_comm.ops.gather_scatter import collective_gather
from keras_comm.ops.gather_scatter import collective_scatter
from keras_comm.ops.gather_scatter import reduce_scatter
from keras_comm.ops.host import host_all_gather
from keras_comm.ops.host import host_reduce_scatter
from keras_comm.ops.local_norm import local_norms
from keras_comm.ops.mirror import micro_step_all_gather
from keras_comm.ops.mirror import mini_step_all_gather
from keras_comm.ops.mirror import mirror_micro_step_operator
from keras_comm.ops.mirror import mirror_mini_step_operator
from keras_comm.ops.mirror import mirror_operator
from keras_comm.ops.neighbor import halo_exchange
from keras_comm.ops.neighbor import halo_rank_ids
from keras_comm.ops.neighbor import neighbor_exchange
from keras_comm.ops.neighbor import neighbor_exchange_v2
from keras_comm.ops.point_to_point import receive
from keras_comm.ops.point_to_point import send
from keras_comm.ops.reduce_op import ReduceOp
from keras_comm.ops.virtual import get_tensor_slice
from keras_comm.ops.virtual import virtual_accu_grad
from keras_comm.ops.virtual import virtual_add
from keras_comm.ops.virtual import virtual_assign_add
from keras_comm.ops.virtual import virtual_div

__all__ = [
    "ReduceOp",
    "all_gather",
    "all_reduce",
    "all_swap",
    "all_to_all",
    "broadcast",
    "collective_gather",
    "collective_scatter",
    "fusion_scope",
    "get_tensor_slice",
    "halo_exchange",
    "halo_rank_ids",
    "host_all_gather",
    "host_reduce_scatter",
    "local_norms",
    "micro_step_all_gather",
    "mini_step_all_gather",
    "mirror_micro_step_operator",
    "mirror_mini_step_operator",
    "mirror_operator",
    "neighbor_exchange",
    "neighbor_exchange_v2",
    "receive",
    "reduce",
    "reduce_scatter",
    "send",
    "virtual_accu_grad",
    "virtual_add",
    "virtual_assign_add",
    "virtual_div",
]
