"""A KerasHub Llama that one worker cannot hold, trained on 4 worker processes
under a per-process memory cap (benchmarks/kerashub_capped.py is the worker).

Every worker may grow its resident memory by at most BUDGET_MIB above what
it holds before the model is built (the cap: a watchdog thread, exit 137
once exceeded). The model's float32 weights, gradients and Adam's two slots
alone need more than that budget whole and far less split four ways. Three
runs:

* the unsharded model (one process, data-parallel build) is stopped by the
  cap: exit 137 and its ``.capped.json`` record;
* on 4 workers, the model built under
  ``ModelParallel(layout_map=LlamaBackbone.get_layout_map(mesh))`` on a
  (1, 4) mesh trains two epochs, backs up and saves under the same cap;
* on 4 workers, the model built inside ``parallel.deferred_weights()`` then
  ``fully_shard`` does the same.

With sharding removed (a layout map or `fully_shard` that keeps weights
whole), the 4-worker runs hold what the unsharded run holds and stop at the
cap.
"""

import json
import os
import subprocess
import sys

import pytest

from _cluster import REPO_DIR
from _cluster import cluster_env
from _cluster import run_cluster

sys.path.insert(0, str(REPO_DIR))
from benchmarks import kerashub_capped as K  # noqa: E402

MODEL = "llama12m"
WORKERS = 4
BUDGET_MIB = 400
COMMON = ["--model", MODEL, "--budget-mib", BUDGET_MIB, "--steps", 1]


def test_the_budget_lies_between_the_sharded_and_the_unsharded_state():
    config = K.CONFIGS[MODEL]
    whole = K.ideal("plain", config, WORKERS, 2, 32)["state"]
    split = K.ideal("layout", config, WORKERS, 2, 32)["state"]
    assert sum(split.values()) / 2**20 < BUDGET_MIB / 2 < BUDGET_MIB < sum(whole.values()) / 2**20


@pytest.mark.multiprocess
def test_unsharded_llama_is_stopped_by_the_cap(tmp_path):
    env = cluster_env(tmp_path)
    env.pop("TF_CONFIG", None)
    proc = subprocess.run(
        [sys.executable, "-m", "benchmarks.kerashub_capped", "--mode", "plain",
         "--dir", str(tmp_path), *map(str, COMMON)],
        cwd=REPO_DIR, env=env, capture_output=True, text=True, timeout=300,
    )
    record = tmp_path / "plain.first.rank0.capped.json"
    assert proc.returncode == 137, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert json.loads(record.read_text())["budget_mib"] == BUDGET_MIB


@pytest.mark.multiprocess
@pytest.mark.parametrize("mode", ["layout", "fully_shard"])
def test_sharded_llama_trains_and_saves_under_the_cap_on_4_workers(tmp_path, mode):
    script = os.path.join(REPO_DIR, "benchmarks", "kerashub_capped.py")
    result = run_cluster(script, WORKERS, "--mode", mode, "--dir", tmp_path, *COMMON,
                         timeout=400, out_dir=tmp_path)
    capped = sorted(p.name for p in tmp_path.glob(f"{mode}.first.rank*.capped.json"))
    assert result.returncode == 0 and not capped, (capped, result.tail())
    ranks = [json.loads((tmp_path / f"{mode}.first.rank{r}.json").read_text())
             for r in range(WORKERS)]
    whole = K.params_of(K.CONFIGS[MODEL])[0] * 4 * 3 / 2**20  # weights + Adam's slots
    for r in ranks:
        assert r["workers"] == WORKERS and r["epochs_run"] == 2, r
        assert r["peak_above_baseline_mib"] <= BUDGET_MIB, r
        # Each worker stores its shards: well under the whole weights and slots.
        assert r["stored_mib"] < 0.4 * whole, (r["stored_mib"], whole)
    assert (tmp_path / f"{mode}.uninterrupted.weights.h5").exists()
