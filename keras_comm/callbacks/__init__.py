"""Callbacks for `model.fit`: gradient accumulation and optimizer-state sharding."""

from keras_comm.callbacks.parallel_optimizer import ParallelOptimizer
from keras_comm.callbacks.parallel_optimizer import ZeroStage

__all__ = ["ParallelOptimizer", "ZeroStage"]
