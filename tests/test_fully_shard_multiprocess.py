"""keras_comm.parallel.FullyShard across real worker processes
(tests/workers/fully_shard_worker.py): MLP (Adam), CNN (SGD) and the
Embedding + MultiHeadAttention + LayerNormalization block (AdamW), each fully
sharded and trained on 2 workers, vs the unwrapped model in one process.
"""

import pytest

from _cluster import run_cluster
from workers.fully_shard_worker import RTOL


@pytest.mark.multiprocess
def test_fully_sharded_fits_across_processes():
    result = run_cluster("workers/fully_shard_worker.py", 2, timeout=400).check()
    for rank, r in enumerate(result.results):
        assert r["n"] == 2
        for name, got in r["fits"].items():
            for key in ("start_rel", "loss_rel", "weights_rel", "evaluate_rel", "predict_rel"):
                assert got[key] <= RTOL, (rank, name, key, got)
            assert got["replica_shard_elements"] < got["full_elements"], (rank, name, got)
