"""Real multi-process runs of the point-to-point family (tests/workers/p2p_worker.py)."""

import pytest

from _cluster import run_cluster


@pytest.mark.multiprocess
@pytest.mark.parametrize("n", [2, 3])
def test_p2p_family_across_processes(n):
    result = run_cluster("workers/p2p_worker.py", n, timeout=240).check()
    for rank, r in enumerate(result.results):
        assert r["n"] == n
        assert len(r["errors"]) == 20  # 10 cases x (function, eager)
        bad = {k: v for k, v in r["errors"].items() if not v <= 1e-9}
        assert not bad, f"rank {rank}: {bad}"
