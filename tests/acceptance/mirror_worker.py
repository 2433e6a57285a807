"""Worker: every mirror / virtual op, forward and gradient, across real processes.

Each worker is one replica. Inputs are deterministic functions of the rank,
so every worker computes the whole float64 single-process reference itself
and reports the max errors of its own replica, in eager mode and in
tf.function, for the whole world and for a subgroup.
"""

import contextlib

import numpy as np
import tensorflow as tf

from _cluster import finish, write_result
from _strategy import strategy

import keras_comm  # noqa: E402  (after the strategy: TF_CONFIG is read once)
from keras_comm import ops  # noqa: E402

N = strategy.num_replicas_in_sync
ME = keras_comm.Group(range(N)).index(int(strategy.cluster_resolver.task_id))
SHAPE = (6, 4)  # axis 0 divisible by 2 and 3


def inp(r, t=0):
    return np.arange(24.0).reshape(SHAPE) / 8.0 + (r + 1) + t


def weights(r, shape, t=0):
    return np.linspace(0.5, 1.5, int(np.prod(shape))).reshape(shape) * (r + 1) + t


def local(out):
    return tf.nest.map_structure(lambda v: strategy.experimental_local_results(v)[0].numpy(), out)


def runner(fn, mode):
    if mode == "function":
        f = tf.function(lambda t: strategy.run(fn, args=(t,)))
    else:
        f = lambda t: strategy.run(fn, args=(t,))  # noqa: E731
    return lambda t: local(f(tf.constant(t, tf.float64)))


def per_replica(shape, dtype=tf.float64):
    with strategy.scope():
        return tf.Variable(
            tf.zeros(shape, dtype),
            trainable=False,
            synchronization=tf.VariableSynchronization.ON_READ,
            aggregation=tf.VariableAggregation.NONE,
        )


def linear_case(op, ref, scope=contextlib.nullcontext):
    """Stateless op: loss_r = sum(w_r * y_r); compare y and dx with the float64 reference.

    `scope` wraps the forward and backward pass (e.g. `ops.fusion_scope`).
    """

    def fn(t):
        r = keras_comm.rank()
        x = tf.constant(inp(r))
        with scope():
            with tf.GradientTape() as tape:
                tape.watch(x)
                y = op(x)
                loss = tf.reduce_sum(tf.constant(weights(r, y.shape)) * y)
            return y, tape.gradient(loss, x)

    def reference():
        xs = [tf.constant(inp(r)) for r in range(N)]
        with tf.GradientTape() as tape:
            for x in xs:
                tape.watch(x)
            ys = ref(xs)
            total = tf.add_n([tf.reduce_sum(tf.constant(weights(r, y.shape)) * y) for r, y in enumerate(ys)])
        grads = tape.gradient(total, xs, unconnected_gradients=tf.UnconnectedGradients.ZERO)
        return ys[ME].numpy(), grads[ME].numpy()

    return fn, reference


def tied(members, scale):
    def ref(xs):
        total = tf.add_n([xs[s] for s in members])
        return [
            tf.stop_gradient(x) + (total - tf.stop_gradient(total)) * scale if r in members else x
            for r, x in enumerate(xs)
        ]

    return ref


def scaled(x, scale):
    return x * scale + tf.stop_gradient(x * (1 - scale))


def fused(x):
    """Mirrors and an all-reduce sharing fusion id 1 (world and subgroup packs)."""
    a, b, c = tf.split(x, 3)
    sub = [0, N - 1]
    return tf.concat(
        [
            ops.mirror_operator(a, fusion=1) ** 2,
            ops.all_reduce(b * b, fusion=1),
            ops.mirror_operator(c, mean=False, group=sub, fusion=1),
        ],
        0,
    )


def fused_reference(xs):
    parts = [tf.split(x, 3) for x in xs]
    sub = [0, N - 1]
    ta = tied(list(range(N)), 1.0 / N)([p[0] for p in parts])
    tc = tied(sub, 1.0)([p[2] for p in parts])
    b = tf.add_n([p[1] * p[1] for p in parts])
    return [tf.concat([ta[r] ** 2, b, tc[r]], 0) for r in range(N)]


