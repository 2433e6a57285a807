"""keras_comm.parallel across real worker processes (tests/parallel/parallel_worker.py).

In the suite's shared launches (2 workers: tests/acceptance/shared_launch_worker.py;
4: tests/parallel/pipeline_worker.py), group "parallel".

n=2: 2-way tensor parallel fit (embedding + Column/Row MLP), MoE vs a dense
simulation, the 2-stage pipeline. n=4: 2 x 2 (data x model) tensor-parallel
fit, unseeded tensor-parallel and FullyShard weights built after the chief
made other layers (replicas holding the same shard agree), and MoE over 4
experts groups.
"""

import numpy as np
import pytest

from _cluster import shared_cluster

RTOL = 1e-4


@pytest.mark.multiprocess
@pytest.mark.parametrize("n", [2, 4])
def test_parallel_family_across_processes(n):
    # The suite's shared launches: 2 workers (tests/acceptance/shared_launch_worker.py),
    # 4 workers (tests/parallel/pipeline_worker.py).
    script = "acceptance/shared_launch_worker.py" if n == 2 else "parallel/pipeline_worker.py"
    launch = shared_cluster(script, n, timeout=900 if n == 2 else 1200).check()
    results = [r["parallel"] for r in launch.results]
    for rank, r in enumerate(results):
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
    if n == 4:
        _check_same_shard_values([r["same_shard"] for r in results])


def _check_same_shard_values(results):
    """The replicas holding the same shard hold the same values, bit for bit,
    after build and after fit, though the chief's layer names differ."""
    assert results[0]["paths"] != results[1]["paths"], "the chief's names must differ"
    by_shard = {}
    for rank, r in enumerate(results):
        by_shard.setdefault(r["model_coordinate"], []).append(rank)
    assert sorted(len(g) for g in by_shard.values()) == [2, 2], by_shard
    for ranks in by_shard.values():
        first = results[ranks[0]]
        for other in ranks[1:]:
            for when in ("built", "trained"):
                assert len(first[when]) == len(results[other][when]) == 6, when
                for path, a, b in zip(first["paths"], first[when], results[other][when]):
                    np.testing.assert_array_equal(
                        np.asarray(a), np.asarray(b), err_msg=f"{when} {path}: ranks {ranks[0]}, {other}"
                    )
