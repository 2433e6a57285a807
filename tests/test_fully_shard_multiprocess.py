"""keras_comm.parallel.FullyShard across real worker processes
(tests/workers/fully_shard_worker.py, fully_shard_checkpoint_worker.py).

Two launches check everything: on 2 workers, the MLP (Adam), CNN (SGD) and
the Embedding + MultiHeadAttention + LayerNormalization block (AdamW), each
fully sharded and trained vs the unwrapped model in one process; then a
BackupAndRestore interruption and resume vs the uninterrupted run, and the
files it saves. On 3 workers (fresh processes: the restart), a 2-worker
backup resumed at another shard size. Then this process (no strategy) loads
the 2-worker files into the unwrapped model.
"""

import numpy as np
import pytest

from _cluster import run_cluster
from workers.fully_shard_worker import RTOL


@pytest.mark.multiprocess
def test_fully_sharded_fits_and_resumes_across_processes(tmp_path):
    result = run_cluster("workers/fully_shard_worker.py", 2, tmp_path, "fits", timeout=500).check()
    for rank, r in enumerate(result.results):
        assert r["n"] == 2 and r["rank"] == rank
        for name, got in r["fits"].items():
            for key in ("start_rel", "loss_rel", "weights_rel", "evaluate_rel", "predict_rel"):
                assert got[key] <= RTOL, (rank, name, key, got)
            assert got["replica_shard_elements"] < got["full_elements"], (rank, name, got)
        b = r["backup"]
        assert b["restored"] == {"epoch": 1, "step": 2}, (rank, b)
        # Same worker count: the resumed run is the uninterrupted one.
        assert b["resume_weights_rel"] <= 1e-6, (rank, b)
        assert b["resume_optimizer_rel"] <= 1e-6, (rank, b)
        assert [11] in b["optimizer_shapes"], b  # d2 kernel 21 -> 11 per replica: Adam holds shards

    # 2 -> 3 workers: every shard size changes; weights and Adam's moments
    # still follow the unwrapped model trained in one process.
    result = run_cluster("workers/fully_shard_worker.py", 3, tmp_path, "resume", timeout=300).check()
    for rank, r in enumerate(result.results):
        c = r["resume"]
        assert c["restored"] == {"epoch": 1, "step": 2}, (rank, c)
        assert c["shard_sizes"] == [12, 3, 3, 3, 7, 1], (rank, c)  # ceil(size / 3)
        assert c["weights_rel"] <= RTOL, (rank, c)
        assert c["optimizer_rel"] <= RTOL, (rank, c)

    # The unwrapped model, in one process, loads the wrapped model's files.
    import keras

    import keras_comm  # noqa: F401  (registers the layers)
    from workers import fully_shard_checkpoint_worker as ck

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