def fused_gathers(x):
    """All-gathers and reduce-scatters sharing fusion id 1: one pack per kind."""
    parts = [
        ops.all_gather(x[:2], fusion=1),
        ops.all_gather(tf.reshape(x[2:], [4, 2, 2]), fusion=1),
        ops.reduce_scatter(x, fusion=1),
        ops.reduce_scatter(tf.reshape(x, [6, 2, 2]), fusion=1),
    ]
    return tf.concat([tf.reshape(p, [-1]) for p in parts], 0)


def fused_gathers_reference(xs):
    k = SHAPE[0] // N
    a = tf.concat([x[:2] for x in xs], 0)
    b = tf.concat([tf.reshape(x[2:], [4, 2, 2]) for x in xs], 0)
    total = tf.add_n(xs)
    out = []
    for r in range(N):
        c = total[r * k : (r + 1) * k]
        d = tf.reshape(total, [6, 2, 2])[r * k : (r + 1) * k]
        out.append(tf.concat([tf.reshape(p, [-1]) for p in (a, b, c, d)], 0))
    return out


def stateless_cases():
    world = list(range(N))
    sub = [0, N - 1]
    acc = per_replica((SHAPE[0] * N, SHAPE[1]))
    step = per_replica((), tf.int64)
    shard_acc, shard_step = per_replica(SHAPE), per_replica((), tf.int64)
    micro_acc = per_replica(SHAPE)
    size = SHAPE[0] // N
    return {
        "mirror_mean": linear_case(lambda x: ops.mirror_operator(x), tied(world, 1.0 / N)),
        "mirror_subgroup_sum": linear_case(
            lambda x: ops.mirror_operator(x, mean=False, group=sub), tied(sub, 1.0)
        ),
        "mini_step_all_gather_k1": linear_case(
            lambda x: ops.mini_step_all_gather(x, acc, step, 1, True),
            lambda xs: [tf.concat([scaled(x, 1.0 / N) for x in xs], 0)] * N,
        ),
        "micro_step_all_gather": linear_case(
            lambda x: ops.micro_step_all_gather(x, acc, False),
            lambda xs: [tf.concat(xs, 0)] * N,
        ),
        "mini_step_all_gather_shard_accumulator_k1": linear_case(
            lambda x: ops.mini_step_all_gather(
                x, shard_acc, shard_step, 1, True, shard_accumulator=True
            ),
            lambda xs: [tf.concat([scaled(x, 1.0 / N) for x in xs], 0)] * N,
        ),
        "micro_step_all_gather_no_reduction": linear_case(
            lambda x: ops.micro_step_all_gather(x, acc, reduce_gradient=False),
            lambda xs: [
                tf.concat([x if q == r else tf.stop_gradient(x) for q, x in enumerate(xs)], 0)
                for r in range(N)
            ],
        ),
        "micro_step_all_gather_with_mirror_operator": linear_case(
            lambda x: ops.micro_step_all_gather(x, None, True, with_mirror_operator=True),
            lambda xs: [tf.concat([scaled(x, 1.0 / N) for x in xs], 0)] * N,
        ),
        "mirror_micro_step_optimizer_shard_size_1": linear_case(
            lambda x: ops.mirror_micro_step_operator(
                x, micro_acc, True, None, True, optimizer_shard_size=1
            ),
            tied(world, 1.0 / N),
        ),
        "mirror_micro_step_optimizer_shard_size_n": linear_case(
            lambda x: ops.mirror_micro_step_operator(
                x, micro_acc, True, None, True, optimizer_shard_size=N
            ),
            lambda xs: xs,
        ),
        "get_tensor_slice_exact": linear_case(
            lambda x: ops.get_tensor_slice(x, backward="exact"),
            lambda xs: [x[r * size : (r + 1) * size] for r, x in enumerate(xs)],
        ),
        "get_tensor_slice_layout_exact": linear_case(
            lambda x: ops.get_tensor_slice(
                x, backward="exact", device_matrix=[1, N], tensor_map=[0, -1]
            ),
            lambda xs: [x[r * size : (r + 1) * size] for r, x in enumerate(xs)],
        ),
        "get_tensor_slice_zeros": linear_case(
            lambda x: ops.get_tensor_slice(x),
            lambda xs: [tf.stop_gradient(x[r * size : (r + 1) * size]) for r, x in enumerate(xs)],
        ),
        "virtual_div": linear_case(lambda x: ops.virtual_div(x, 4), lambda xs: [scaled(x, 0.25) for x in xs]),
        "fused_mirrors_and_all_reduce": linear_case(fused, fused_reference, ops.fusion_scope),
        "fused_all_gathers_and_reduce_scatters": linear_case(
            fused_gathers, fused_gathers_reference, ops.fusion_scope
        ),
    }


