"""Keras's distribution API (`keras.distribution`) on TensorFlow, across workers.

With keras_comm imported, a model built inside both
`tf.distribute.MultiWorkerMirroredStrategy().scope()` and a
`keras.distribution.ModelParallel(layout_map=...).scope()` stores every
weight its layout map splits as this replica's block only: the weight is
created directly as its block (the full initial value exists once,
transiently, on the host). `fit` on global batches then equals one process
on the same batches; `get_weights` / `set_weights` and saved files hold
full values. See docs/large_models.md.

How a step uses a split weight:

* **split compute** for the kernel of a `Dense` / `EinsumDense` or the
  table of an `Embedding` split over a model axis (any mesh axis but the
  `batch_dim_name`): a column split (an output dimension) or a row split (a
  contracted dimension) runs on this replica's block, as the tensor-parallel
  layers of `keras_comm.parallel` do, exchanging activations within the
  model group; an embedding split by vocabulary looks up the ids in its
  rows. The kernel is never whole. Dimensions split over the batch axis are
  gathered first (FSDP style).
* **gather on use** for every other split weight (biases, normalization
  scales, other layers' weights, a tied output projection): gathered whole
  when a layer reads it, its gradient reduce-scattered back onto the
  blocks.

What keras_comm does with each part of `keras.distribution`:

* `DeviceMesh`: its devices must be the job's replicas in rank order,
  `list_devices()` (one worker: Keras's own `list_devices()` too); a mesh of
  another size raises.
* `LayoutMap` / `TensorLayout`: a dimension named with a mesh axis is split
  over that axis; `None` keeps it whole.
* `ModelParallel(batch_dim_name=...)`: every replica takes its own slice of
  the global batch, whatever the mesh's shape; a split layer hands each
  replica back its own samples' outputs. Weight dimensions split over the
  batch axis are gathered before use.
* `DataParallel`: plain data parallelism; its mesh is checked.
* output layouts (``".../output"`` keys): accepted, no effect.

Any other distribution, a layout naming an axis the mesh lacks, or a
dimension the layout's pieces do not divide raises at build, naming the
weight and the layout.
"""

import contextlib

from keras_comm.distribution._blocks import Blocks
from keras_comm.distribution._mesh import list_devices
from keras_comm.distribution._variable import ShardedVariable
from keras_comm.distribution._variable import is_sharded


@contextlib.contextmanager
def gathered(model_or_layer):
    """Holds every split weight of `model_or_layer` whole while the block runs.

    Reads outside a replica step inside a `tf.function` (KerasHub's
    `generate()`, a custom compiled loop) cannot gather a weight split over
    several workers; inside this context they read the full values gathered
    on entry. Every worker must enter it (entering gathers). The whole
    weights are held until the context exits (FSDP's
    `summon_full_params`); with one worker it is not needed. A function
    traced inside the context keeps the values it read: on exit a KerasHub
    model's compiled `generate` is dropped (traced again on the next call).

    Example:

    ```python
    with keras_comm.distribution.gathered(causal_lm):
        text = causal_lm.generate(prompts, max_length=16)
    ```
    """
    variables = [v for v in model_or_layer.weights if is_sharded(v)]
    for v in variables:
        v._keras_comm_full = None
        v._keras_comm_full = v.full_value()
    try:
        yield
    finally:
        for v in variables:
            v._keras_comm_full = None
        # A function traced inside the context holds the gathered values as
        # constants: KerasHub's compiled `generate` is traced again next time.
        if getattr(model_or_layer, "generate_function", None) is not None:
            model_or_layer.generate_function = None


def install():
    """Makes Keras's TensorFlow variables honour `keras.distribution` (by `compat`)."""
    from keras_comm._private import keras_api
    from keras_comm.distribution import _split
    from keras_comm.distribution import _variable

    keras_api.install_variable_initialization(_variable.initialize)
    keras_api.install_output_relayout()
    keras_api.install_split_compute(_split.call)


def uninstall():
    from keras_comm._private import keras_api

    keras_api.restore_variable_initialization()
    keras_api.restore_split_compute()


__all__ = ["Blocks", "ShardedVariable", "gathered", "is_sharded", "list_devices"]
