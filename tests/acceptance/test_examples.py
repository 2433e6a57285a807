"""Every example in examples/ run on real worker processes, against one process.

Each example trains across 2 workers (pipeline.py: 3; keras_comm/launch.py,
via `_cluster.run_cluster`), then its chief trains the same model on the
same global batches in a single process and writes both metrics with
``--results``; every worker must exit 0 (the launcher's exit code) and none
may leave while the chief still runs (`_common.finish`). One epoch on the first 256 training digits
(``--train-samples``: 4 steps of 64, 8 of 32 for halo_exchange_conv) keeps
each launch short; the full test set is still evaluated.

Tolerances, and why they are this tight: with exact gradients the two runs
take the same optimizer steps up to float32 round-off (a relative error of
~1e-7 per step, measured 1e-7..3e-6 on the final weights after these short
runs). So the weights must agree to 1e-4 relative, and the test accuracy --
an argmax over the test set -- may differ only where a sample's two top
logits are within round-off of a tie: at most one sample. A wrong backward
rule (a missing or doubled all-reduce, a lost halo gradient) moves the
weights by 1e-2 or more within a few steps and fails the weight check.
"""

import json
import subprocess
import sys
from pathlib import Path

import pytest

from _cluster import REPO_DIR, run_cluster

EXAMPLES = REPO_DIR / "examples"
WEIGHT_RTOL = 1e-4

# (script, extra flags[, workers]): short runs of every example, on 2 workers
# unless a third item says otherwise.
RUNS = {
    # Plain fit is README's first command (run by CI as is); here fit with
    # ParallelOptimizer, which covers more.
    "data_parallel_zero1_accumulation": (
        "data_parallel.py", ["--accumulation-steps", "2", "--zero-stage", "1"],
    ),
    "tensor_parallel_mlp": ("tensor_parallel_mlp.py", []),
    "mixture_of_experts": ("mixture_of_experts.py", []),
    # docs/examples.md's 3-worker command (its block is not run by test_docs:
    # this is it): stages of unequal size (1, 1 and 2 blocks), and three
    # workers leaving while the chief runs the reference (the exit race
    # `_common.finish` closes).
    "pipeline": ("pipeline.py", ["--micro-batches", "4", "--batch-size", "48", "--show-memory"], 3),
    "halo_exchange_conv": ("halo_exchange_conv.py", []),
    "custom_training_loop": ("custom_training_loop.py", []),
    "fully_sharded": ("fully_sharded.py", []),
    # docs/checkpointing.md's script: interrupted in the second epoch (after its third step), resumed
    # from a mid-epoch backup by a fresh model, against one uninterrupted process.
    "checkpointing": ("checkpointing.py", ["--epochs", "2", "--save-freq", "2", "--interrupt-at", "1", "2"]),
    "checkpointing_fully_shard": (
        "checkpointing.py", ["--epochs", "2", "--save-freq", "2", "--interrupt-at", "1", "2", "--fully-shard"],
    ),
}
QUICK = ["--epochs", "1", "--train-samples", "256"]

# Test-set size of every example (20% of scikit-learn's 1,797 digits);
# one sample of accuracy is 1/360.
TEST_SAMPLES = 360


@pytest.mark.parametrize("script", sorted({run[0] for run in RUNS.values()}))
def test_help(script):
    """--help answers without TensorFlow and lists the common flags."""
    out = subprocess.run(
        [sys.executable, str(EXAMPLES / script), "--help"],
        capture_output=True, text=True, timeout=60, check=True,
    ).stdout
    for flag in ("--epochs", "--batch-size", "--learning-rate", "--seed", "--results", "--train-samples"):
        assert flag in out, f"{script} --help lacks {flag}"


@pytest.mark.multiprocess
@pytest.mark.parametrize("name", list(RUNS))
def test_example_matches_single_process(name, tmp_path):
    script, flags, workers = (*RUNS[name], 2)[:3]
    results_path = Path(tmp_path) / "results.json"
    run = run_cluster(EXAMPLES / script, workers, *QUICK, *flags, "--results", results_path, timeout=150)
    # The launcher's exit code is 0 only if every worker exited 0.
    assert run.returncode == 0, f"{script} failed:\n{run.tail()}"
    # No worker left while another still needed it: TensorFlow's
    # coordination service logs this when a worker vanishes early.
    assert "have crashed" not in run.output, f"{script}: a worker exited early:\n{run.tail()}"
    results = json.loads(results_path.read_text())
    assert results["replicas"] == workers
    # The chief printed the comparison line.
    assert f"test accuracy, {workers} workers:" in run.output and "single process:" in run.output
    assert results["max_weight_rel_diff"] < WEIGHT_RTOL, results
    assert abs(results["accuracy"] - results["single_process_accuracy"]) <= 1 / TEST_SAMPLES + 1e-9, results
    if "resumed_at" in results:  # checkpointing.py: resumed inside the second epoch, from its file too
        assert results["resumed_at"] == {"epoch": 1, "step": 2}, results
        assert results["checkpoint_max_rel_diff"] == 0.0, results
    if "first_batch_grad_rel_diff" in results:
        assert results["first_batch_grad_rel_diff"] < WEIGHT_RTOL, results
