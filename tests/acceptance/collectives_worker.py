"""Multi-process check of the core collectives against a float64 simulation.

Run by tests/acceptance/test_collectives_multiprocess.py through `run_cluster` (one
replica per worker process), in one launch with mirror_worker (shared_launch_worker.py). Every worker knows every rank's input (a
deterministic function of the rank), so it computes the whole single-process
simulation locally and compares its own forward value and gradient with it.
Writes, per "<mode>/<case>", the max absolute error of the forward value and
of the gradient.
"""

import numpy as np
import tensorflow as tf

from _cluster import finish, write_result
from _strategy import strategy

import keras_comm
from keras_comm import ops as K

N = strategy.num_replicas_in_sync
SUB = [0, N - 1]  # a subgroup; with 3 workers rank 1 is outside it
ROOT = N - 1


def make_input(r, zeros=False):
    # Strictly increasing in r (no ties for max/min), mixed signs.
    x = np.arange(1, 37, dtype=np.float64).reshape(6, 6) * (r + 1) * 0.1 - 1.0 + 0.01 * r
    if zeros and r in (0, N - 1):
        x[0, 0] = 0.0  # zero on two ranks (on one when N == 1)
        x[1, r] = 0.0  # zero on one rank only
    return x


def weights(r, shape):
    return tf.random.stateless_uniform(shape, seed=[r, 7], minval=0.5, maxval=1.5, dtype=tf.float64)


def members(group):
    return list(range(N)) if group is None else sorted(group)


def per_member(xs, group, fn):
    m = members(group)
    return [fn(m, r) if r in m else xs[r] for r in range(N)]


def red(kind):
    return {
        "sum": lambda v: tf.add_n(v),
        "prod": lambda v: tf.reduce_prod(tf.stack(v), 0),
        "max": lambda v: tf.reduce_max(tf.stack(v), 0),
        "min": lambda v: tf.reduce_min(tf.stack(v), 0),
    }[kind]


# name -> (op_fn(x), reference(xs) -> ys, zeros_in_input, gradient rule)
# gradient rule: "exact" (simulation), ("scale", s) or "local" (dy itself).
CASES = {}
for op in ("sum", "prod", "max", "min"):
    CASES[f"all_reduce_{op}"] = (
        lambda x, op=op: K.all_reduce(x, op),
        lambda xs, op=op: per_member(xs, None, lambda m, r: red(op)([xs[i] for i in m])),
        False,
        "exact",
    )
CASES["all_reduce_prod_zeros"] = (
    lambda x: K.all_reduce(x, "prod"),
    lambda xs: [red("prod")(xs)] * N,
    True,
    "exact",
)
for op, zeros in (("prod", True), ("max", False), ("min", False)):
    CASES[f"reduce_{op}"] = (
        lambda x, op=op: K.reduce(x, ROOT, op=op),
        lambda xs, op=op: per_member(
            xs, None, lambda m, r: red(op)([xs[i] for i in m]) * (1.0 if r == ROOT else 0.0)
        ),
        zeros,
        "exact",
    )
# A sparse upstream gradient (tf.gather downstream, a duplicate row): the
# backward keeps it IndexedSlices for every op (densified here to compare).
SPARSE_IDS = [0, 3, 0, 5]
for op, zeros in (("prod", True), ("max", False), ("min", False)):
    CASES[f"all_reduce_{op}_sparse_gradient"] = (
        lambda x, op=op: tf.gather(K.all_reduce(x, op), SPARSE_IDS),
        lambda xs, op=op: [tf.gather(red(op)(xs), SPARSE_IDS)] * N,
        zeros,
        "exact",
    )
CASES["all_reduce_sum_subgroup"] = (
    lambda x: K.all_reduce(x, "sum", SUB),
    lambda xs: per_member(xs, SUB, lambda m, r: tf.add_n([xs[i] for i in m])),
    False,
    "exact",
)
def _parts(x):
    # Two dtypes' worth of differently shaped pieces (one transfer per dtype).
    return [x[:2], tf.reshape(x[2:], [4, 3, 2])[:, :, 0], x[2:, ::2], tf.cast(x[0], tf.float32)]


def _flat(parts):
    return tf.concat([tf.reshape(tf.cast(p, tf.float64), [-1]) for p in parts], 0)


