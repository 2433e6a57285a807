"""Callbacks for `model.fit`: gradient accumulation, optimizer-state sharding,
and multi-worker backup and restore.

Keras's own `ModelCheckpoint`, `CSVLogger`, `TensorBoard` and
`BackupAndRestore` are adapted to several workers on `import keras_comm`
(`keras_comm.callbacks._keras_callbacks`: the chief writes the real paths).
"""

from keras_comm.callbacks.backup_and_restore import BackupAndRestore
from keras_comm.callbacks.local_norm import LocalNormLogger
from keras_comm.callbacks.parallel_optimizer import ParallelOptimizer
from keras_comm.callbacks.parallel_optimizer import ZeroStage
from keras_comm.callbacks.parallel_optimizer import prepare_checkpoint

__all__ = [
    "BackupAndRestore",
    "LocalNormLogger",
    "ParallelOptimizer",
    "ZeroStage",
    "prepare_checkpoint",
]
