"""Every private TensorFlow attribute keras_comm touches, each behind a named function.

Most are what tf.distribute's own collective launcher
(``CollectiveReplicaLauncher``) uses and TensorFlow does not export: the V2
collective ops with an ordering token, call-time captures for instance keys,
the replica id and device of the calling replica, and the process-wide abort.
Why each is needed is in its docstring.

`relied_on()` names the private functions; tests/compat/test_private_api.py hashes
their source per TensorFlow version.
"""

import tensorflow as tf
from tensorflow.python.distribute import device_util
from tensorflow.python.distribute import values as tf_values
from tensorflow.python.eager import context
from tensorflow.python.eager import record
from tensorflow.python.framework import ops as tf_ops
from tensorflow.python.ops import collective_ops
from tensorflow.python.ops import gen_collective_ops
from tensorflow.python.ops import resource_variable_ops

# --- Collective ops -----------------------------------------------------------
#
# The exported `tf.raw_ops` collectives take no ordering token and the public
# `tf.distribute` API only reduces over the whole world. These V2 wrappers take
# (group_size, group_key, instance_key, communication_hint, timeout,
# ordering_token, name) by keyword, which is what lets keras_comm run
# collectives over its own groups, ordered per device.

all_reduce_v2 = collective_ops.all_reduce_v2
all_gather_v2 = collective_ops.all_gather_v2
all_to_all_v2 = collective_ops.all_to_all_v2
broadcast_send_v2 = collective_ops.broadcast_send_v2
broadcast_recv_v2 = collective_ops.broadcast_recv_v2


def reduce_scatter_v2(
    t, group_size, group_key, instance_key, communication_hint, timeout, ordering_token, name
):
    """The V2 (NCCL) reduce-scatter: TF exports no Python wrapper for it."""
    return gen_collective_ops.collective_reduce_scatter_v2(
        t,
        group_size=group_size,
        group_key=group_key,
        instance_key=instance_key,
        ordering_token=[ordering_token],
        merge_op="Add",
        final_op="Id",
        communication_hint=communication_hint,
        timeout_seconds=timeout,
        name=name,
    )


def ordering_token_variable(device):
    """A resource variable whose handle orders collectives on `device`.

    The V2 collectives take an ordering token, a resource handle; a
    `tf.Variable` created by the public API may be wrapped (by a strategy
    scope) into a distributed variable, which has no single handle.
    """
    with tf.init_scope(), tf.device(device):
        return resource_variable_ops.ResourceVariable(
            0.0, trainable=False, name="keras_comm_ordering_token"
        )


def abort_collective_ops(code, message):
    """Aborts every collective of the process (what TF's own op timeout does).

    Used by the watchdog instead of per-op timeouts, which cost two threads per
    collective call (see `keras_comm.watchdog`).
    """
    context.context().abort_collective_ops(code, message)


# --- The coordination service's key-value store ---------------------------------
#
# MultiWorkerMirroredStrategy starts TensorFlow's coordination service; its
# key-value store is how TF's own PreemptionCheckpointHandler agrees on a step
# without a collective. TF exports no Python API for it.


def has_coordination_service():
    """Whether this process is a member of a coordination service (multi-worker)."""
    return context.context().coordination_service is not None


def key_value_insert(key, value):
    """Inserts `key`; raises `tf.errors.AlreadyExistsError` if it is set (first writer wins)."""
    context.context().set_config_key_value(key, value)


def key_value_get(key, timeout_seconds=None):
    """The value of `key`, waiting until it is set (or `timeout_seconds`, then an OpError)."""
    timeout_ms = 0 if timeout_seconds is None else max(1, int(timeout_seconds * 1000))
    return context.context().get_config_key_value(key, timeout_in_ms=timeout_ms)


def communication_implementation(strategy):
    """The strategy's collective implementation ('auto', 'ring' or 'nccl').

    keras_comm's collectives follow it; the strategy keeps its
    `CommunicationOptions` privately.
    """
    options = getattr(strategy.extended, "_communication_options", None)
    implementation = getattr(options, "implementation", None)
    return implementation.value.lower() if implementation is not None else "auto"


