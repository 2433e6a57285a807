"""Mirror and virtual ops across real worker processes (2 and 3 workers).

Includes fusion: mirrors and an all-reduce sharing one `fusion` id, packed
per group, checked against the float64 reference like every other case.
"""

import pytest

from _cluster import run_cluster


@pytest.mark.multiprocess
# 3 workers only: the worker has no branch on the worker count, and 3 (uneven
# splits) covers what 2 would; 2 and 4 replicas run in-process (tests/conftest.py).
@pytest.mark.parametrize("num_workers", [3])
def test_mirror_and_virtual_ops_across_processes(num_workers):
    result = run_cluster("workers/mirror_worker.py", num_workers, timeout=240).check()
    for rank, r in enumerate(result.results):
        assert r["rank"] == rank and r["world"] == num_workers
        bad = {k: v for k, v in r["errors"].items() if not v < 1e-9}
        assert not bad, f"rank {rank}: errors above 1e-9: {bad}"
        # Every op ran in both modes.
        assert len(r["errors"]) == 2 * 22
