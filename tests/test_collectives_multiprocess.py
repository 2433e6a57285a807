"""The core collectives, and every mirror and virtual op, across real worker
processes (gRPC on loopback).

One launch runs both workers' checks (workers/ops_worker.py): each launch
pays TensorFlow's import and the cluster's setup. The mirror checks include
fusion: mirrors and an all-reduce sharing one `fusion` id, packed per group,
checked against the float64 reference like every other case.
"""

import pytest
from _cluster import run_cluster

# Values are O(10) in float64: errors are rounding only. The fused case
# carries one float32 piece (two dtypes in one call), hence its tolerance.
TOLERANCE = 1e-9
FLOAT32_TOLERANCE = 1e-6


@pytest.mark.multiprocess
# 3 workers only: the workers have no branch on the worker count, and 3 (uneven
# splits) covers what 2 would; 2 and 4 replicas run in-process (tests/conftest.py).
@pytest.mark.parametrize("num_workers", [3])
def test_collectives_mirror_and_virtual_ops_match_simulation(num_workers):
    result = run_cluster("workers/ops_worker.py", num_workers, timeout=300).check()
    for rank, both in enumerate(result.results):
        _check_collectives(rank, both["collectives"], num_workers)
        _check_mirror(rank, both["mirror"], num_workers)


def _check_collectives(rank, res, num_workers):
    assert res["world_size"] == num_workers
    errors = res["errors"]
    # Every op, both modes, and the subgroup cases ran.
    assert len(errors) >= 2 * 20, sorted(errors)
    assert any(name.startswith("eager/") and "subgroup" in name for name in errors)
    for mode in ("eager", "function"):
        for op in ("prod", "max", "min"):
            assert f"{mode}/reduce_{op}" in errors, sorted(errors)
    bad = {
        name: err
        for name, err in errors.items()
        if not max(err["forward"], err["gradient"])
        <= (FLOAT32_TOLERANCE if name.endswith("fused") else TOLERANCE)
    }
    assert not bad, f"rank {rank}: {bad}"


def _check_mirror(rank, r, num_workers):
    assert r["rank"] == rank and r["world"] == num_workers
    bad = {k: v for k, v in r["errors"].items() if not v < 1e-9}
    assert not bad, f"rank {rank}: mirror/virtual errors above 1e-9: {bad}"
    # Every op ran in both modes.
    assert len(r["errors"]) == 2 * 22
