"""benchmarks/kerashub_capped.py's pure parts and the memory cap it runs under.

The benchmark's runs (4 workers of a KerasHub Llama, minutes each) are not
part of the suite; its docstring and docs/large_models.md ("Memory") give
the commands. Here: the parameter count and the ideal it reports next to
each measured peak, the table it makes of the rank files, and the cap
itself (`benchmarks.fsdp_capped.install_exit_cap`) stopping a process that
passes it, with exit code 137 and its record.
"""

import json
import subprocess
import sys

import pytest

from _cluster import REPO_DIR

sys.path.insert(0, str(REPO_DIR))

from benchmarks import kerashub_capped as K  # noqa: E402

MIB = 2**20


@pytest.mark.parametrize("name", sorted(K.CONFIGS))
def test_parameter_count_is_kerashub_llamas(name):
    import keras_hub
    import numpy as np

    from keras_comm import parallel

    with parallel.deferred_weights():  # shapes only: nothing is allocated
        backbone = keras_hub.models.LlamaBackbone(dropout=0.0, **K.CONFIGS[name])
        model = keras_hub.models.LlamaCausalLM(backbone=backbone, preprocessor=None)
    sizes = [int(np.prod(v.shape)) for v in model.weights]
    assert K.params_of(K.CONFIGS[name]) == (sum(sizes), max(sizes))


def test_ideal_counts_state_at_the_stored_size_and_the_largest_transient():
    config = K.CONFIGS["llama48m"]
    params, largest = K.params_of(config)
    plain = K.ideal("plain", config, 4, 2, 32)
    layout = K.ideal("layout", config, 4, 2, 32)
    fully = K.ideal("fully_shard", config, 4, 2, 32)
    logits = 2 * 4 * 2 * 32 * config["vocabulary_size"]
    assert sum(plain["state"].values()) == 16 * params
    assert sum(layout["state"].values()) == 16 * (-(-params // 4))
    assert plain["transient"] == {"logits": logits} == layout["transient"]
    # FullyShard gathers a weight whole: the table (16384 x 512) and its gradient.
    assert fully["transient"] == {"gathered weight": 8 * largest}
    assert fully["total"] == sum(fully["state"].values()) + 8 * largest


def _rank(mode, phase, rank, **extra):
    base = {"mode": mode, "phase": phase, "model": "llama48m", "rank": rank, "workers": 2,
            "cap_mib": 2400.0, "per_replica_batch": 2, "seq": 32, "peak_mib": 1500.0 + rank,
            "peak_above_baseline_mib": 600.0 + 10 * rank, "stored_mib": 138.0,
            "median_step_s": 4.0}
    return {**base, **extra}


def test_table_rows_from_rank_files(tmp_path):
    files = {
        "plain.first.rank1.capped.json": {"rank": 1, "mode": "plain", "phase": "first",
                                          "model": "llama48m", "cap_mib": 2400.0,
                                          "stopped_at_rss_mib": 2401.0},
        "layout.first.rank0.json": _rank("layout", "first", 0),
        "layout.first.rank1.json": _rank("layout", "first", 1),
        "layout.resume.rank0.json": _rank("layout", "resume", 0, peak_above_baseline_mib=700.0,
                                          resumed_vs_uninterrupted_rel=3e-7),
        "layout.resume.rank1.json": _rank("layout", "resume", 1,
                                          resumed_vs_uninterrupted_rel=1e-7),
    }
    for name, data in files.items():
        (tmp_path / name).write_text(json.dumps(data))
    t = K.table(str(tmp_path))
    assert t["columns"] == K.COLUMNS and t["cap_mib"] == [2400.0]
    plain, layout = t["rows"]
    assert plain[:3] == ["plain", "stopped by the cap (2400 MiB)", "rank 1: > 2400"]
    ideal = K.ideal("layout", K.CONFIGS["llama48m"], 2, 2, 32)["total"] / MIB
    assert layout == ["layout", "trained 2 epochs, saved, resumed from its epoch-1 backup",
                      "1500 / 1501", "700", f"{ideal:.0f}", f"{700 / ideal:.1f}", "138", "4.0",
                      "3.0e-07"]


def test_exit_cap_stops_a_process_that_passes_it(tmp_path):
    record = tmp_path / "capped.json"
    code = (
        "import time\n"
        "from benchmarks import fsdp_capped\n"
        f"fsdp_capped.install_exit_cap(64, {str(record)!r}, {{'rank': 0, 'mode': 'test'}})\n"
        "blocks = []\n"
        "for _ in range(40):\n"
        "    blocks.append(bytearray(8 << 20))\n"  # touched: resident
        "    time.sleep(0.02)\n"
        "print('not stopped')\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], cwd=REPO_DIR, capture_output=True,
                          text=True, timeout=60)
    assert proc.returncode == 137, proc.stdout + proc.stderr
    assert "not stopped" not in proc.stdout and "exceeded the cap" in proc.stdout
    data = json.loads(record.read_text())
    assert data["mode"] == "test" and data["cap_mib"] == 64 and data["stopped_at_rss_mib"] > 64
