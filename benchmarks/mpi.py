"""MPI reference: the same collectives through mpi4py (MPICH from PyPI).

What this machine's processes can exchange when the transport is shared
memory rather than TF's gRPC ring: the ceiling against which the TF columns
are read.

Driver side: `available()` and `run(...)` start ``mpiexec -n N python -m
benchmarks.mpi`` (MPI needs its own process manager: keras_comm.launch's
workers cannot join an MPI world, and MPICH refuses to connect two singleton
processes, "check_disjoint_lpids"). `benchmarks.run` brackets the
TensorFlow jobs with one MPI run before and one after, so drift in the
machine's load shows as the difference between the two.

Worker side (``python -m benchmarks.mpi``): same buffers (float32, nccl-tests
sizes, see `benchmarks._stats.shapes`), a barrier before each timed call,
per-iteration maximum over ranks, written by rank 0 as JSON.
"""

import argparse
import json
import os
import shutil
import subprocess
import sys
import sysconfig
import time
from pathlib import Path

from benchmarks import _stats


def mpiexec():
    """Path of the mpiexec that belongs to this Python's mpich, or None."""
    candidate = Path(sysconfig.get_path("scripts")) / "mpiexec"
    if candidate.exists():
        return str(candidate)
    return shutil.which("mpiexec")


def available():
    """(True, version) if mpi4py and an mpiexec are usable, else (False, why)."""
    try:
        from importlib import metadata

        version = metadata.version("mpi4py")
    except Exception:  # noqa: BLE001  (any failure means: not installed)
        return False, "mpi4py is not installed (pip install 'keras-comm[bench]')"
    if mpiexec() is None:
        return False, "no mpiexec found (pip install mpich)"
    return True, f"mpi4py {version}"


def run(num_workers, ops, sizes_mb, iters, warmup, out_path, env, timeout, log_file):
    """Runs the MPI benchmark as its own job; returns its JSON or {"skipped": why}."""
    ok, why = available()
    if not ok:
        return {"skipped": why}
    command = [
        mpiexec(), "-n", str(num_workers),
        sys.executable, "-m", "benchmarks.mpi",
        "--ops", ",".join(ops),
        "--sizes", ",".join(f"{s:g}" for s in sizes_mb),
        "--iters", str(iters), "--warmup", str(warmup),
        "--out", str(out_path),
    ]
    try:
        proc = subprocess.run(
            command, env=env, stdout=log_file, stderr=subprocess.STDOUT,
            timeout=timeout, stdin=subprocess.DEVNULL, check=False,
        )
    except subprocess.TimeoutExpired:
        return {"skipped": f"mpiexec timed out after {timeout} s"}
    if proc.returncode != 0 or not Path(out_path).exists():
        return {"skipped": f"mpiexec exited {proc.returncode}; see the log"}
    return json.loads(Path(out_path).read_text())


def _buffers(op, size_mb, n):
    import numpy as np

    in_shape, out_shape, size_bytes = _stats.shapes(op, size_mb, n)
    rng = np.random.default_rng(0)
    send = rng.random(in_shape, dtype=np.float32)
    recv = np.empty(out_shape, dtype=np.float32)
    return send, recv, size_bytes


def _call(comm, op, send, recv):
    if op == "all_reduce":
        comm.Allreduce(send, recv)
    elif op == "all_gather":
        comm.Allgather(send, recv)
    elif op == "reduce_scatter":
        comm.Reduce_scatter_block(send, recv)
    elif op == "all_to_all":
        comm.Alltoall(send, recv)
    elif op == "broadcast":
        comm.Bcast(send, root=0)
    else:
        raise ValueError(op)


def main(argv=None):
    parser = argparse.ArgumentParser(description="MPI collectives (run under mpiexec)")
    parser.add_argument("--ops", required=True)
    parser.add_argument("--sizes", required=True)
    parser.add_argument("--iters", type=int, required=True)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--out", required=True)
    args = parser.parse_args(argv)

    from mpi4py import MPI

    comm = MPI.COMM_WORLD
    n = comm.Get_size()
    result = {"workers": n, "library": MPI.Get_library_version().splitlines()[0].strip(), "ops": {}}
    for op in args.ops.split(","):
        result["ops"][op] = {}
        for size in args.sizes.split(","):
            send, recv, size_bytes = _buffers(op, float(size), n)
            for _ in range(args.warmup):
                _call(comm, op, send, recv)
            times = []
            for _ in range(args.iters):
                comm.Barrier()
                start = time.perf_counter()
                _call(comm, op, send, recv)
                times.append(time.perf_counter() - start)
            gathered = comm.gather(times, root=0)
            if comm.Get_rank() == 0:
                merged = _stats.per_iteration_max(gathered)
                s = _stats.summary(merged)
                s.update(_stats.bandwidths(op, size_bytes, n, s["median_s"]))
                s["size_bytes"] = size_bytes
                result["ops"][op][f"{float(size):g}"] = s
    if comm.Get_rank() == 0:
        tmp = Path(args.out).with_suffix(f".tmp{os.getpid()}")
        tmp.write_text(json.dumps(result))
        os.replace(tmp, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
