"""keras_comm.parallel.FullyShard across real worker processes
(tests/workers/fully_shard_worker.py, fully_shard_checkpoint_worker.py).

One launch of 2 workers checks everything: REAL_GRID's case of the
exactness grid (AdamW, two epochs), one fit of the MLP, the CNN and the Embedding + MultiHeadAttention +
LayerNormalization block side by side, fully sharded and trained vs the
unwrapped model in one process; then a BackupAndRestore interruption (under
Adam) and resume vs the uninterrupted run, and the files it saves; then the
resume, at another shard size, of a backup this process wrote on 3
in-process replicas (the workers are the restart: fresh processes, another
count). Then this process (no strategy) loads the workers' files into the
unwrapped model.
"""

import numpy as np
import pytest

from _cluster import run_cluster
from conftest import make_strategy
from workers import fully_shard_checkpoint_worker as ck
from workers.fully_shard_worker import REAL_GRID, RTOL, grid_case_name, grid_failures


@pytest.mark.multiprocess
def test_fully_sharded_fits_and_resumes_across_processes(tmp_path):
    # The backup to resume at another shard size: 3 in-process replicas
    # here (a 3-worker launch cost ~50 CPU-s more).
    ck.cross_backup(make_strategy(3), tmp_path)
    result = run_cluster("workers/fully_shard_worker.py", 2, tmp_path, timeout=600).check()
    print("worker CPU seconds by phase:", [r["cpu_seconds"] for r in result.results])
    for rank, r in enumerate(result.results):
        assert r["n"] == 2 and r["rank"] == rank
        assert list(r["grid"]) == [grid_case_name(*c) for c in REAL_GRID], r["grid"]
        assert grid_failures(r["grid"]) == [], (rank, grid_failures(r["grid"]))
        for name, got in r["grid"].items():
            assert got["replica_shard_elements"] < got["full_elements"], (rank, name, got)
            # Each fit trained the MLP, the CNN and the attention block.
            assert got["num_fully_sharded"] == 12, (rank, name, got)
        b = r["backup"]
        assert b["restored"] == {"epoch": 1, "step": 2}, (rank, b)
        # Same worker count: the resumed run is the uninterrupted one.
        assert b["resume_weights_rel"] <= 1e-6, (rank, b)
        assert b["resume_optimizer_rel"] <= 1e-6, (rank, b)
        assert [11] in b["optimizer_shapes"], b  # d2 kernel 21 -> 11 per replica: Adam holds shards

        # 3 -> 2: every shard size changes; weights and Adam's moments
        # still follow the unwrapped model trained in one process.
        c = r["resume"]
        assert c["restored"] == {"epoch": 1, "step": 2}, (rank, c)
        assert c["shard_sizes"] == [18, 4, 4, 4, 11, 2], (rank, c)  # ceil(size / 2); 3 held ceil(size / 3)
        assert c["weights_rel"] <= RTOL, (rank, c)
        assert c["optimizer_rel"] <= RTOL, (rank, c)

    # The unwrapped model, in one process, loads the wrapped model's files.
    import keras

    full = np.load(tmp_path / "fs.full.npz")
    expected = [full[f"arr_{i}"] for i in range(len(full.files))]
    for name in ("fs.weights.h5", "fs.keras"):
        plain = ck.mlp()
        plain.compile(keras.optimizers.Adam(0.02), "mse")
        plain.load_weights(tmp_path / name)
        got = plain.get_weights()
        assert [g.shape for g in got] == [e.shape for e in expected], name
        for g, e in zip(got, expected):
            np.testing.assert_array_equal(g, e)
