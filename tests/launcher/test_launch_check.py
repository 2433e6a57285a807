"""`keras-comm-run --check` on real workers: the all-reduce table, the layer
against the raw collective, and a worker that cannot join."""

import os
import re
import signal
import subprocess
import time
from pathlib import Path

import pytest

from _cluster import LAUNCHER, cluster_env
from keras_comm_run import check

pytestmark = pytest.mark.multiprocess


def test_bandwidth_follows_nccl_tests():
    # 64 MB in 0.1 s: algbw 0.671 GB/s; busbw x 2(n-1)/n.
    algbw, busbw = check.bandwidths(64 << 20, 0.1, 4)
    assert algbw == pytest.approx((64 << 20) / 0.1 / 1e9)
    assert busbw == pytest.approx(algbw * 1.5)
    assert check.bandwidths(1 << 20, 1.0, 1) == (pytest.approx(1.048576e-3),) * 2


def test_check_on_two_workers(tmp_path):
    proc = subprocess.run(
        [*LAUNCHER, "-n", "2", "--check", "--timeout", "300"], env=cluster_env(tmp_path),
        stdin=subprocess.DEVNULL, capture_output=True, text=True, timeout=360,
    )
    print(proc.stdout)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    out = proc.stdout
    assert "[rank 0] keras-comm-run --check: 2 worker(s), 2 replica(s)" in out
    rows = re.findall(r"\[rank 0\]\s+(\d+) MB\s+([\d.]+)\s+([\d.]+)\s+([\d.]+)\s+rank (\d)", out)
    assert [int(r[0]) for r in rows] == [1, 16, 64], out
    for mb, ms, algbw, busbw, slowest in rows:
        # n = 2: busbw = algbw; algbw = S / t.
        assert float(busbw) == pytest.approx(float(algbw), abs=2e-3)
        assert float(algbw) == pytest.approx((int(mb) << 20) / (float(ms) / 1e3) / 1e9, rel=0.02)
        assert slowest in "01"
    assert "keras_comm AllReduce layer == raw collective == closed form: yes" in out
    assert "[rank 0] keras-comm-run --check: passed" in out
    assert "[rank 1]" not in out  # the chief reports for everyone


def _worker_pid(launcher_pid, rank, timeout=60):
    """The pid of the launcher's child whose environment has RANK=`rank`."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        for child in Path(f"/proc/{launcher_pid}/task/{launcher_pid}/children").read_text().split():
            try:
                environ = Path(f"/proc/{child}/environ").read_bytes().split(b"\0")
            except OSError:
                continue
            if f"RANK={rank}".encode() in environ:
                return int(child)
        time.sleep(0.01)
    raise AssertionError(f"no worker of rank {rank}")


def test_check_names_a_worker_that_cannot_join(tmp_path):
    # Rank 1 is frozen before it can join: rank 0 gives up after the
    # rendezvous timeout and names it; the launcher exits non-zero. The ranks
    # join before TensorFlow starts (a fraction of a second when they can),
    # so the timeout is short: waiting it out is this test's cost.
    proc = subprocess.Popen(
        [*LAUNCHER, "-n", "2", "--check", "--rendezvous-timeout", "5", "--timeout", "200"],
        env=cluster_env(tmp_path), stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )
    frozen = None
    try:
        frozen = _worker_pid(proc.pid, 1)
        os.kill(frozen, signal.SIGSTOP)
        start = time.monotonic()
        out, err = proc.communicate(timeout=240)
        elapsed = time.monotonic() - start
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
        if frozen is not None:
            try:
                os.kill(frozen, signal.SIGKILL)
            except ProcessLookupError:
                pass
    print(out[-2000:], err[-3000:])
    assert proc.returncode == check.EXIT_JOIN, err[-3000:]
    assert ("[rank 0] keras-comm-run --check: rank 0 of 2: rank(s) 1 did not join within 5 s"
            in err)
    assert "keras-comm-run: worker rank 0 failed (exit code 3)" in err
    assert elapsed < 5 + 60, elapsed
