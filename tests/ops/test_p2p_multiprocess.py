"""Real multi-process runs of the point-to-point family (tests/ops/p2p_worker.py).

The cases run in the suite's shared launches of 2 and 3 workers
(tests/acceptance/shared_launch_worker.py, group "p2p"): each launch pays
TensorFlow's import and the cluster's setup once for all its groups.
"""

import pytest

from _cluster import shared_cluster


@pytest.mark.multiprocess
@pytest.mark.parametrize("n", [2, 3])
def test_p2p_family_across_processes(n):
    result = shared_cluster("acceptance/shared_launch_worker.py", n, timeout=900).check()
    results = [r["p2p"] for r in result.results]
    for rank, r in enumerate(results):
        assert r["n"] == n
        assert len(r["errors"]) == 20  # 10 cases x (function, eager)
        bad = {k: v for k, v in r["errors"].items() if not v <= 1e-9}
        assert not bad, f"rank {rank}: {bad}"
    # The layer's timeout reaches the collective: rank 1 waits for a send that
    # never comes and fails after ~1 s instead of the 300 s default.
    assert results[1]["timeout_error"] == "DeadlineExceededError"
    assert results[1]["timeout_seconds"] < 60
    assert results[0]["timeout_error"] is None
