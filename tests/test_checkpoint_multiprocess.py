"""Kill a worker mid-training, relaunch, and end with an uninterrupted run's weights.

Two workers train with `keras_comm.callbacks.BackupAndRestore(save_freq=5)`;
rank 1 SIGKILLs itself mid-epoch on the first run of each configuration
(stock fit, then ParallelOptimizer zero_stage=1 with accumulation 2). Three
launches: plain killed; plain resumed and finished, po1 killed; po1 resumed
and finished. Each finished run is compared in its own cluster with an
uninterrupted fit of the same model.
"""

import json
import time

import pytest

from _cluster import run_cluster

CONFIGS = ["plain", "po1"]
STEPS, EPOCHS, KILL_STEP = 12, 2, 18  # as in workers/checkpoint_worker.py


def _killed_launch(state, killed_config):
    started = time.time()
    result = run_cluster("workers/checkpoint_worker.py", 2, state, *CONFIGS, timeout=240)
    finished = time.time()
    assert result.returncode == 128 + 9, result.tail()
    assert "worker rank 1 failed (killed by SIGKILL)" in result.output, result.tail()
    kill = json.loads((state / f"killed-{killed_config}").read_text())
    assert kill["step"] == KILL_STEP
    return {"time_to_exit": finished - kill["time"], "launch_seconds": finished - started}


@pytest.mark.multiprocess
def test_resume_after_sigkill_matches_uninterrupted(tmp_path):
    state = tmp_path
    timings = [_killed_launch(state, "plain"), _killed_launch(state, "po1")]
    result = run_cluster("workers/checkpoint_worker.py", 2, state, *CONFIGS, timeout=240).check()
    for rank, r in enumerate(result.results):
        assert r["rank"] == rank and r["world"] == 2
        for config in CONFIGS:
            c = r["results"][config]
            assert c["max_rel"] <= 1e-6, (rank, config, c)
            assert c["optimizer_max_rel"] <= 1e-6, (rank, config, c)
            # plain: backups after global steps 5, 10, 15; po1: a save inside an
            # accumulation window waits for its update (6, 12 = epoch end, 18).
            expected = {"plain": {"epoch": 1, "step": 3}, "po1": {"epoch": 1, "step": 6}}[config]
            assert c["restored"] == expected, (config, c["restored"])
            done = expected["epoch"] * STEPS + expected["step"]
            assert c["trained_after_restore"] == EPOCHS * STEPS - done
            assert c["trained_uninterrupted"] == EPOCHS * STEPS
            assert c["backup_dir_removed"]
    print("timings:", timings, "results:", result.results[0]["results"])
    for t in timings:
        assert t["time_to_exit"] < 20, timings


# --- sharded state: tensor-parallel, embedding, MoE, ZeRO -------------------

SHARDED_CONFIGS = ["tp", "emb_moe", "tp_po1"]


@pytest.mark.multiprocess
def test_sharded_state_round_trips_exactly(tmp_path):
    # Launch 1 trains each configuration and is interrupted mid-run (backups
    # kept); launch 2 restarts from them, finishes, and compares with an
    # uninterrupted run; then save_weights / .keras round trips.
    run_cluster("workers/sharded_checkpoint_worker.py", 2, tmp_path, "interrupt",
                timeout=300).check()
    result = run_cluster("workers/sharded_checkpoint_worker.py", 2, tmp_path, "resume",
                         timeout=300).check()
    print("sharded results:", json.dumps(result.results))
    for rank, r in enumerate(result.results):
        assert r["rank"] == rank and r["world"] == 2
        for config in SHARDED_CONFIGS:
            c = r["results"][config]
            # epoch saves: after epoch 0 (global step 6); po1 saves every 4 steps: step 8.
            expected = {"epoch": 1, "step": 2} if config == "tp_po1" else {"epoch": 1, "step": 0}
            assert c["restored"] == expected, (rank, config, c)
            for key in ("resume_max_rel", "resume_optimizer_max_rel", "save_weights_max_rel",
                        "save_weights_optimizer_max_rel", "keras_max_rel",
                        "keras_optimizer_max_rel"):
                assert c[key] == 0.0, (rank, config, key, c)

    # The files are standard full-size weights: the same model in one
    # process (no strategy: one shard per weight) loads them unchanged.
    import keras
    import numpy as np

    import keras_comm  # noqa: F401  (registers the layers)

    for config in SHARDED_CONFIGS:
        full = np.load(tmp_path / f"{config}.full.npz")
        expected = [full[f"arr_{i}"] for i in range(len(full.files))]
        model = keras.models.load_model(tmp_path / f"{config}.keras")
        for load in (None, f"{config}.weights.h5"):
            if load is not None:
                model.set_weights([np.zeros_like(e) for e in expected])
                model.load_weights(tmp_path / load)
            got = model.get_weights()
            assert [g.shape for g in got] == [e.shape for e in expected], load
            for g, e in zip(got, expected):
                np.testing.assert_array_equal(g, e)


# --- damaged backups and workers that see different files -------------------


@pytest.mark.multiprocess
def test_backup_damage_and_agreement_across_workers(tmp_path):
    # Before: a torn training_metadata.json failed fit with JSONDecodeError,
    # the previous backup was named only inside it, and each worker restored
    # from its own view of backup_dir (per-worker directories resumed the
    # workers at different steps).
    result = run_cluster("workers/backup_agreement_worker.py", 2, tmp_path, timeout=400).check()
    print("agreement results:", json.dumps(result.results))
    latest, previous = {"epoch": 1, "step": 2}, {"epoch": 0, "step": 4}
    for rank, r in enumerate(result.results):
        c = r["results"]
        assert c["files"] == ["ckpt-0-4.json", "ckpt-0-4.weights.h5", "ckpt-1-2.json",
                              "ckpt-1-2.weights.h5", "training_metadata.json"]
        # Shared directory, each file of the backup truncated in turn.
        assert c["intact"] == {"restored": latest, "warnings": []}
        assert c["metadata"] == {"restored": latest, "warnings": []}
        assert c["previous_weights"] == {"restored": latest, "warnings": []}
        assert c["latest_record"]["restored"] == previous
        assert c["latest_weights"]["restored"] == previous
        if rank == 0:  # the chief decides, and warns
            assert "cannot be read" in c["latest_record"]["warnings"][0]
            assert "falling back to the backup of epoch 0, step 4" in (
                c["latest_weights"]["warnings"][0])
        assert "no usable backup" in c["both_weights"]["error"]
        # Per-worker directories: worker 1 follows the chief's choice when it
        # has that file, and every worker fails naming worker 1 otherwise.
        assert c["only_weights"] == {"restored": latest, "warnings": []}
        for case, why in (("empty", "is missing"), ("different", "not the file that was saved")):
            error = c[case]["error"]
            assert "cannot all restore the backup the chief chose" in error, (case, error)
            assert "replica 1:" in error and "replica 0:" not in error, (case, error)
            if rank == 1:
                assert why in error, (case, error)
