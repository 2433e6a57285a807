"""keras_comm.parallel.FullyShard across real worker processes
(tests/parallel/fully_shard_worker.py, fully_shard_checkpoint_worker.py).

One launch of 2 workers checks everything: REAL_GRID's case of the
exactness grid (AdamW, two epochs), one fit of the MLP, the CNN and the Embedding + MultiHeadAttention +
LayerNormalization block side by side, fully sharded and trained vs the
unwrapped model in one process; then a BackupAndRestore interruption (under
Adam) and resume vs the uninterrupted run, and the files it saves; then the
resume, at another shard size, of a backup this process wrote on 3
in-process replicas (the workers are the restart: fresh processes, another
count). Then this process (no strategy) loads the workers' files into the
unwrapped model.

KERAS_COMM_FULL_GRID=1 makes that launch run REAL_GRID_FULL's cases (every
optimizer, accumulation count and mode once) and adds one launch of 4
workers running them (grid only): too costly for the suite (see
docs/fully_sharded.md, "Exactness, as tested", for its cost and result).
"""

import os

import numpy as np
import pytest

from _cluster import run_cluster
from conftest import make_strategy
import fully_shard_checkpoint_worker as ck
from fully_shard_worker import (
    REAL_GRID,
    REAL_GRID_FULL,
    RTOL,
    grid_case_name,
    grid_failures,
)

FULL = os.environ.get("KERAS_COMM_FULL_GRID") == "1"


@pytest.mark.multiprocess
def test_fully_sharded_fits_and_resumes_across_processes(tmp_path):
    # The backup to resume at another shard size: 3 in-process replicas
    # here (a 3-worker launch cost ~50 CPU-s more).
    ck.cross_backup(make_strategy(3), tmp_path)
    args = [tmp_path, "full"] if FULL else [tmp_path]
    result = run_cluster("parallel/fully_shard_worker.py", 2, *args, timeout=1200 if FULL else 600).check()
    print("worker CPU seconds by phase:", [r["cpu_seconds"] for r in result.results])
    for rank, r in enumerate(result.results):
        assert r["n"] == 2 and r["rank"] == rank
        _check_grid(r, rank, REAL_GRID_FULL if FULL else REAL_GRID)
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


def _check_grid(r, rank, cases):
    """Every case of `cases` ran, met RTOL against the unwrapped model
    (losses, weights, and evaluate and predict in the first), and left this
    replica about 1/n of each of the three models' 12 wrapped layers."""
    assert list(r["grid"]) == [grid_case_name(*c) for c in cases], r["grid"]
    assert grid_failures(r["grid"]) == [], (rank, grid_failures(r["grid"]))
    for name, got in r["grid"].items():
        assert got["replica_shard_elements"] < got["full_elements"], (rank, name, got)
        # Each fit trained the MLP, the CNN and the attention block.
        assert got["num_fully_sharded"] == 12, (rank, name, got)


@pytest.mark.multiprocess
@pytest.mark.skipif(not FULL, reason="4 worker processes: KERAS_COMM_FULL_GRID=1 (too costly for the suite)")
def test_fully_sharded_fits_on_four_processes(tmp_path):
    # One launch, REAL_GRID_FULL's cases, each the MLP, the CNN and the
    # attention block in one fit, vs the unwrapped model in each process.
    result = run_cluster("parallel/fully_shard_worker.py", 4, tmp_path, "grid-only", timeout=1500).check()
    print("worker CPU seconds by phase:", [r["cpu_seconds"] for r in result.results])
    print("grid:", result.results[0]["grid"])
    for rank, r in enumerate(result.results):
        assert r["n"] == 4 and r["rank"] == rank
        _check_grid(r, rank, REAL_GRID_FULL)


@pytest.mark.multiprocess
def test_kerashub_models_fully_sharded_across_processes(tmp_path, tmp_path_factory):
    """One launch of 2 workers (tests/parallel/fully_shard_kerashub_worker.py):
    KerasHub's GPT-2, Llama and Gemma causal LMs sharded in place, and GPT-2
    built inside `deferred_weights()`, each trained on global batches vs the
    same model trained alone (once, in this process); then `generate()`
    inside `gathered`, `.weights.h5` files both ways, and whole-model `.keras`
    files both ways (the sharded model's loaded by `keras.saving.load_model`
    as a plain model; a plain model's loaded into the sharded one)."""
    import fully_shard_kerashub_worker as hub

    # The models trained alone: once, here (shared with the in-process
    # tests of this pytest run), not in every worker.
    refs = hub.reference_dir(tmp_path_factory)
    for name in hub.MODELS:
        hub.reference(name, hub.OPTIMIZERS[name], 2, refs)
        hub.other_model_file(name, refs)
    result = run_cluster(
        "parallel/fully_shard_kerashub_worker.py", 2, tmp_path, refs, timeout=900
    ).check()
    for rank, r in enumerate(result.results):
        print(rank, r)
        assert set(r) == set(hub.MODELS) | {"gpt2-deferred"}, r
        for case, out in r.items():
            assert not hub.check(out, RTOL, 2), (rank, case, out)
        assert r["gpt2-deferred"]["unallocated_before_sharding"] is True, r
        for name in hub.MODELS:
            assert {"keras_to_plain", "keras_to_sharded"} <= set(r[name]), (name, r[name])
