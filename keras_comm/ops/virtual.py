"""Virtual operators: identity forward, bookkeeping backward.

They mark places in a model where the backward pass must do something other
than pass the gradient on: write it into an accumulation buffer
(`virtual_assign_add`), replace it with the buffer (`virtual_accu_grad`), add
the buffer to it (`virtual_add`), divide it (`virtual_div`), or drop it
(`get_tensor_slice`, whose forward also slices).

These rules implement pipeline / accumulation bookkeeping, not the adjoint
of their identity forward; each docstring says exactly what is returned.

Accumulators are caller-owned per-replica variables
(``synchronization=ON_READ, aggregation=NONE``), initially zeros.
"""

import tensorflow as tf

from keras_comm import _validation
from keras_comm.ops import _checks
from keras_comm.ops import _collective
from keras_comm.ops import _differentiable as D

_GET_TENSOR_SLICE_BACKWARDS = ("zeros", "exact")


def virtual_assign_add(x, accumulator, group=None, *, timeout=None, name=None):
    """Routes `x`'s gradient into an accumulation buffer.

    Forward: identity.
    Backward: ``accumulator += dy``, or with a `group` of more than one
    replica ``accumulator += reduce_scatter_sum(dy)`` (the SUM over the group,
    this member's slice of axis 0: the gradient-accumulation shard); returns
    ``dx = zeros``. The gradient reaches the parameter later through the
    buffer (`virtual_accu_grad`, `mirror_micro_step_operator`, ...).

    Not an adjoint by design. Replicas outside `group` add dy unreduced
    (their accumulator must then be shaped like `x`). MindSpore:
    _VirtualAssignAdd.

    Args:
        x: a floating tensor.
        accumulator: per-replica variable shaped like `x` (no group, or a
            non-member), or like `x` with ``x.shape[0] / group_size`` rows.
        group: None for no communication, a list of global ranks or a `Group`
            to reduce-scatter over. (Unlike the mirrors, None here means
            *no* group.)
        timeout, name: as in `keras_comm.ops.mirror_operator`.

    Returns:
        `x`, unchanged.
    """
    what = _checks.what("virtual_assign_add", name)
    x = D.float_input(x, what)
    call = None if group is None else _collective.resolve(group, timeout, name)
    scatter = call is not None and not call.trivial
    if scatter and call.member:
        _checks.check_divisible(x.shape, 0, call.size, what)
        shard = x.shape
        if shard.rank is not None and shard[0] is not None:
            shard = tf.TensorShape([shard[0] // call.size]).concatenate(shard[1:])
        D.check_accumulator(accumulator, shard, what)
    else:
        D.check_accumulator(accumulator, x.shape, what)

    def backward(dy, x, y):
        dy = tf.convert_to_tensor(dy)
        if scatter:
            dy = D.on_members(call, lambda dy: D.reduce_scatter(dy, call), dy)
        with tf.control_dependencies(
            [accumulator.assign_add(tf.cast(dy, accumulator.dtype), read_value=False)]
        ):
            return tf.zeros_like(x)

    return D.with_gradient(x, tf.identity, backward)


def _read_after(accumulator, dy, dtype):
    # Read the buffer only once dy exists: writes made by the backward of
    # later uses (earlier in backward order) must land first.
    with tf.control_dependencies([dy]):
        return tf.cast(accumulator.read_value(), dtype)


def virtual_accu_grad(x, accumulator, *, name=None):
    """Replaces `x`'s gradient with an accumulation buffer's value.

    Forward: identity.
    Backward: ``dx = accumulator`` (read after dy is computed); dy itself is
    discarded and the buffer is left as is. With `virtual_assign_add` on the
    micro-batch paths this hands the accumulated gradient to the parameter.

    Not an adjoint. MindSpore: _VirtualAccuGrad.

    Args:
        x: a floating tensor.
        accumulator: a per-replica variable shaped like `x`.
        name: a layer name for error messages.

    Returns:
        `x`, unchanged.
    """
    x = D.float_input(x, _checks.what("virtual_accu_grad", name), accumulator)

    def backward(dy, x, y):
        return _read_after(accumulator, tf.convert_to_tensor(dy), x.dtype)

    return D.with_gradient(x, tf.identity, backward)


def virtual_add(x, accumulator, *, name=None):
    """Adds an accumulation buffer to `x`'s gradient.

    Forward: identity (the buffer does not enter the forward value).
    Backward: ``dx = dy + accumulator`` (read after dy is computed); the
    buffer gets no gradient and is left as is.

    MindSpore: _VirtualAdd.

    Args:
        x: a floating tensor.
        accumulator: a variable shaped like `x`.
        name: a layer name for error messages.

    Returns:
        `x`, unchanged.
    """
    x = D.float_input(x, _checks.what("virtual_add", name), accumulator)

    def backward(dy, x, y):
        dy = tf.convert_to_tensor(dy)
        return dy + _read_after(accumulator, dy, dy.dtype)

    return D.with_gradient(x, tf.identity, backward)


def virtual_div(x, divisor):
    """Divides the gradient flowing back through `x` by `divisor`.

    Forward: identity (`x` may be a tensor, or a tuple/list/nest of tensors).
    Backward: ``dx = dy / divisor`` for every floating tensor of the nest;
    integer and bool tensors get their gradient passed through unchanged
    (they carry no gradient in TF anyway).

    Not an adjoint (that would be ``dy``): use it to turn a SUM of replica
    gradients into a MEAN (divisor = replicas). MindSpore: _VirtualDiv.

    Args:
        x: a tensor, or a tuple/list (any `tf.nest` structure) of tensors.
        divisor: a non-zero number.

    Returns:
        `x` with the same structure.

    Raises:
        ValueError: a zero or non-numeric `divisor`.
    """
    _validation.nonzero_number(divisor, "divisor")
    flat = [tf.convert_to_tensor(t) for t in tf.nest.flatten(x)]

    def one(t):
        if not t.dtype.is_floating and not t.dtype.is_complex:
            return tf.identity(t)

        def backward(dy, t, y):
            if isinstance(dy, tf.IndexedSlices):
                return tf.IndexedSlices(
                    dy.values / tf.constant(divisor, dy.values.dtype), dy.indices, dy.dense_shape
                )
            return dy / tf.constant(divisor, dy.dtype)

        return D.with_gradient(t, tf.identity, backward)

    return tf.nest.pack_sequence_as(x, [one(t) for t in flat])


def tensor_layout(device_matrix, tensor_map, name="tensor_map"):
    """Validates a MindSpore layout; returns (device_matrix, tensor_map) as tuples.

    `device_matrix` arranges the group's members in a row-major grid (the
    last dimension varies fastest); `tensor_map[i]` names the grid dimension
    that splits tensor dimension i, counted from the grid's LAST dimension
    (0 is the last, as in MindSpore), or -1 for a dimension kept whole.

    Raises:
        TypeError, ValueError: not lists of ints, a device dimension < 1, a
            map entry outside [-1, len(device_matrix)), or a grid dimension
            used twice.
    """
    if not isinstance(device_matrix, (list, tuple)) or not device_matrix:
        raise ValueError(
            "`device_matrix` must be a non-empty list of ints >= 1. "
            f"Received: device_matrix={device_matrix!r}"
        )
    device_matrix = tuple(_validation.positive_int(d, "device_matrix") for d in device_matrix)
    if not isinstance(tensor_map, (list, tuple)):
        raise ValueError(
            f"`{name}` must be a list of ints (one per tensor dimension). "
            f"Received: {name}={tensor_map!r}"
        )
    k = len(device_matrix)
    out = []
    for m in tensor_map:
        if isinstance(m, bool) or not isinstance(m, int) or not -1 <= m < k:
            raise ValueError(
                f"`{name}` entries must be ints in [-1, {k}) for a device matrix of "
                f"{k} dimension(s). Received: {name}={list(tensor_map)!r}"
            )
        if m != -1 and m in out:
            raise ValueError(
                f"`{name}` may split by each device dimension once. "
                f"Received: {name}={list(tensor_map)!r}"
            )
        out.append(m)
    return device_matrix, tuple(out)


def layout_slices(index, device_matrix, tensor_map):
    """[(num_slices, slice_index)] per tensor dimension for group member `index`.

    Pure: member `index`'s coordinates in the row-major `device_matrix`,
    read through `tensor_map` (see `tensor_layout`); (1, 0) for a dimension
    kept whole.
    """
    coords = []
    for d in reversed(device_matrix):
        coords.append(index % d)  # coords[j]: along the j-th LAST grid dimension
        index //= d
    return [
        (1, 0) if m == -1 else (device_matrix[len(device_matrix) - 1 - m], coords[m])
        for m in tensor_map
    ]


def get_tensor_slice(
    x,
    axis=0,
    num_slices=None,
    group=None,
    backward="zeros",
    *,
    device_matrix=None,
    tensor_map=None,
    name=None,
):
    """Keeps this replica's slice of a full tensor.

    Forward: splits `x` into `num_slices` equal slices along `axis` and
    returns slice number ``group.index(rank) % num_slices``, where
    `num_slices` defaults to the group size (the common case: member i of
    the group keeps the i-th shard).
    With a layout (`device_matrix` and `tensor_map`, MindSpore's
    description; then `axis` and `num_slices` are not used) the group's
    members form a row-major grid of shape `device_matrix` (its size must
    be the group size), and tensor dimension i is split into
    ``device_matrix[-1 - tensor_map[i]]`` equal slices, of which member p
    keeps the one at its coordinate along that grid dimension; a dimension
    with ``tensor_map[i] == -1`` is kept whole. Every split dimension must
    divide evenly.
    Backward, chosen by name:

    * ``backward="zeros"``: ``dx = 0``. The full tensor is treated as a
      constant (for loading a parameter's shard; MindSpore:
      _GetTensorSlice).
    * ``backward="exact"``: the adjoint, ``dx`` is dy placed at this slice's
      position in zeros of `x`'s shape.

    No communication. Replicas outside `group` get the whole `x` (and their
    gradient per `backward`: zeros, or dy).

    Args:
        x: a tensor whose `axis` dimension is divisible by `num_slices`.
        axis: the axis to slice (negative counts from the end).
        num_slices: int >= 1, or None for the group size.
        group: None (all replicas), a list of global ranks or a `Group`.
        backward: "zeros" or "exact".
        device_matrix: None, or a list of ints >= 1 whose product is the
            group size.
        tensor_map: None, or one int per dimension of `x`, in
            ``[-1, len(device_matrix))``; with `device_matrix`.
        name: a layer name for error messages.

    Returns:
        This replica's slice.

    Raises:
        ValueError: bad `axis`, `num_slices`, `backward`, layout, or a
            dimension not divisible by its number of slices.
    """
    what = _checks.what("get_tensor_slice", name)
    zeros_grad = _validation.one_of(backward, _GET_TENSOR_SLICE_BACKWARDS, "backward") == "zeros"
    x = tf.convert_to_tensor(x)
    rank = x.shape.rank
    layout = device_matrix is not None or tensor_map is not None
    if layout:
        if device_matrix is None or tensor_map is None:
            raise ValueError(
                f"{what}: a layout needs both `device_matrix` and `tensor_map`. "
                f"Received: device_matrix={device_matrix!r}, tensor_map={tensor_map!r}"
            )
        if axis != 0 or num_slices is not None:
            raise ValueError(
                f"{what}: `axis` and `num_slices` describe the one-axis slice; with a "
                f"layout leave them at their defaults. Received: axis={axis!r}, "
                f"num_slices={num_slices!r}"
            )
        device_matrix, tensor_map = tensor_layout(device_matrix, tensor_map)
        if len(tensor_map) != rank:
            raise ValueError(
                f"{what}: `tensor_map` needs one entry per dimension of the input of "
                f"shape {x.shape}. Received: tensor_map={list(tensor_map)!r}"
            )
    elif isinstance(axis, bool) or not isinstance(axis, int) or not -rank <= axis < rank:
        raise ValueError(
            f"{what}: `axis` must be an int in [-{rank}, {rank}) for an input of "
            f"shape {x.shape}. Received: axis={axis!r}"
        )
    call = _collective.resolve(group, None, name)
    if layout:
        devices = 1
        for d in device_matrix:
            devices *= d
        if devices != call.size:
            raise ValueError(
                f"{what}: the device matrix must hold the group's {call.size} members. "
                f"Received: device_matrix={list(device_matrix)!r}"
            )
        index = call.index if call.member else 0
        splits = [
            (a, n, i) for a, (n, i) in enumerate(layout_slices(index, device_matrix, tensor_map))
        ]
    else:
        axis %= rank
        n = call.size if num_slices is None else num_slices
        if isinstance(n, bool) or not isinstance(n, int) or n < 1:
            raise ValueError(
                f"`num_slices` must be an int >= 1 or None. Received: num_slices={num_slices!r}"
            )
        splits = [(axis, n, call.index % n if call.member else 0)]
    for a, n, _ in splits:
        dim = x.shape[a]
        if dim is not None and dim % n:
            raise ValueError(
                f"{what}: dimension {a} ({dim}) must be divisible by the number of "
                f"slices {n}. Received: x.shape={x.shape}"
            )
    splits = [s for s in splits if s[1] > 1] if layout else splits
    member = call.member

    def bounds(x):
        shape = tf.shape(x)
        begin, size = [tf.zeros([], tf.int32)] * rank, [shape[a] for a in range(rank)]
        for a, n, i in splits:
            size[a] = shape[a] // n
            begin[a] = i * size[a]
        return tf.stack(begin), tf.stack(size), shape

    def forward(x):
        if not member:
            return tf.identity(x)
        begin, size, _ = bounds(x)
        y = tf.slice(x, begin, size)
        static = x.shape.as_list()
        for a, n, _ in splits:
            static[a] = None if static[a] is None else static[a] // n
        y.set_shape(static)
        return y

    def grad(dy, x, y):
        dy = tf.convert_to_tensor(dy)
        if zeros_grad:
            return tf.zeros_like(x)
        if not member:
            return dy
        begin, size, shape = bounds(x)
        return tf.pad(dy, tf.stack([begin, shape - begin - size], axis=1))

    return D.with_gradient(x, forward, grad)