def quad_dy(r, t):
    # loss_{r,t} = sum(w_{r,t} * y**2) with y = x_{r,t}: dy = 2 w x.
    return 2 * weights(r, SHAPE, t) * inp(r, t)


def quad_loss(y, r, t):
    w = tf.constant(np.linspace(0.5, 1.5, 24).reshape(SHAPE)) * tf.cast(r + 1, tf.float64) + t
    return tf.reduce_sum(w * y * y)


def stateful_cases(mode):
    """[(name, errors)] for the accumulation ops, over two steps."""
    out = {}

    # MirrorMiniStepOperator, k = 2, mean over the world.
    acc, step = per_replica(SHAPE), per_replica((), tf.int64)

    def mini(t):
        r = keras_comm.rank()
        x = tf.constant(inp(r)) + t
        with tf.GradientTape() as tape:
            tape.watch(x)
            loss = quad_loss(ops.mirror_mini_step_operator(x, acc, step, 2), r, t)
        return tape.gradient(loss, x)

    run = runner(mini, mode)
    g0, g1 = run(0), run(1)
    want = sum(quad_dy(q, t) for q in range(N) for t in (0, 1)) / N
    out["mirror_mini_step"] = max(np.abs(g0).max(), np.abs(g1 - want).max())

    # Two pipeline micro-batches: the first through virtual_assign_add, the
    # last through the micro-step mirror (subgroup, sum).
    sub = [0, N - 1]
    acc2 = per_replica(SHAPE)

    def micro(t):
        r = keras_comm.rank()
        grads = []
        for s in (0, 1):
            x = tf.constant(inp(r)) + s
            with tf.GradientTape() as tape:
                tape.watch(x)
                if s == 0:
                    y = ops.virtual_assign_add(x, acc2)
                else:
                    y = ops.mirror_micro_step_operator(x, acc2, mean=False, group=sub)
                loss = quad_loss(y, r, s)
            grads.append(tape.gradient(loss, x))
        return grads

    g0, g1 = runner(micro, mode)(0)
    ranks = sub if ME in sub else [ME]
    want = sum(quad_dy(q, s) for q in ranks for s in (0, 1))
    out["mirror_micro_step_subgroup"] = max(np.abs(g0).max(), np.abs(g1 - want).max())

    # MiniStepAllGather, k = 2, sum.
    acc3, step3 = per_replica((SHAPE[0] * N, SHAPE[1])), per_replica((), tf.int64)

    def gather(t):
        r = keras_comm.rank()
        x = tf.constant(inp(r)) + t
        with tf.GradientTape() as tape:
            tape.watch(x)
            y = ops.mini_step_all_gather(x, acc3, step3, 2, False)
            loss = tf.reduce_sum(y) * (tf.cast(r + 1, tf.float64) + t)
        return tape.gradient(loss, x)

    run = runner(gather, mode)
    g0, g1 = run(0), run(1)
    want = sum((q + 1 + t) for q in range(N) for t in (0, 1))
    out["mini_step_all_gather_k2"] = max(np.abs(g0).max(), np.abs(g1 - want).max())

    # The same with a shard-sized accumulator, reduce-scattered every step.
    acc6, step6 = per_replica(SHAPE), per_replica((), tf.int64)

    def gather_shard(t):
        r = keras_comm.rank()
        x = tf.constant(inp(r)) + t
        with tf.GradientTape() as tape:
            tape.watch(x)
            y = ops.mini_step_all_gather(x, acc6, step6, 2, False, shard_accumulator=True)
            loss = tf.reduce_sum(y) * (tf.cast(r + 1, tf.float64) + t)
        return tape.gradient(loss, x)

    run = runner(gather_shard, mode)
    g0, g1 = run(0), run(1)
    out["mini_step_all_gather_shard_accumulator_k2"] = max(
        np.abs(g0).max(), np.abs(g1 - want).max()
    )

    # dump_local_norm: the mirror records this replica's dy norm before reducing it.
    norm = per_replica(())

    def mirror_norm(t):
        r = keras_comm.rank()
        x = tf.constant(inp(r))
        with tf.GradientTape() as tape:
            tape.watch(x)
            y = ops.mirror_operator(x, local_norm=norm)
            loss = tf.reduce_sum(tf.constant(weights(r, SHAPE)) * y)
        return tape.gradient(loss, x)

    g = runner(mirror_norm, mode)(0)
    got = strategy.experimental_local_results(norm)[0].numpy()
    want_g = sum(weights(q, SHAPE) for q in range(N)) / N
    out["mirror_local_norm"] = max(
        abs(float(got) - float(np.linalg.norm(weights(ME, SHAPE)))), np.abs(g - want_g).max()
    )

    # virtual_assign_add reduce-scattered over the world, read back by
    # virtual_accu_grad; virtual_add of a rank-valued buffer.
    shard = SHAPE[0] // N
    acc4, acc5 = per_replica((shard, SHAPE[1])), per_replica(SHAPE)

    def virtual(t):
        r = keras_comm.rank()
        x = tf.constant(inp(r))
        acc5.assign(tf.fill(SHAPE, tf.cast(100 * (r + 1), tf.float64)))
        with tf.GradientTape(persistent=True) as tape:
            tape.watch(x)
            a = ops.virtual_assign_add(x, acc4, group=list(range(N)))
            la = tf.reduce_sum(a * tf.cast(r + 1, tf.float64))
            b = ops.virtual_add(x, acc5)
            lb = tf.reduce_sum(b * 2.0)
        ga, gb = tape.gradient(la, x), tape.gradient(lb, x)
        s = x[:shard]
        with tf.GradientTape() as tape2:
            tape2.watch(s)
            lc = tf.reduce_sum(ops.virtual_accu_grad(s, acc4) * 7.0)
        return ga, gb, tape2.gradient(lc, s)

    ga, gb, gc = runner(virtual, mode)(0)
    out["virtual_assign_add_group"] = max(np.abs(ga).max(), np.abs(gc - N * (N + 1) / 2).max())
    out["virtual_add"] = float(np.abs(gb - (2.0 + 100 * (ME + 1))).max())
    return out


def results():
    """{"rank", "world", "errors": {"<op>/<mode>": max error}, "max_error", "passed"}."""
    results = {"rank": ME, "world": N, "errors": {}}
    for mode in ("function", "eager"):
        for name, (fn, reference) in stateless_cases().items():
            y, g = runner(fn, mode)(0)
            y_ref, g_ref = reference()
            err = max(float(np.abs(y - y_ref).max()), float(np.abs(g - g_ref).max()))
            results["errors"][f"{name}/{mode}"] = err
        for name, err in stateful_cases(mode).items():
            results["errors"][f"{name}/{mode}"] = float(err)
    results["max_error"] = max(results["errors"].values())
    results["passed"] = results["max_error"] < 1e-9
    return results


if __name__ == "__main__":
    write_result(results())
    finish()  # _cluster.finish: skip the slow teardown