# --- Graphs under construction --------------------------------------------------


def default_graph():
    """The graph being built (or the eager context's placeholder graph)."""
    return tf_ops.get_default_graph()


def outer_graph(graph):
    """The graph enclosing `graph` (a function's or branch's), or None."""
    return getattr(graph, "outer_graph", None)


def capture_in_outermost_function(tensor):
    """`tensor` as captured by the outermost function graph being built.

    Inside a nested graph (a `tf.cond` branch, or the gradient of one) a
    direct use of an eagerly created handle makes that graph capture an
    eager tensor, which cond_v2's gradient cannot resolve. Capturing it in
    the outermost function first gives nested graphs a graph tensor to
    capture, as they do for ordinary variables.
    """
    graph = default_graph()
    outer = outer_graph(graph)
    if tf.executing_eagerly() or outer is None or not graph.building_function:
        return tensor
    while outer_graph(outer) is not None and outer.building_function:
        graph, outer = outer, outer.outer_graph
    return graph.capture(tensor)


def capture_call_time_value(fn, spec):
    """A tensor of `spec` whose value `fn()` gives at each call of the function.

    Collective instance keys must be drawn when a compiled step is called,
    not when it is traced, exactly as tf.distribute's own launcher does.
    Returns None outside a function being built (the caller then uses an
    eager value). Control-flow graphs cannot hold the capture; their
    enclosing function graph does.
    """
    graph = default_graph()
    while getattr(graph, "is_control_flow_graph", False):
        graph = graph.outer_graph
    if tf.executing_eagerly() or not graph.building_function:
        return None
    with graph.as_default():
        return graph.capture_call_time_value(fn, spec)


def op_id(op):
    """The creation index of `op` in its graph: older ops cannot read newer ones."""
    return op._id  # pylint: disable=protected-access


def rewire_input(op, index, tensor):
    """Makes input `index` of the existing `op` read `tensor`.

    How a fusion group's stand-ins are pointed at the packed all-reduce once
    every member is known; TF has no public graph rewriting.
    """
    op._update_input(index, tensor)  # pylint: disable=protected-access


def stop_recording():
    """A context in which no gradient tape records the ops built."""
    return record.stop_recording()


# --- Replicas and their devices ---------------------------------------------------


def replica_id(replica_context):
    """The replica id as the strategy holds it: a Python int when static.

    The public `replica_id_in_sync_group` is always a tensor; the group of a
    collective must be known at trace time.
    """
    return replica_context._replica_id_in_sync_group  # pylint: disable=protected-access


def in_update_context():
    """True inside `strategy.extended.update` (an optimizer applying updates).

    There a distributed variable reads as the component being updated; a
    layout-split Keras variable (`keras_comm.distribution`) must then read
    as its block, not gather.
    """
    from tensorflow.python.distribute import distribute_lib

    return distribute_lib.get_update_replica_id() is not None


def current_device():
    """The canonical name of the device ops are placed on now (may be '')."""
    return device_util.current()


def canonicalize_device(name):
    """`name` as a canonical device string, to compare devices."""
    return device_util.canonicalize(name)


def per_replica(values):
    """One value per local replica, as `strategy.run` returns them.

    `merge_call` must hand back its result in this form when several local
    replicas run their collectives concurrently.
    """
    return tf_values.PerReplica(values)


def per_replica_component_spec(spec):
    """One replica's spec inside a distributed dataset's `PerReplicaSpec`."""
    value_specs = getattr(spec, "_value_specs", None)
    if isinstance(spec, tf.TypeSpec) and value_specs is not None:
        return value_specs[0]
    return spec


def shard_value(value, dtype):
    """`value`, a slice of a larger tensor, as a tensor of `dtype` with a
    buffer of its own, to assign to a variable.

    A slice along a tensor's leading dimension shares the full tensor's
    buffer, and a variable assigned a tensor nothing else references adopts
    that buffer: assigned a plain slice of a full weight, the variable keeps
    the whole weight alive for its lifetime. The copy costs one shard.
    (Slices of numpy arrays are copied by the assignment itself.)
    """
    return tf.raw_ops.DeepCopy(x=tf.cast(value, dtype))


