"""`keras_comm.parallel.Pipeline` across real worker processes (one launch of 4 workers).

The worker (tests/parallel/pipeline_worker.py) trains each configuration with
`model.fit` and compares it with the unsplit model in its own process;
here the files it saved are loaded into the one-process model.
"""

import os

import keras
import numpy as np
import pytest
from _cluster import run_cluster

from keras_comm.parallel import Pipeline
from keras_comm.parallel import full_weights

WIDTHS = (5, 6, 4, 7)


FULL = os.environ.get("KERAS_COMM_FULL_GRID") == "1"
CONFIGS = ["p4_m8_1f1b", "p4_m2_gpipe", "p2x2_m1_gpipe", "p2x2_m4_1f1b",
           "p2x2_m2_1f1b_post", "p2xtp2_m2_gpipe"] + (["p2x2_m8_gpipe"] if FULL else [])
# Configurations whose evaluate and predict are compared (every one under
# KERAS_COMM_FULL_GRID=1): each stage count, mesh, post layer and
# tensor-parallel stage once (inference runs the forward half of the table,
# which GPipe and 1F1B share).
OUTPUT_CONFIGS = set(CONFIGS) if FULL else {"p4_m8_1f1b", "p2x2_m1_gpipe", "p2x2_m2_1f1b_post", "p2xtp2_m2_gpipe"}


def _check(results, expected_configs):
    for r in results:
        assert sorted(r["exact"]) == sorted(expected_configs)
        for name, e in r["exact"].items():
            assert e["weights_rel"] <= 1e-5, (name, e)
            assert e["loss_rel"] <= 1e-5, (name, e)
            assert ("eval_rel" in e) == ("predict_rel" in e) == (name in OUTPUT_CONFIGS), (name, e)
            if name in OUTPUT_CONFIGS:
                m = int(name.split("_m")[1].split("_")[0])
                assert e["eval_rel"] <= 1e-5, (name, e)
                assert e["predict_rel"] <= 1e-5 and e["predict_rows"] == 2 * 2 * len(results) * m, (name, e)
            # Each worker holds its own stage (plus padding to the largest), not all.
            assert e["own_stage_bytes"] <= e["buffer_bytes"] < e["all_stage_bytes"], (name, e)
        assert r["resume_rel"] <= 1e-6, r
        assert r["resume_optimizer_rel"] <= 1e-6, r


# One launch of 4 workers (id kept as [4]): the 2-stage cases run on a 2 x 2
# data x pipeline mesh there (a 2-worker launch of its own cost more CPU
# than its cases).
@pytest.mark.parametrize("workers", [4])
def test_pipeline_on_workers(workers, tmp_path):
    result = run_cluster("parallel/pipeline_worker.py", workers, tmp_path, timeout=900).check()
    configs = CONFIGS
    print("worker CPU seconds by phase:", [r["cpu_seconds"] for r in result.results])
    _check(result.results, configs)
    # ZeRO-1 of each stage's optimizer state over its data group (2 x 2
    # mesh, Adam, 2 micro-batches per update): exact, each worker holds
    # half its stage buffer's moments (the optimizer's own full-size
    # slots released), and a BackupAndRestore resume is exact.
    for r in result.results:
        z = r["zero"]
        print("zero case, rank", r["rank"], z)  # optimizer bytes and peak RSS, for the record (-s)
        assert z["weights_rel"] <= 1e-5 and z["resume_rel"] <= 1e-6, z
        assert z["grouped_slot_sizes"] == [-(-z["buffer_length"] // 2)] * 2, z
        assert z["held_user_slot_elements"] == [0, 0], z
    # BatchNormalization inside both stages, trained by 1F1B's step on
    # real workers: weights and moving statistics (each stage's averaged
    # over its data group) as the unsplit model trained micro-batch by
    # micro-batch, and predict with those statistics.
    for r in result.results:
        bn = r["bn"]
        assert bn["excess"] <= 0 and bn["moving_rel"] <= 1e-5 and bn["predict_rel"] <= 1e-5, bn
        assert bn["moved"] > 1e-3, bn  # the statistics moved
    stages = {r["rank"]: r["exact"][configs[0]]["stage"] for r in result.results}
    assert sorted(stages.values()) == list(range(len(stages)))
    # The chief's files load into the one-process model (all stages on one replica).
    want = list(np.load(tmp_path / "pipe_weights.npy", allow_pickle=True))
    p = workers
    local = keras.Sequential([keras.Input((3,)), keras.layers.Dense(4),
                              Pipeline([keras.layers.Dense(WIDTHS[s], activation="tanh") for s in range(p)])])
    local.load_weights(str(tmp_path / "pipe.weights.h5"))
    for a, b in zip(full_weights(local), want):
        np.testing.assert_array_equal(a, b)
    loaded = keras.saving.load_model(str(tmp_path / "pipe.keras"))
    for a, b in zip(full_weights(loaded), want):
        np.testing.assert_array_equal(a, b)
