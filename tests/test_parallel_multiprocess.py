"""keras_comm.parallel across real worker processes (tests/workers/parallel_worker.py).

n=2: 2-way tensor parallel fit (embedding + Column/Row MLP), MoE vs a dense
simulation, the 2-stage pipeline. n=4: 2 x 2 (data x model) tensor-parallel
fit and MoE over 4 experts groups.
"""

import pytest

from _cluster import run_cluster

RTOL = 1e-4


@pytest.mark.multiprocess
@pytest.mark.parametrize("n", [2, 4])
def test_parallel_family_across_processes(n):
    result = run_cluster("workers/parallel_worker.py", n, timeout=240).check()
    for rank, r in enumerate(result.results):
        assert r["n"] == n
        tp = r["tp"]
        for key in ("loss_rel", "weights_rel", "evaluate_rel", "predict_rel"):
            assert tp[key] <= RTOL, (rank, key, tp)
        assert tp["shard_fractions"] == [1 / tp["group_size"]], (rank, tp)
        moe = r["moe"]
        assert moe["dropped"] > 0
        for name, err in moe["errors"].items():
            assert err <= 1e-9, (rank, name, moe)
        if n == 2:
            assert r["pipeline"]["weights_rel"] <= RTOL, (rank, r["pipeline"])
            assert r["pipeline"]["loss_rel"] <= RTOL, (rank, r["pipeline"])