def local_component(variable):
    """The current replica's component of a distributed tf.Variable (others as is).

    Updating it directly (every replica writes the same value) avoids a
    merge_call per variable.
    """
    get_local = getattr(variable, "_get_on_device_or_primary", None)
    return get_local() if get_local is not None else variable


def variable_strategy(variable):
    """The strategy a tf.Variable was created under, or None.

    A distributed variable knows its strategy only privately; the sharded
    weights' host-side export must run under it.
    """
    return getattr(variable, "_distribute_strategy", None)


# --- AutoGraph ----------------------------------------------------------------
#
# AutoGraph converts (parses, transforms and recompiles) every function a
# converted function calls unless its module matches one of the conversion
# rules; TensorFlow lists itself, Keras and tf_keras there, and exports no
# way to add a package. keras_comm's code has no Python control flow on
# tensors (Keras's `fit` already calls all of it unconverted, from its
# `do_not_convert` steps), so converting it only costs time: a converted
# function calling a keras_comm op converted ~90 keras_comm functions per
# collective, most of the tracing time of a step of collectives (3 workers,
# 36 collectives with gradients, tests/acceptance/collectives_worker.py:
# 9.7 s traced with the conversion, 2.6 s without).

_unconverted = set()


def leave_unconverted_by_autograph(package):
    """Makes AutoGraph call `package`'s functions as written, as it does
    TensorFlow's and Keras's: a rule at the front of its conversion rules
    (`conversion.is_allowlisted` reads them on every call). Idempotent."""
    from tensorflow.python.autograph.core import config as autograph_config

    if package in _unconverted:
        return
    autograph_config.CONVERSION_RULES = (
        autograph_config.DoNotConvert(package),
    ) + tuple(autograph_config.CONVERSION_RULES)
    _unconverted.add(package)


# --- What the version test guards --------------------------------------------


def relied_on():
    """The private TensorFlow functions keras_comm calls, by name."""
    from tensorflow.python.autograph.impl import conversion
    from tensorflow.python.distribute import values
    from tensorflow.python.framework import func_graph

    return {
        "conversion.is_allowlisted": conversion.is_allowlisted,
        "collective_ops.all_reduce_v2": collective_ops.all_reduce_v2,
        "collective_ops.all_gather_v2": collective_ops.all_gather_v2,
        "collective_ops.all_to_all_v2": collective_ops.all_to_all_v2,
        "collective_ops.broadcast_send_v2": collective_ops.broadcast_send_v2,
        "collective_ops.broadcast_recv_v2": collective_ops.broadcast_recv_v2,
        "gen_collective_ops.collective_reduce_scatter_v2": (
            gen_collective_ops.collective_reduce_scatter_v2
        ),
        "Context.abort_collective_ops": context.Context.abort_collective_ops,
        "Context.coordination_service": context.Context.coordination_service.fget,
        "Context.set_config_key_value": context.Context.set_config_key_value,
        "Context.get_config_key_value": context.Context.get_config_key_value,
        "FuncGraph.capture": func_graph.FuncGraph.capture,
        "FuncGraph.capture_call_time_value": func_graph.FuncGraph.capture_call_time_value,
        "Operation._update_input": tf_ops.Operation._update_input,
        "record.stop_recording": record.stop_recording,
        "device_util.current": device_util.current,
        "device_util.canonicalize": device_util.canonicalize,
        "DistributedVariable._get_on_device_or_primary": (
            values.DistributedVariable._get_on_device_or_primary
        ),
        "PerReplica": values.PerReplica,
        "distribute_lib.get_update_replica_id": _distribute_lib().get_update_replica_id,
    }


def _distribute_lib():
    from tensorflow.python.distribute import distribute_lib

    return distribute_lib
