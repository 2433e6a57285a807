"""Every keras_comm layer stands on the one base and serializes exactly its arguments."""

import inspect

import keras
import pytest

from keras_comm import layers
from keras_comm import parallel
from keras_comm.layers._base import CollectiveLayer

# The smallest valid constructor arguments of each public layer.
REQUIRED = {
    "AlltoAll": dict(split_count=1, split_dim=0, concat_dim=0),
    "MirrorMiniStepOperator": dict(accumulation_steps=2),
    "NeighborExchange": dict(send_ranks=[[None]], recv_ranks=[[None]], recv_shapes=[(2,)], send_shapes=[(2,)]),
    "HaloExchange": dict(
        send_rank_ids=[[-1] * 8], send_lens=[0, 0, 0, 0], recv_rank_ids=[[-1] * 8], recv_lens=[0, 0, 0, 0]
    ),
    "Receive": dict(src=0, shape=(2,)),
    "Send": dict(dest=0),
    "VirtualDiv": dict(divisor=2),
    "ColumnParallelDense": dict(units=2),
    "RowParallelDense": dict(units=2),
    "ParallelEmbedding": dict(input_dim=4, output_dim=2),
    "MixtureOfExperts": dict(num_experts=2, units=2),
    "PipelineStage": dict(first=keras.layers.Dense(2), second=keras.layers.Dense(2)),
    "Pipeline": dict(stages=[keras.layers.Dense(2), keras.layers.Dense(2)]),
}

CLASSES = [getattr(layers, n) for n in layers.__all__] + [
    parallel.ColumnParallelDense,
    parallel.RowParallelDense,
    parallel.ParallelEmbedding,
    parallel.MixtureOfExperts,
    parallel.PipelineStage,
    parallel.Pipeline,
]


@pytest.mark.parametrize("cls", CLASSES, ids=lambda c: c.__name__)
def test_one_base_and_config_is_the_constructor_arguments(cls):
    assert issubclass(cls, CollectiveLayer)
    layer = cls(**REQUIRED.get(cls.__name__, {}))
    # A layer without a constructor of its own takes no arguments of its own.
    init = cls.__init__ if cls.__init__ is not CollectiveLayer.__init__ else (lambda self: None)
    arguments = {
        name
        for name, p in inspect.signature(init).parameters.items()
        if name != "self" and p.kind is not p.VAR_KEYWORD
    }
    config = layer.get_config()
    # name, trainable and dtype are Keras's own (Receive's `dtype` is Keras's too).
    assert set(config) - {"name", "trainable", "dtype"} == arguments - {"dtype"}
    assert cls.from_config(config).get_config() == config


def test_a_layer_refuses_group_or_timeout_it_does_not_take():
    with pytest.raises(TypeError, match="VirtualAdd takes no `group` argument. Received: group=\\[0\\]"):
        layers.VirtualAdd(group=[0])
    with pytest.raises(TypeError, match="Send takes no `group` argument"):
        layers.Send(dest=0, group=[0])
    with pytest.raises(TypeError, match="VirtualDiv takes no `timeout` argument"):
        layers.VirtualDiv(2, timeout=3)
