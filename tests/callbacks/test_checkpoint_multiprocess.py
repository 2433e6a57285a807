"""Checkpoints across real worker processes, in three launches of 2 workers.

All three checks run in the same three launches (callbacks/checkpoint_launch_worker.py):
each launch pays TensorFlow's import and the cluster's setup (~8 CPU-seconds
per process), and the SIGKILL check needs three launches anyway.

- SIGKILL: two workers train with
  `keras_comm.callbacks.BackupAndRestore(save_freq=5)`; rank 1 SIGKILLs
  itself mid-epoch on the first run of each configuration (stock fit, then
  ParallelOptimizer zero_stage=1 with accumulation 2): launch 1 kills plain;
  launch 2 resumes and finishes plain, kills po1; launch 3 resumes and
  finishes po1. Each finished run is compared in its own cluster with an
  uninterrupted fit of the same model.
- Sharded state (tensor-parallel, embedding, MoE, ZeRO): interrupted in
  launch 1, resumed and round-tripped in launch 3.
- Damaged backups and workers that see different files: launch 2.
"""

import json
import time
import traceback

import pytest

from _cluster import run_cluster

CONFIGS = ["plain", "po1"]
STEPS, EPOCHS, KILL_STEP = 12, 2, 18  # as in callbacks/checkpoint_worker.py
WORKER = "callbacks/checkpoint_launch_worker.py"


def _killed_launch(state, launch, killed_config):
    started = time.time()
    result = run_cluster(WORKER, 2, state, launch, timeout=300)
    finished = time.time()
    assert result.returncode == 128 + 9, result.tail()
    assert "worker rank 1 failed (killed by SIGKILL)" in result.output, result.tail()
    kill = json.loads((state / "sigkill" / f"killed-{killed_config}").read_text())
    assert kill["step"] == KILL_STEP
    return {"time_to_exit": finished - kill["time"], "launch_seconds": finished - started}


@pytest.mark.multiprocess
def test_checkpoints_across_workers(tmp_path):
    # One test, not three sharing a module fixture: under pytest-xdist the
    # three could run on different pytest workers, each repeating the launches.
    timings = [_killed_launch(tmp_path, 1, "plain"), _killed_launch(tmp_path, 2, "po1")]
    result = run_cluster(WORKER, 2, tmp_path, 3, timeout=300).check()
    launches = {"results": result.results, "timings": timings, "state": tmp_path}
    # Every check runs (one failing does not hide the others' outcome).
    failed = {}
    for check in (_check_resume_after_sigkill_matches_uninterrupted,
                  _check_sharded_state_round_trips_exactly,
                  _check_backup_damage_and_agreement_across_workers):
        try:
            check(launches)
        except Exception as e:  # noqa: BLE001  (an IndexError in a check is a failure too)
            failed[check.__name__] = "".join(traceback.format_exception(e))
    if failed:
        raise AssertionError("\n".join(f"--- {name} ---\n{tb}" for name, tb in failed.items()))


def _check_resume_after_sigkill_matches_uninterrupted(launches):
    for rank, all_checks in enumerate(launches["results"]):
        r = all_checks["sigkill"]
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
    timings = launches["timings"]
    print("timings:", timings, "results:", launches["results"][0]["sigkill"]["results"])
    for t in timings:
        assert t["time_to_exit"] < 20, timings


# --- sharded state: tensor-parallel, embedding, MoE, ZeRO -------------------

SHARDED_CONFIGS = ["tp", "emb_moe", "tp_po1"]


def _check_sharded_state_round_trips_exactly(launches):
    # Launch 1 trains each configuration and is interrupted mid-run (backups
    # kept); launch 3 restarts from them, finishes, and compares with an
    # uninterrupted run; then save_weights / .keras round trips.
    results = [r["sharded"] for r in launches["results"]]
    tmp_path = launches["state"] / "sharded"
    print("sharded results:", json.dumps(results))
    for rank, r in enumerate(results):
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


def _check_backup_damage_and_agreement_across_workers(launches):
    # Before: a torn training_metadata.json failed fit with JSONDecodeError,
    # the previous backup was named only inside it, and each worker restored
    # from its own view of backup_dir (per-worker directories resumed the
    # workers at different steps).
    results = [r["agreement"] for r in launches["results"]]
    print("agreement results:", json.dumps(results))
    latest, previous = {"epoch": 1, "step": 2}, {"epoch": 0, "step": 4}
    for rank, r in enumerate(results):
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