CASES["all_reduce_fused"] = (
    lambda x: _flat(K.all_reduce(_parts(x))),
    lambda xs: [_flat([tf.add_n(list(ps)) for ps in zip(*[_parts(v) for v in xs])])] * N,
    False,
    "exact",
)
for group in (None, SUB):
    tag = "" if group is None else "_subgroup"
    root = ROOT if group is None else SUB[-1]
    CASES[f"all_gather{tag}"] = (
        lambda x, g=group: K.all_gather(x, group=g),
        lambda xs, g=group: per_member(xs, g, lambda m, r: tf.concat([xs[i] for i in m], 0)),
        False,
        "exact",
    )
    CASES[f"reduce_scatter{tag}"] = (
        lambda x, g=group: K.reduce_scatter(x, group=g),
        lambda xs, g=group: per_member(
            xs, g, lambda m, r: tf.split(tf.add_n([xs[i] for i in m]), len(m))[m.index(r)]
        ),
        False,
        "exact",
    )
    CASES[f"collective_gather{tag}"] = (
        lambda x, g=group, d=root: K.collective_gather(x, d, g),
        lambda xs, g=group, d=root: per_member(
            xs,
            g,
            lambda m, r: tf.concat([xs[i] for i in m], 0) * (1.0 if r == d else 0.0),
        ),
        False,
        "exact",
    )
    CASES[f"collective_scatter{tag}"] = (
        lambda x, g=group, s=root: K.collective_scatter(x, s, g),
        lambda xs, g=group, s=root: per_member(
            xs, g, lambda m, r: tf.split(xs[s], len(m))[m.index(r)]
        ),
        False,
        "exact",
    )
    CASES[f"broadcast{tag}"] = (
        lambda x, g=group, s=root: K.broadcast(x, s, g),
        lambda xs, g=group, s=root: per_member(xs, g, lambda m, r: xs[s] + 0.0),
        False,
        "exact",
    )
    CASES[f"reduce{tag}"] = (
        lambda x, g=group, d=root: K.reduce(x, d, g),
        lambda xs, g=group, d=root: per_member(
            xs, g, lambda m, r: tf.add_n([xs[i] for i in m]) * (1.0 if r == d else 0.0)
        ),
        False,
        "exact",
    )
    CASES[f"all_to_all{tag}"] = (
        lambda x, g=group: K.all_to_all(x, len(members(g)), 0, 1, g),
        lambda xs, g=group: per_member(
            xs,
            g,
            lambda m, r: tf.concat([tf.split(xs[j], len(m), 0)[m.index(r)] for j in m], 1),
        ),
        False,
        "exact",
    )
CASES["all_gather_mean_flag"] = (
    lambda x: K.all_gather(x, mean=True),
    lambda xs: [tf.concat(xs, 0)] * N,
    False,
    ("scale", 1.0 / N),
)
CASES["broadcast_identity"] = (
    lambda x: K.broadcast(x, ROOT, gradient="identity"),
    lambda xs: [xs[ROOT] + 0.0] * N,
    False,
    "local",
)


def simulate(ref_fn, zeros):
    xs = [tf.constant(make_input(r, zeros)) for r in range(N)]
    with tf.GradientTape() as tape:
        tape.watch(xs)
        ys = ref_fn(xs)
        total = tf.add_n([tf.reduce_sum(weights(r, tf.shape(y)) * y) for r, y in enumerate(ys)])
    grads = tape.gradient(total, xs, unconnected_gradients=tf.UnconnectedGradients.ZERO)
    return [(y.numpy(), g.numpy()) for y, g in zip(ys, grads)]


def distributed(mode):
    """Every case in one `strategy.run` (one trace): {name: (y, dloss/dx)}."""

    def replica_fn():
        r = keras_comm.rank()
        out = {}
        for name, (op_fn, _, zeros, _) in CASES.items():
            x = tf.constant(make_input(r, zeros))
            with tf.GradientTape() as tape:
                tape.watch(x)
                y = op_fn(x)
                loss = tf.reduce_sum(weights(r, tf.shape(y)) * y)
            g = tape.gradient(loss, x, unconnected_gradients=tf.UnconnectedGradients.ZERO)
            out[name] = (y, tf.convert_to_tensor(g))
        return out

    if mode == "function":
        out = tf.function(lambda: strategy.run(replica_fn))()
    else:
        out = strategy.run(replica_fn)
    return tf.nest.map_structure(lambda v: strategy.experimental_local_results(v)[0].numpy(), out)


def sparse_check(mode):
    """Sparse all-reduce: rank r sends r+1 rows; the dense sum must match."""

    def replica_fn():
        r = keras_comm.rank()
        rows = r + 1
        values = tf.cast(tf.reshape(tf.range(rows * 2), [rows, 2]) + 10 * r, tf.float64)
        s = tf.IndexedSlices(values, tf.range(rows, dtype=tf.int64) % 3, tf.constant([3, 2], tf.int64))
        return tf.convert_to_tensor(K.all_reduce(s))

    fn = tf.function(lambda: strategy.run(replica_fn)) if mode == "function" else (
        lambda: strategy.run(replica_fn)
    )
    got = strategy.experimental_local_results(fn())[0].numpy()
    want = np.zeros([3, 2])
    for r in range(N):
        vals = np.arange((r + 1) * 2).reshape(r + 1, 2) + 10 * r
        for i in range(r + 1):
            want[i % 3] += vals[i]
    return float(np.max(np.abs(got - want)))


def results():
    """{"world_size": N, "errors": {"<mode>/<case>": {"forward", "gradient"}}}."""
    r = strategy.cluster_resolver.task_id
    wanted = {name: simulate(ref_fn, zeros)[r] for name, (_, ref_fn, zeros, _) in CASES.items()}
    errors = {}
    for mode in ("function", "eager"):
        got = distributed(mode)
        for name, (_, _, _, rule) in CASES.items():
            y, g = got[name]
            y_ref, g_ref = wanted[name]
            if rule == "local":
                g_ref = weights(r, y_ref.shape).numpy()
            elif isinstance(rule, tuple):
                g_ref = g_ref * rule[1]
            finite = bool(np.all(np.isfinite(g)))
            errors[f"{mode}/{name}"] = {
                "forward": float(np.max(np.abs(y - y_ref))),
                "gradient": float(np.max(np.abs(g - g_ref))) if finite else float("inf"),
            }
        errors[f"{mode}/all_reduce_sparse"] = {"forward": sparse_check(mode), "gradient": 0.0}
    return {"world_size": N, "errors": errors}


if __name__ == "__main__":
    write_result(results())
    finish()  # _cluster.finish: skip the slow teardown
