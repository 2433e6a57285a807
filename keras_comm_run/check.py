"""`keras-comm-run --check`: is the cluster wired correctly, and how fast is it?

Every worker runs this module (`python -m keras_comm_run.check`, which the
launcher starts for `--check`). It forms the MultiWorkerMirroredStrategy
cluster, then for 1, 16 and 64 MB of float32 it times the strategy's own
all-reduce (the raw collective) on every rank and runs keras_comm's
`AllReduce` layer on the same rank-encoded input. The chief prints, per size,
the time, the algorithm and bus bandwidth as nccl-tests defines them
(algbw = S / t, busbw = algbw * 2 (n - 1) / n, n replicas, t the slowest
rank's mean time), the slowest rank, and whether the layer's result equals
the raw collective's and the closed form exactly (the inputs are small
integers, exact in float32 in any summation order).

Exit status: 0 if every rank matched; 1 if a result differed; 3 if a rank
did not join within `KERAS_COMM_CHECK_JOIN_SECONDS` (the launcher passes
`--rendezvous-timeout`), with the rank(s) named: before TensorFlow starts,
every rank reports to rank 0 over TCP (`join`).

Only the worker side imports TensorFlow; the launcher never imports this
module. Kept importable without TensorFlow for the pure helpers.
"""

import json
import os
import socket
import sys
import time

from keras_comm_run.cluster import address
from keras_comm_run.cluster import socket_family as cluster_family


PROG = "keras-comm-run --check"
SIZES_MB = (1, 16, 64)
# Timed all-reduces per size (after two untimed ones).
_ITERATIONS = {1: 10, 16: 5, 64: 3}
_WARMUP = 2
EXIT_MISMATCH = 1
EXIT_JOIN = 3
JOIN_SECONDS_VAR = "KERAS_COMM_CHECK_JOIN_SECONDS"
_DEFAULT_JOIN_SECONDS = 300.0


def bandwidths(size_bytes, seconds, replicas):
    """(algbw, busbw) in GB/s (1e9 bytes) for an all-reduce, as nccl-tests."""
    algbw = size_bytes / seconds / 1e9
    return algbw, algbw * 2 * (replicas - 1) / replicas if replicas > 1 else algbw


def format_table(rows, replicas):
    """The chief's table: one row per size (see `main`)."""
    lines = [
        f"{'size':>8} {'time (ms)':>10} {'algbw (GB/s)':>13} {'busbw (GB/s)':>13}  "
        f"slowest rank (its mean; fastest rank's)"
    ]
    for row in rows:
        algbw, busbw = bandwidths(row["bytes"], row["seconds"], replicas)
        lines.append(
            f"{row['mb']:>5} MB {row['seconds'] * 1e3:>10.2f} {algbw:>13.3f} {busbw:>13.3f}  "
            f"rank {row['slowest']} ({row['seconds'] * 1e3:.2f} ms; {row['fastest_seconds'] * 1e3:.2f} ms)"
        )
    return "\n".join(lines)


def _chief_address():
    """(host, port) of rank 0 from TF_CONFIG: its TensorFlow port, free until the strategy starts."""
    workers = json.loads(os.environ["TF_CONFIG"])["cluster"]["worker"]
    host, _, port = workers[0].rpartition(":")
    return host.strip("[]"), int(port)


def join(world, rank, join_seconds):
    """When each rank joined (s after rank 0; on rank 0); exits EXIT_JOIN naming who did not.

    Before TensorFlow listens, rank 0 listens on its own TensorFlow port and
    every other rank reports there, so a missing rank is named (TensorFlow
    itself would wait for it without saying which). Rank 0 answers once all
    have come; a peer closes first, so rank 0's port is free for TensorFlow.
    """
    if world == 1:
        return [0.0]
    host, port = _chief_address()
    deadline = time.monotonic() + join_seconds
    if rank == 0:
        with socket.socket(cluster_family(host), socket.SOCK_STREAM) as server:
            server.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            server.bind((host, port))
            server.listen(world)
            server.settimeout(0.2)
            # When each rank arrived, in seconds after rank 0 began waiting.
            waited = time.monotonic()
            peers, joined = {}, {0: 0.0}
            while len(joined) < world and time.monotonic() < deadline:
                try:
                    conn, _ = server.accept()
                except socket.timeout:
                    continue
                conn.settimeout(10)
                try:
                    report = json.loads(conn.makefile().readline())
                    peers[report["rank"]] = conn
                    joined[report["rank"]] = time.monotonic() - waited
                except (OSError, ValueError, KeyError):
                    conn.close()
            missing = sorted(set(range(world)) - set(joined))
            answer = {"missing": missing}
            for conn in peers.values():
                try:
                    conn.sendall((json.dumps(answer) + "\n").encode())
                    conn.recv(1)  # the peer closes first
                except OSError:
                    pass
                conn.close()
    else:
        answer = None
        while answer is None:
            try:
                with socket.create_connection((host, port), timeout=2) as conn:
                    conn.sendall((json.dumps({"rank": rank}) + "\n").encode())
                    conn.settimeout(max(1.0, deadline - time.monotonic() + 10))
                    answer = json.loads(conn.makefile().readline())
                    joined = {}
            except (OSError, ValueError):
                if time.monotonic() > deadline:
                    answer = {"missing": [0]}
                else:
                    time.sleep(0.2)
    if answer["missing"]:
        print(
            f"{PROG}: rank {rank} of {world}: rank(s) "
            f"{', '.join(map(str, answer['missing']))} did not join within {join_seconds:g} s "
            f"(--rendezvous-timeout; rank 0 waits at {address(host, port)})",
            file=sys.stderr, flush=True,
        )
        sys.exit(EXIT_JOIN)
    return [joined.get(r, 0.0) for r in range(world)]


