"""The tf.functions behind a step function, for counting ops in their graphs.

A step built by keras_comm (ParallelOptimizer's micro and apply steps,
`keras_comm.training`'s train function) is a Python function that closes
over, wraps, or is a bound method of an object holding the compiled
`tf.function`. Shared by benchmarks/training.py, benchmarks/collective_bytes.py
and tests/callbacks/test_parallel_optimizer.py, which count collectives in those graphs.
Imports TensorFlow only when called.
"""


def tf_functions(obj, depth=0, seen=None):
    """Yields the `tf.function`s reachable from `obj`.

    Followed: `__wrapped__`, closure cells, the `tf.function` attributes of a
    bound method's instance and the dicts among them (a step keyed by input
    signature or by stage), and the items of dicts, lists and tuples; the
    walk stops at a `tf.function` (its inner Python function is not
    searched) and at depth 6.

    Args:
        obj: a function, bound method or `tf.function`.

    Returns:
        An iterator over `tf.types.experimental.PolymorphicFunction`s, each
        once.
    """
    import tensorflow as tf

    seen = set() if seen is None else seen
    if depth > 6 or id(obj) in seen:
        return
    seen.add(id(obj))
    if isinstance(obj, tf.types.experimental.PolymorphicFunction):
        yield obj
        return
    inner = getattr(obj, "__wrapped__", None)
    if inner is not None:
        yield from tf_functions(inner, depth + 1, seen)
    for cell in getattr(obj, "__closure__", None) or ():
        try:
            contents = cell.cell_contents
        except ValueError:  # an empty cell
            continue
        yield from tf_functions(contents, depth + 1, seen)
    owner = getattr(obj, "__self__", None)
    if owner is not None and not isinstance(owner, type) and hasattr(owner, "__dict__"):
        for value in list(vars(owner).values()):
            if isinstance(value, (tf.types.experimental.PolymorphicFunction, dict)):
                yield from tf_functions(value, depth + 1, seen)
    if isinstance(obj, dict):
        obj = list(obj.values())
    if isinstance(obj, (list, tuple)):
        for item in obj:
            yield from tf_functions(item, depth + 1, seen)


def concrete_functions(obj):
    """Every trace of every `tf.function` reachable from `obj` (fit traces a
    step once per input signature)."""
    for poly in tf_functions(obj):
        yield from poly._list_all_concrete_functions()  # pylint: disable=protected-access


def graph_nodes(concrete):
    """The NodeDefs of a concrete function's graph, with those of the
    functions in its library (a `strategy.run` body, a `tf.cond` branch)."""
    graph_def = concrete.graph.as_graph_def()
    nodes = list(graph_def.node)
    for f in graph_def.library.function:
        nodes.extend(f.node_def)
    return nodes
