"""Split compute: tensor-parallel layouts run on the kernel's block, never whole.

Where a `keras.distribution` layout splits the kernel of a `Dense` /
`EinsumDense` or the table of an `Embedding` over a *model axis* (any mesh
axis but the distribution's `batch_dim_name`), the layer's call runs on this
replica's block, as `keras_comm.parallel`'s tensor-parallel layers do:

* **column split** (a kernel dimension that appears in the output: Dense
  dimension 1, an EinsumDense output letter such as ``n`` in
  ``btd,ndh->btnh``, an embedding's dimension 1): the model group
  all-gathers its samples, each member computes its slice of the output for
  all of them, and an all-to-all gives each member all slices of its own
  samples. Backward: the all-to-all reversed, then the all-gather's
  reduce-scatter.
* **row split** (a contracted kernel dimension: Dense dimension 0, ``d`` in
  ``btd,dnh->btnh``, ``n`` in ``btnh,nhd->btd``): an all-to-all gives each
  member its slice of the contracted input axis for the group's samples;
  each computes partial sums, and a reduce-scatter along the batch sums
  them and gives each member its own samples. Backward: the reduce-scatter's
  all-gather, then the all-to-all reversed.
* **embedding by vocabulary** (dimension 0): the group's ids are
  all-gathered, each member looks up the ids in its rows (zero for the
  others), and a reduce-scatter sums the lookups and gives each member its
  own samples.

The model group is the replicas that differ only in the model axis (the
split dimension's gather group, `Blocks.gather_group`), so every replica
still trains on its own samples. Dimensions split over the batch axis
(KerasHub's maps split ``feedforward_intermediate_dense`` as
``("batch", "model")``) are all-gathered first, FSDP style, and the compute
is split over the model axis with the gathered block. The bias and the
activation follow as in Keras's own `call` (a split bias is gathered on use:
it is one row).

The kernel block's gradient reaches the storage as the gather path's does:
summed over the model group by the collectives' adjoints, over the batch-axis
gathers by their reduce-scatters, and over the data group by the storage's
gradient hook (`_variable._reduce_gradient`).

A layer keeps gather on use (`ShardedVariable.full_value`) when: it is read
outside a replica step; its kernel is not split over a model axis, or over
two of them, or one dimension mixes the batch axis with another; the split
dimension is neither a column nor a row (an EinsumDense letter in the input,
kernel and output alike); the equation's first axis is not the batch of both
input and output; or the layer has LoRA or is quantized.
"""

import keras
import tensorflow as tf

from keras_comm import ops
from keras_comm._private import keras_api
from keras_comm._private import tf_api
from keras_comm.distribution import _variable
from keras_comm.parallel import _collectives

COLUMN = "column"
ROW = "row"
VOCABULARY = "vocabulary"

#: Switched off, every split weight is gathered on use (for comparisons).
enabled = True


def _axis(spec, letter):
    """The axis of `letter` in an einsum operand spec (negative after "...")."""
    if "..." in spec:
        before, after = spec.split("...")
        if letter in before:
            return before.index(letter)
        return after.index(letter) - len(after)
    return spec.index(letter)


def einsum_roles(equation, kernel_rank):
    """Per kernel dimension: ``(COLUMN, output axis)``, ``(ROW, input axis)`` or None.

    Pure: parses an `EinsumDense` equation ``"input,kernel->output"``. Every
    role is None when the input's and output's first axis are not the same
    batch axis (a letter outside the kernel, or both "...").
    """
    inputs, rest = equation.replace(" ", "").split(",")
    kernel, output = rest.split("->")
    none = [None] * kernel_rank
    if len(kernel) != kernel_rank or "..." in kernel:
        return none
    if inputs.startswith("..."):
        if not output.startswith("..."):
            return none
    elif not (inputs and output and inputs[0] == output[0] and inputs[0] not in kernel):
        return none
    roles = []
    for letter in kernel:
        if letter in output and letter not in inputs:
            roles.append((COLUMN, _axis(output, letter)))
        elif letter in inputs and letter not in output:
            roles.append((ROW, _axis(inputs, letter)))
        else:
            roles.append(None)
    return roles


def _roles(kind, layer, variable):
    if kind == "dense":
        return [(ROW, -1), (COLUMN, -1)]
    if kind == "embedding":
        return [(VOCABULARY, None), (COLUMN, -1)]
    return einsum_roles(layer.equation, len(variable.shape))


def split_dimension(blocks, roles, batch_axis):
    """The kernel dimension whose split the compute follows, and its role, or None.

    Pure. Exactly one dimension must be split over model axes (axes other
    than `batch_axis`) and have a role; every other split dimension must be
    split over `batch_axis` alone (gathered first).
    """
    model_dims = []
    for dim, axes in enumerate(blocks.dim_axes):
        if blocks.pieces(dim) == 1:
            continue
        if batch_axis in axes:
            if tuple(axes) != (batch_axis,):
                return None
            continue
        model_dims.append(dim)
    if len(model_dims) != 1 or roles[model_dims[0]] is None:
        return None
    return model_dims[0], roles[model_dims[0]]