def main():
    rank = int(os.environ.get("RANK", "0"))
    world = int(os.environ.get("WORLD_SIZE", "1"))
    join_seconds = float(os.environ.get(JOIN_SECONDS_VAR, _DEFAULT_JOIN_SECONDS))
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    join_times = join(world, rank, join_seconds)

    import numpy as np
    import tensorflow as tf

    strategy = tf.distribute.MultiWorkerMirroredStrategy(
        communication_options=tf.distribute.experimental.CommunicationOptions(
            timeout_seconds=join_seconds))

    import keras

    import keras_comm

    replicas = strategy.num_replicas_in_sync
    task = int(strategy.cluster_resolver.task_id) if world > 1 else 0
    sum_op = tf.distribute.ReduceOp.SUM
    layer = keras_comm.layers.AllReduce("sum")

    def local(value):
        return strategy.experimental_local_results(value)[0]

    def raw_replica(v):
        # tf.identity puts the value on this replica's device, which the
        # strategy's all-reduce takes as its destination.
        return tf.distribute.get_replica_context().all_reduce(sum_op, tf.identity(v))

    def layer_replica(v):
        return layer(tf.identity(v))

    @tf.function(autograph=False)
    def raw(x):
        return strategy.run(raw_replica, args=(x,))

    @tf.function(autograph=False)
    def through_layer(x):
        return strategy.run(layer_replica, args=(x,))

    def per_rank(values):
        """Every rank's float `values` (a list), gathered with the raw collective."""
        slots = np.zeros([world, len(values)], np.float64)
        slots[task] = values
        # One worker may hold several replicas: each adds the same row.
        per_worker = replicas // max(world, 1)
        total = local(raw(tf.constant(slots)))
        return total.numpy() / per_worker

    # Sum of (task + 1) over the replicas: the closed form's factor.
    weight = float(local(raw(tf.constant(float(task + 1), tf.float32))).numpy())
    rows, mismatches = [], []
    for mb in SIZES_MB:
        size = mb << 20
        base = tf.cast(tf.range(size // 4) % 7 + 1, tf.float32)
        x = base * float(task + 1)
        for _ in range(_WARMUP):
            local(raw(x))[:1].numpy()
        iterations = _ITERATIONS[mb]
        start = time.perf_counter()
        for _ in range(iterations):
            out = raw(x)
            local(out)[:1].numpy()  # the collective has finished
        seconds = (time.perf_counter() - start) / iterations
        raw_out = local(out).numpy()
        layer_out = local(through_layer(x)).numpy()
        expected = base.numpy() * weight
        ok = bool(np.array_equal(layer_out, raw_out) and np.array_equal(raw_out, expected))
        stats = per_rank([seconds, 0.0 if ok else 1.0])
        times, bad = stats[:, 0], stats[:, 1]
        mismatches.append([r for r in range(world) if bad[r] > 0])
        rows.append({
            "mb": mb, "bytes": size, "seconds": float(times.max()),
            "slowest": int(times.argmax()), "fastest_seconds": float(times.min()),
        })
    joins = np.asarray(join_times)
    host = socket.gethostname()
    failed = sorted({r for ranks in mismatches for r in ranks})
    if task == 0:
        print(
            f"{PROG}: {world} worker(s), {replicas} replica(s), TensorFlow {tf.__version__}, "
            f"Keras {keras.__version__}, keras_comm {keras_comm.__version__}; chief on {host}",
            flush=True,
        )
        print(f"all-reduce SUM, float32, time = the slowest rank's mean of "
              f"{'/'.join(str(_ITERATIONS[m]) for m in SIZES_MB)} runs; "
              f"busbw = algbw * 2(n-1)/n, n = {replicas}", flush=True)
        print(format_table(rows, replicas), flush=True)
        print(f"last to join: rank {int(joins.argmax())} ({joins.max():.2f} s after rank 0)",
              flush=True)
        if failed:
            print(f"{PROG}: FAILED: keras_comm's AllReduce layer differs from the raw collective "
                  f"(or the closed form) on rank(s) {', '.join(map(str, failed))}", flush=True)
        else:
            print("keras_comm AllReduce layer == raw collective == closed form: yes "
                  f"({', '.join(f'{m} MB' for m in SIZES_MB)}, exact)", flush=True)
            print(f"{PROG}: passed", flush=True)
    return EXIT_MISMATCH if failed else 0


if __name__ == "__main__":
    sys.exit(main())
