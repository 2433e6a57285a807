"""Keras layers wrapping keras_comm's collectives."""

from keras_comm.layers.all_reduce import AllReduce

__all__ = [
    "AllReduce",
]
