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
