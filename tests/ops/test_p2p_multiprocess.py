"""Real multi-process runs of the point-to-point family (tests/ops/p2p_worker.py)."""

import pytest

from _cluster import run_cluster


@pytest.mark.multiprocess
@pytest.mark.parametrize("n", [2, 3])
def test_p2p_family_across_processes(n):
    result = run_cluster("ops/p2p_worker.py", n, timeout=240).check()
    for rank, r in enumerate(result.results):
        assert r["n"] == n
        assert len(r["errors"]) == 20  # 10 cases x (function, eager)
        bad = {k: v for k, v in r["errors"].items() if not v <= 1e-9}
        assert not bad, f"rank {rank}: {bad}"
    # The layer's timeout reaches the collective: rank 1 waits for a send that
    # never comes and fails after ~1 s instead of the 300 s default.
    assert result.results[1]["timeout_error"] == "DeadlineExceededError"
    assert result.results[1]["timeout_seconds"] < 60
    assert result.results[0]["timeout_error"] is None
