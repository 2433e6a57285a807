"""`keras_comm.parallel.Pipeline` across real worker processes (one launch of 4 workers).

The worker (tests/parallel/pipeline_worker.py) trains each configuration with
`model.fit`; its chief also trains the unsplit model in its own process (the
reference, computed once), and every worker's weights, losses and outputs are
compared with it here. The files the chief saved are loaded into the
one-process model.
"""

import os

import keras
import numpy as np
import pytest
from _cluster import shared_cluster
from _shared import rel

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


def _relative(got, want):
    """Each worker's numbers against the chief's reference (the unsplit model)."""
    out = {"weights_rel": rel(want["weights"], got["weights"]),
           "loss_rel": abs(got["loss"] - want["loss"]) / abs(want["loss"])}
    if "evaluate" in got:
        out["eval_rel"] = max(abs(got["evaluate"][k] - want["evaluate"][k]) / abs(want["evaluate"][k])
                              for k in ("loss", "mae"))
    if "predict" in got:
        out["predict_rel"] = rel([want["predict"]], [got["predict"]])
        out["predict_rows"] = len(got["predict"])
    return out


def _check(results, expected_configs):
    references = results[0]["exact"]
    for r in results:
        assert sorted(r["exact"]) == sorted(expected_configs)
        for name, e in r["exact"].items():
            want = references[name]["reference"]
            assert ("evaluate" in want) == ("predict" in want) == (name in OUTPUT_CONFIGS), name
            e = {**e, **_relative(e, want)}
            e = {k: v for k, v in e.items() if k not in ("weights", "predict", "reference")}
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


def _batch_normalization(got, reference):
    got_w = [np.asarray(g, np.float64) for g in got["weights"]]
    want = [np.asarray(w, np.float64) for w in reference["weights"]]
    moving = reference["moving"]
    return {
        # np.allclose's rule (rtol 1e-5, atol 1e-6) as a number: <= 0 passes.
        # atol: the biases just before a BatchNormalization get a zero
        # gradient (the normalization removes their shift): their values are round-off.
        "excess": max(float(np.max(np.abs(g - w) - 1e-6 - 1e-5 * np.abs(w)))
                      for g, w in zip(got_w, want, strict=True)),
        "moving_rel": rel([w for w, mv in zip(want, moving) if mv], [g for g, mv in zip(got_w, moving) if mv]),
        "moved": float(np.max(np.abs(want[moving.index(True)]))),
        "predict_rel": rel([reference["predict"]], [got["predict"]]),
    }


# The suite's one launch of 4 workers (id kept as [4]), shared with
# test_parallel_multiprocess.py's 4-worker group and
# test_distribution_multiprocess.py's KerasHub group: the 2-stage cases run on a
# 2 x 2 data x pipeline mesh there (a 2-worker launch of its own cost more
# CPU than its cases).
@pytest.mark.multiprocess
@pytest.mark.parametrize("workers", [4])
def test_pipeline_on_workers(workers):
    launch = shared_cluster("parallel/pipeline_worker.py", workers, timeout=1200).check()
    tmp_path = launch.out_dir  # the chief's files
    results = [r["pipeline"] for r in launch.results]
    configs = CONFIGS
    print("worker CPU seconds by phase:", [r["cpu_seconds"] for r in results])
    _check(results, configs)
    # ZeRO-1 of each stage's optimizer state over its data group (2 x 2
    # mesh, Adam, 2 micro-batches per update): exact, each worker holds
    # half its stage buffer's moments (the optimizer's own full-size
    # slots released), and a BackupAndRestore resume is exact.
    zero_reference = results[0]["zero"]["reference_weights"]
    for r in results:
        z = {k: v for k, v in r["zero"].items() if k not in ("weights", "reference_weights")}
        z["weights_rel"] = rel(zero_reference, r["zero"]["weights"])
        print("zero case, rank", r["rank"], z)  # optimizer bytes and peak RSS, for the record (-s)
        assert z["weights_rel"] <= 1e-5 and z["resume_rel"] <= 1e-6, z
        assert z["grouped_slot_sizes"] == [-(-z["buffer_length"] // 2)] * 2, z
        assert z["held_user_slot_elements"] == [0, 0], z
    # BatchNormalization inside both stages, trained by 1F1B's step on
    # real workers: weights and moving statistics (each stage's averaged
    # over its data group) as the unsplit model trained micro-batch by
    # micro-batch, and predict with those statistics.
    bn_reference = results[0]["bn"]["reference"]
    for r in results:
        bn = _batch_normalization(r["bn"], bn_reference)
        assert bn["excess"] <= 0 and bn["moving_rel"] <= 1e-5 and bn["predict_rel"] <= 1e-5, bn
        assert bn["moved"] > 1e-3, bn  # the statistics moved
    stages = {r["rank"]: r["exact"][configs[0]]["stage"] for r in results}
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
