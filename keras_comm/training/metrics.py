"""Exact step logs: each metric's result over its state summed across all replicas.

Upstream reduces step outputs with `reduce_per_replica`, which under
MultiWorkerMirroredStrategy uses `axis=0` and fails on scalar metrics
("Invalid reduction dimension 0"); a mean of per-replica metric results would
anyway weight replicas equally whatever their sample counts (the final
partial batch, sample weights). Here a step's metric logs cost one packed
all-reduce and are exact and identical on every worker.
"""

import tensorflow as tf


def reduce_step_outputs(model, strategy, outputs):
    """Exact global metrics for metric logs; a mean over replicas otherwise.

    Outputs count as metric logs when their keys are those of the model's
    metrics (the test Keras applies in `_get_metrics_result_or_logs`).
    """
    if _is_model_metrics_logs(model, outputs):
        variables = [v for m in model.metrics for v in m.variables]
        if not variables:
            return _metrics_result(model, lambda m: [])
        state = dict(
            zip((id(v) for v in variables), _global_metric_state(variables, strategy))
        )
        return _metrics_result(model, lambda m: [state[id(v)] for v in m.variables])
    # A custom `train_step`'s outputs: upstream's "auto" reduction (a mean over
    # replicas), with `axis=None` so scalars work.
    return tf.nest.map_structure(
        lambda v: strategy.reduce(tf.distribute.ReduceOp.MEAN, v, axis=None), outputs
    )


def _replica_contribution(variable, replica_id, num_replicas):
    # What a replica adds to the all-reduce SUM so that the sum is the value
    # TensorFlow would read in cross-replica context for this aggregation.
    value = tf.cast(tf.reshape(variable.value, [-1]), tf.float64)
    if variable.aggregation == "sum":
        return value
    if variable.aggregation == "mean":
        return value / num_replicas
    # "only_first_replica" and "none": the first replica's value.
    return tf.where(tf.equal(replica_id, 0), value, tf.zeros_like(value))


def _global_metric_state(variables, strategy):
    """All replicas' metric state, summed: one packed all-reduce in float64.

    float64 keeps integer-valued counters exact and rounding negligible
    whatever order the ring adds the pieces in.
    """

    def local_state():
        context = tf.distribute.get_replica_context()
        replica_id = tf.cast(context.replica_id_in_sync_group, tf.int32)
        packed = tf.concat(
            [
                _replica_contribution(v, replica_id, strategy.num_replicas_in_sync)
                for v in variables
            ],
            axis=0,
        )
        return context.all_reduce(tf.distribute.ReduceOp.SUM, packed)

    packed = strategy.experimental_local_results(strategy.run(local_state))[0]
    sizes = [int(v.value.shape.num_elements()) for v in variables]
    return [
        tf.cast(tf.reshape(piece, v.value.shape), v.dtype)
        for piece, v in zip(tf.split(packed, sizes), variables)
    ]


def _metrics_result(model, state_for):
    # Mirrors `Trainer.get_metrics_result`, reading each metric from the given
    # state instead of its variables.
    results = {}
    for metric in model.metrics:
        result = metric.stateless_result(state_for(metric))
        if isinstance(result, dict):
            results.update(result)
        else:
            results[metric.name] = result
    return results


def _is_model_metrics_logs(model, outputs):
    # Evaluated on zeros in a stateless scope: reads no synchronised variable,
    # so it adds no collective to the step.
    if not isinstance(outputs, dict):
        return False
    keys = _metrics_result(
        model, lambda m: [tf.zeros(v.value.shape, v.dtype) for v in m.variables]
    ).keys()
    return set(keys) == set(outputs.keys())
