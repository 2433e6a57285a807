"""The benchmark suite runs end to end and writes what the docs embed.

`python -m benchmarks.run --smoke` starts real worker processes (2 TF
workers, plus an MPI job when mpi4py is installed) with tiny sizes; the test
checks the output's structure only. Speed is never asserted.

Also unit tests of the pure helpers in `benchmarks._stats` and of the
fusion family's sizes and summary.
"""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from _cluster import REPO_DIR

sys.path.insert(0, str(REPO_DIR))

from benchmarks import _stats  # noqa: E402
from benchmarks import fusion  # noqa: E402

OPS = set(_stats.OPS)
VARIANTS = {"layer_fwd", "raw_fwd", "layer_fwd_bwd", "raw_fwd_bwd"}


@pytest.mark.parametrize(
    "op,n,factor",
    [("all_reduce", 2, 1.0), ("all_reduce", 4, 1.5), ("all_gather", 4, 0.75),
     ("reduce_scatter", 2, 0.5), ("all_to_all", 4, 0.75), ("broadcast", 4, 1.0)],
)
def test_bus_factors_are_nccl_tests(op, n, factor):
    assert _stats.bus_factor(op, n) == factor


def test_shapes_use_nccl_tests_sizes():
    # all-gather: S is the output; reduce-scatter: S is the input.
    assert _stats.shapes("all_gather", 1, 4) == ((256, 256), (1024, 256), 1 << 20)
    assert _stats.shapes("reduce_scatter", 1, 4) == ((1024, 256), (256, 256), 1 << 20)
    assert _stats.shapes("all_reduce", 1, 2) == ((1024, 256), (1024, 256), 1 << 20)
    assert _stats.rows_for(0.001, 4) == 4  # rounded up to a multiple of n


def test_per_iteration_max_and_paired_ratio():
    assert _stats.per_iteration_max([[1, 5, 3], [2, 4, 3]]) == [2, 5, 3]
    assert _stats.paired_ratio([2, 3, 4], [1, 3, 4]) == 1.0
    # The spread of the same per-iteration ratios (2, 1, 1): p10 and p90.
    assert _stats.paired_ratio_spread([2, 3, 4], [1, 3, 4]) == (1.0, 1.8)
    assert _stats.bytes_sent_per_rank("all_reduce", 1024, 4) == 1536
    assert _stats.bytes_sent_per_rank("all_to_all", 1024, 4) == 768


def test_fusion_parameters_split_the_total_evenly():
    assert fusion.parameter_shapes(8, 4) == [(512, 256)] * 8  # 8 x 512 KB
    assert fusion.parameter_shapes(128, 0.25) == [(2, 256)] * 128  # 128 x 2 KB
    assert fusion.parameter_shapes(4, 0.001) == [(1, 256)] * 4  # at least one row


def test_fusion_summary_pairs_iterations_across_ranks():
    def rank(times):
        entry = {"size_bytes": 8192, "shape": [1, 256], "collectives_per_replica": {"fused": 1},
                 "times": times}
        return {"8": {"0.25": entry}}

    rank0 = rank({"unfused": [4.0, 6.0], "fused": [1.0, 2.0], "raw_packed": [1.0, 1.0]})
    rank1 = rank({"unfused": [2.0, 8.0], "fused": [2.0, 1.0], "raw_packed": [1.0, 2.0]})
    row = fusion.summarize([rank0, rank1], 2)["rows"][0]
    # Slowest rank per iteration: unfused 4, 8; fused 2, 2; raw 1, 2.
    assert row["count"] == 8 and row["size_mb"] == 0.25
    assert row["unfused_over_fused"] == 3.0
    assert row["fused_over_raw_packed"] == 1.5