def plan(kind, layer):
    """``(variable, dimension, role)`` if `layer`'s call can be split, else None."""
    variable = keras_api.plain_kernel(layer, kind)
    if not _variable.is_sharded(variable):
        return None
    cached = getattr(layer, "_keras_comm_split_plan", None)
    if cached is not None and cached[0] is variable:
        return cached[1]
    roles = _roles(kind, layer, variable)
    found = split_dimension(variable.blocks, roles, variable.batch_axis)
    out = None if found is None else (variable, found[0], found[1])
    layer._keras_comm_split_plan = (variable, out)
    return out


def _in_step():
    return (
        _variable._in_replica_step()
        and not keras_api.in_symbolic_scope()
        and not keras_api.in_stateless_scope()
        and not tf_api.in_update_context()
    )


def call(kind, layer, inputs):
    """The hook `keras_api.install_split_compute` runs: the output, or None."""
    if not enabled or not _in_step():
        return None
    found = plan(kind, layer)
    if found is None:
        return None
    variable, dim, (role, axis) = found
    block, group = _local_block(variable, dim)
    if kind == "embedding":
        return _embedding(layer, variable, inputs, block, group, role)
    if kind == "dense":
        compute = keras.ops.matmul
    else:
        def compute(x, kernel):
            return keras.ops.einsum(layer.equation, x, kernel)
    inputs = tf.convert_to_tensor(inputs)
    name = variable.path
    if role == COLUMN:
        x = _collectives.gather_batch(inputs, group, f"{name}_inputs", None)
        y = compute(x, block)
        y = ops.all_to_all(y, group.size, 0, axis, group=group, name=f"{name}_outputs")
    else:
        x = ops.all_to_all(inputs, group.size, axis, 0, group=group, name=f"{name}_inputs")
        y = compute(x, block)
        y = _collectives.scatter_batch_sum(y, group, f"{name}_outputs", None)
    if layer.bias is not None:
        y = keras.ops.add(y, layer.bias)
    if layer.activation is not None:
        y = layer.activation(y)
    return y


def _local_block(variable, model_dim):
    """This replica's block with the batch-axis dimensions gathered, and the model group."""
    blocks = variable.blocks
    rank = _collectives.my_rank()
    block = keras_api.autocast(variable, tf.convert_to_tensor(variable.value))
    shape = list(blocks.block_shape)
    for dim in range(len(blocks.full_shape)):
        if dim != model_dim and blocks.pieces(dim) > 1:
            block = _collectives.gather_along(
                block, dim, blocks.gather_group(dim, rank), name=f"{variable.path}_gather"
            )
            shape[dim] = blocks.full_shape[dim]
            block = tf.ensure_shape(block, shape)
    return tf.ensure_shape(block, shape), blocks.gather_group(model_dim, rank)


@tf.custom_gradient
def _dense_gradient(table):
    """Identity. Backward: the gradient as a dense tensor.

    A lookup's gradient is sparse (a row per id); the block's storage takes
    a dense one, as a gathered table's does.
    """

    def grad(dy):
        return tf.convert_to_tensor(dy)

    return tf.identity(table), grad


def _embedding(layer, variable, inputs, table, group, role):
    ids = tf.convert_to_tensor(inputs)
    if ids.dtype not in (tf.int32, tf.int64):
        ids = tf.cast(ids, tf.int32)
    name = variable.path
    table = _dense_gradient(table)
    ids = _collectives.gather_batch(ids, group, f"{name}_ids", None)
    if role == COLUMN:
        out = tf.gather(table, _wrapped(ids, variable.blocks.full_shape[0]))
        out = ops.all_to_all(out, group.size, 0, -1, group=group, name=f"{name}_outputs")
    else:
        vocabulary = variable.blocks.full_shape[0]
        rows = vocabulary // group.size
        local = _wrapped(ids, vocabulary) - group.index(_collectives.my_rank()) * rows
        mine = tf.logical_and(local >= 0, local < rows)
        out = tf.gather(table, tf.where(mine, local, tf.zeros_like(local)))
        out = out * tf.cast(mine, out.dtype)[..., None]
        out = _collectives.scatter_batch_sum(out, group, f"{name}_outputs", None)
    return keras.ops.cast(out, layer.compute_dtype)


def _wrapped(ids, size):
    # keras.ops.take counts negative ids from the end.
    return tf.where(ids < 0, ids + tf.cast(size, ids.dtype), ids)
