"""ParallelOptimizer across 2 and 3 real worker processes (one launch each)."""

import pytest

from _cluster import run_cluster

# opt:accumulation_steps:zero_stage. Every optimizer, accumulation_steps and
# zero_stage appears in each launch; the in-process tests cover the rest.
CONFIGS = {
    2: ["sgd:1:0", "adam:2:1", "adamw+lso:4:2"],
    3: ["adamw:2:0", "sgd:4:1", "adam:1:2"],
}


@pytest.mark.multiprocess
@pytest.mark.parametrize("num_workers", [2, 3])
def test_parallel_optimizer_across_processes(num_workers):
    configs = CONFIGS[num_workers]
    result = run_cluster(
        "workers/parallel_optimizer_worker.py", num_workers, *configs, timeout=150
    ).check()
    for rank, r in enumerate(result.results):
        assert r["rank"] == rank and r["world"] == num_workers
        assert set(r["results"]) == set(configs)
        for config, c in r["results"].items():
            assert c["max_rel"] <= 1e-4, (rank, config, c["max_rel"])
            zero = int(config.split(":")[2])
            if zero >= 1:
                sharded, full = c["state"], c["unsharded"]
                kinds = ["optimizer", "master"] + (["accumulation"] if zero == 2 else [])
                for kind in kinds:
                    # 1/N, plus at most one padding element per variable and
                    # shard for each state tensor (Adam: 2 slots).
                    tensors = full[kind] // full["master"]
                    bound = full[kind] / num_workers + 4 * tensors * c["num_vars"]
                    assert full[kind] / num_workers <= sharded[kind] <= bound, (config, kind)
    # Every worker ends with the same weights.
    for config in configs:
        sums = {r["results"][config]["checksum"] for r in result.results}
        assert len(sums) == 1, (config, sums)