def _env_with_repo():
    """The environment with this checkout first on PYTHONPATH (for the launches)."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO_DIR), env.get("PYTHONPATH")]))
    return env


@pytest.mark.multiprocess
def test_smoke_run_writes_json_markdown_and_plots(tmp_path):
    out = tmp_path / "results"
    env = _env_with_repo()
    proc = subprocess.run(
        [sys.executable, "-m", "benchmarks.run", "--smoke", "--quiet", "--out", str(out)],
        cwd=REPO_DIR, env=env, capture_output=True, text=True, timeout=170,
    )
    log = (out / "run.log").read_text()[-4000:] if (out / "run.log").exists() else ""
    assert proc.returncode == 0, f"{proc.stdout[-2000:]}\n{proc.stderr[-4000:]}\n--- run.log ---\n{log}"

    results = json.loads((out / "benchmarks.json").read_text())
    for key in ("machine", "parameters", "collectives", "reduce_scatter", "training", "plots", "mode"):
        assert key in results, key
    assert results["mode"] == "smoke"
    assert results["machine"]["cpu_count"] >= 1
    assert results["machine"]["versions"]["tensorflow"]

    coll = results["collectives"]["2"]
    assert set(coll) == OPS
    for op, by_size in coll.items():
        for row in by_size.values():
            assert VARIANTS <= set(row["variants"])
            assert {"ratio_fwd", "ratio_fwd_bwd"} <= set(row)
            for kind in ("fwd", "fwd_bwd"):  # the run-to-run spread the plots draw
                assert row[f"ratio_{kind}_p10"] <= row[f"ratio_{kind}"] <= row[f"ratio_{kind}_p90"]
            fwd = row["variants"]["layer_fwd"]
            assert {"median_s", "algbw_GBps", "busbw_GBps", "iters"} <= set(fwd)
            assert fwd["median_s"] > 0
    assert results["reduce_scatter"][0]["ours_bytes_sent_per_rank"] > 0

    if "2" in results.get("mpi", {}):
        runs = results["mpi"]["2"]["runs"]
        assert [r["when"] for r in runs] == ["before", "after"]
        assert all(set(r.get("ops", {})) == OPS for r in runs if "skipped" not in r)

    fused = results["fusion"]
    assert fused["workers"] == 2 and "error" not in fused, fused
    for row in fused["rows"]:
        assert row["collectives_per_replica"] == {"unfused": row["count"], "fused": 1, "raw_packed": 1}
        assert set(row["variants"]) == {"unfused", "fused", "raw_packed"}
        assert row["unfused_over_fused"] > 0 and row["fused_over_raw_packed"] > 0

    training = results["training"]
    assert training["scaling"][0]["samples_per_s"] > 0
    po = training["parallel_optimizer"]
    if "skipped" not in po:
        configs = [r["config"] for r in po["rows"]]
        assert configs == results["parameters"]["po_configs"]
        for row in po["rows"]:
            assert row["state_bytes"] > 0 and row["time_per_sample_us"] > 0
            assert row["micro_batch_min_s"] <= row["micro_batch_s"] <= row["micro_batch_max_s"]
        # Plain fit's optimizer state is measured, not drawn as 0: Adam's two
        # moments, as ParallelOptimizer counts them unsharded (plus the step).
        plain = po["rows"][configs.index(None)]
        unsharded = po["rows"][configs.index([1, 0])]["unsharded_state_bytes"]["optimizer"]
        assert unsharded <= plain["state_bytes"] <= unsharded + 16, (plain, unsharded)
    for row in training["scaling"]:
        assert row["step_min_s"] <= row["step_s"] <= row["step_max_s"]

    # benchmarks/fsdp_speed.py: ZeRO-3 next to plain data parallel, bytes counted in the step.
    fsdp = results["fsdp"]["2"]
    assert "error" not in fsdp, fsdp
    rows = {r["variant"]: r for r in fsdp["rows"]}
    assert set(rows) == set(results["parameters"]["fsdp_variants"])
    for r in rows.values():
        assert r["step_min_s"] <= r["step_s"] <= r["step_max_s"] and r["cpu_s_per_step"] > 0
        # The counted bytes are the formula's, plus the loss's scalars.
        assert 1 <= r["sent_bytes_per_step"] / r["formula_bytes_per_step"] < 1.001, r
    assert rows["zero3"]["collective_ops"]["all_gather"] == 2 * rows["zero3"]["collective_ops"]["reduce_scatter"]

    # The documentation's tables (docs/results/NAME.json as --docs writes them),
    # complete, and the same when benchmarks.report redraws them from the JSON.
    from benchmarks import report

    tables = {p.stem: json.loads(p.read_text()) for p in (out / "results").glob("*.json")}
    assert {"bench_collectives_2w", "bench_layer_overhead_2w", "bench_reduce_scatter", "bench_fusion",
            "bench_fit_scaling", "fsdp_speed_tiny", "po_memory_tiny"} <= set(tables), sorted(tables)
    for name, data in tables.items():
        for key in ("title", "date", "machine", "command", "columns", "rows"):
            assert data.get(key), f"{name}: no {key!r}"
        assert "load" not in data["machine"] and str(out) not in json.dumps(data), name
        assert data["command"] == "python -m benchmarks.run --smoke", data["command"]
        keys = [row[0] for row in data["rows"]]
        assert len(set(keys)) == len(keys), f"{name}: two rows share their first cell"
        assert all(len(row) == len(data["columns"]) for row in data["rows"]), name
    redrawn = tmp_path / "redrawn"
    assert report.main([str(out / "benchmarks.json"), "--out", str(redrawn)]) == 0
    assert {p.stem: json.loads(p.read_text()) for p in (redrawn / "results").glob("*.json")} == tables

    markdown = (out / "benchmarks.md").read_text()
    assert "| op | MB |" in markdown
    assert "## 2. Layer overhead" in markdown and "## 4. Training" in markdown
    assert "## 5. Fusion groups" in markdown and "| M | MB in all |" in markdown
    assert "## 7. Fully sharded (ZeRO-3)" in markdown
    assert results["plots"]
    for plot in results["plots"]:
        path = Path(plot)
        assert path.suffix == ".png" and path.stat().st_size > 0
        assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
        assert f"]({path.name})" in markdown


def test_command_quoted_in_the_docs_leaves_out_this_machine():
    from benchmarks import run

    argv = ["--quick", "--workers", "2", "--out", "/somewhere/results", "--quiet", "--docs",
            "--job-timeout=900", "--no-mpi"]
    assert run.parse_args(argv).command == "python -m benchmarks.run --quick --workers 2 --docs --no-mpi"


def test_overlap_timeline_finds_backward_collectives_and_updates():
    from benchmarks import overlap

    ms = 1_000_000  # ns
    events = [
        # (start_ns, end_ns, name, thread line)
        (0, 100 * ms, "EagerLocalExecute: __inference_one_step_7", "python"),
        (4 * ms, 70 * ms, "EagerLocalExecute: __inference_inner_8", "python"),  # nested: part of the step
        (5 * ms, 30 * ms, "sc/gradient_tape/dense_1/MatMul:_MklMatMul", "tf_Compute/1"),
        (20 * ms, 21 * ms, "sc/allreduce/CollectiveReduceV2:CollectiveReduceV2", "tf_Compute/2"),
        (30 * ms, 60 * ms, "sc/gradient_tape/dense_0/MatMul:_MklMatMul", "tf_Compute/1"),
        (61 * ms, 62 * ms, "sc/allreduce_1/CollectiveReduceV2:CollectiveReduceV2", "tf_Compute/2"),
        (80 * ms, 81 * ms, "sc/sgd/AssignSubVariableOp:AssignSubVariableOp", "tf_Compute/1"),
        (90 * ms, 91 * ms, "sc/sgd/AssignSubVariableOp_1:AssignSubVariableOp", "tf_Compute/1"),
        # A call without backward ops (the metrics' reduction): not a step.
        (200 * ms, 210 * ms, "EagerLocalExecute: __inference_other_9", "python"),
        (201 * ms, 202 * ms, "x/CollectiveReduceV2:CollectiveReduceV2", "tf_Compute/2"),
    ]
    (step,) = overlap._summarize_timeline(events)
    assert step["step_ms"] == 100
    assert step["backward_ms"] == [5, 60]
    assert [c[:2] for c in step["collectives_ms"]] == [[20, 21], [61, 62]]
    assert step["update_ms"] == [80, 90]


def test_memory_ledger_ideal_counts_each_mode_state_and_transient():
    from benchmarks import memory_ledger

    p = 42_020_880  # the 2048-4096-4096-4096-16 MLP
    largest = 4096 * 4096 + 4096
    mib = 2**20
    plain = memory_ledger.ideal("plain", "mlp42m", 2, 32)
    assert sum(plain["state"].values()) == 16 * p
    # A 64 MiB gradient is a bucket of its own.
    assert plain["transient"]["bucket"] == 4 * 4096 * 4096
    zero1 = memory_ledger.ideal("zero1", "mlp42m", 2, 32)
    assert sum(zero1["state"].values()) == 8 * p + 8 * p // 2
    acc = memory_ledger.ideal("zero2_acc2", "mlp42m", 2, 32)
    assert acc["state"]["accumulation"] == 4 * p // 2
    zero3 = memory_ledger.ideal("zero3", "mlp42m", 4, 32)
    assert sum(zero3["state"].values()) == 16 * p // 4
    assert zero3["transient"]["gathered layer"] == 12 * largest
    pipeline = memory_ledger.ideal("pipeline", "mlp42m", 2, 32)
    assert pipeline["state"]["weights"] == 4 * (2048 * 4096 + 4096 + 4096 * 4096 + 4096)
    tp = memory_ledger.ideal("tensor_parallel", "mlp42m", 2, 32)
    replicated = 4096 + 16  # the row layers' biases
    assert tp["state"]["weights"] == 4 * ((p - replicated) // 2 + replicated)
    # No bucket is larger than every gradient together.
    tiny = memory_ledger.ideal("plain", "tiny", 2, 32)
    assert tiny["transient"]["bucket"] < mib
    with pytest.raises(ValueError, match="config"):
        memory_ledger.ideal("zero9", "tiny", 2, 32)


def test_memory_ledger_row_reports_ratio_spread_and_growth():
    from benchmarks import memory_ledger

    ranks = [
        {"rank": 0, "baseline_mib": 700.0, "peak_mib": 100.0, "after_build_mib": 50.0,
         "step_peak_mib": [90.0, 95.0, 98.0], "step_high_water_mib": [90.0, 95.0, 100.0]},
        {"rank": 1, "baseline_mib": 710.0, "peak_mib": 80.0, "after_build_mib": 50.0,
         "step_peak_mib": [70.0, 75.0, 80.0], "step_high_water_mib": [70.0, 75.0, 80.0]},
    ]
    row = memory_ledger.row("plain", "tiny", 2, 32, ranks)
    assert row["peak_mib"] == 100.0 and row["peak_mib_per_rank"] == [100.0, 80.0]
    assert row["rank_spread"] == pytest.approx(0.2)
    assert row["growth_after_first_mib"] == 5.0
    assert row["ratio"] == pytest.approx(100.0 / row["ideal_mib"])
    assert "| plain fit | 100 (100 / 80) |" in memory_ledger.markdown([row])[2]


def test_memory_pipeline_stages_split_the_layers_in_order():
    from benchmarks import memory

    assert memory.pipeline_stages("mlp42m", 2) == [
        [(4096, "relu"), (4096, "relu")], [(4096, "relu"), (16, None)]]
    assert [len(s) for s in memory.pipeline_stages("mlp42m", 3)] == [2, 1, 1]
    with pytest.raises(ValueError, match="stages"):
        memory.pipeline_stages("tiny", 4)


@pytest.mark.multiprocess
def test_memory_ledger_runs_each_mode_in_fresh_workers(tmp_path):
    out = tmp_path / "ledger.jsonl"
    env = _env_with_repo()
    proc = subprocess.run(
        [sys.executable, "-m", "benchmarks.memory_ledger", "--model", "tiny", "--steps", "3",
         "--configs", "zero1", "pipeline", "--out", str(out), "--timeout", "150"],
        cwd=REPO_DIR, env=env, capture_output=True, text=True, timeout=320,
    )
    assert proc.returncode == 0, f"{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert [r["config"] for r in rows] == ["zero1", "pipeline"]
    for r in rows:
        assert len(r["peak_mib_per_rank"]) == 2 and len(r["step_peak_mib"]) == 3
        assert r["peak_mib"] > 0 and r["ideal_mib"] > 0
    assert "| ZeRO-1 |" in proc.stdout
