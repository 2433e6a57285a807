"""Every example in examples/ run on real worker processes, against one process.

Each example trains across 2 workers (pipeline.py: 3), then its chief trains
the same model on the same global batches in a single process and writes
both metrics with ``--results``; every worker must exit 0 (the launcher's
exit code) and none may leave while the chief still runs (`_common.finish`).
The 2-worker runs share one launch (each example's `main` in turn, see
`test_examples_on_two_workers_match_single_process`); pipeline.py gets its
own 3-worker launch. One epoch on the first 256 training digits
(``--train-samples``: 4 steps of 64, 8 of 32 for halo_exchange_conv) keeps
each run short; the full test set is still evaluated.

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
from blocks_worker import run_blocks

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


def _check(name, workers, results_path, output):
    """The checks of one example's run; `output` is what its chief printed."""
    script = RUNS[name][0]
    # No worker left while another still needed it: TensorFlow's
    # coordination service logs this when a worker vanishes early.
    assert "have crashed" not in output, f"{script}: a worker exited early:\n{output[-4000:]}"
    results = json.loads(results_path.read_text())
    assert results["replicas"] == workers
    # The chief printed the comparison line.
    assert f"test accuracy, {workers} workers:" in output and "single process:" in output
    assert results["max_weight_rel_diff"] < WEIGHT_RTOL, results
    assert abs(results["accuracy"] - results["single_process_accuracy"]) <= 1 / TEST_SAMPLES + 1e-9, results
    if "resumed_at" in results:  # checkpointing.py: resumed inside the second epoch, from its file too
        assert results["resumed_at"] == {"epoch": 1, "step": 2}, results
        assert results["checkpoint_max_rel_diff"] == 0.0, results
    if "first_batch_grad_rel_diff" in results:
        assert results["first_batch_grad_rel_diff"] < WEIGHT_RTOL, results


# An example's `main`, as its script's last line calls it.
_MAIN = """
import runpy, sys
sys.path.insert(0, {examples!r})
status = runpy.run_path({script!r})["main"]({argv!r})
if status:
    raise SystemExit(status)
"""


@pytest.mark.multiprocess
def test_examples_on_two_workers_match_single_process(tmp_path):
    """Every 2-worker run of RUNS, one after the other in one launch.

    tests/acceptance/blocks_worker.py calls each example's `main` in turn in
    the same two worker processes (the examples share the launch's strategy,
    as a script training several models would), which saves a launch's
    start-up per example; a failing example is named, and the ones after it
    run in a fresh launch. The launch's exit code is 0 only if every worker
    ran every example and exited 0.
    """
    runs = {name: run for name, run in RUNS.items() if len(run) == 2}
    blocks = [
        [name, _MAIN.format(examples=str(EXAMPLES), script=str(EXAMPLES / script),
                            argv=[*QUICK, *flags, "--results", str(tmp_path / f"{name}.json")])]
        for name, (script, flags) in runs.items()
    ]
    outcome, launches = run_blocks(blocks, tmp_path, timeout=600)
    assert sorted(outcome) == sorted(runs)
    failures = {name: text for name, text in outcome.items() if text}
    output = "".join(launch.output for launch in launches)
    for name in runs:
        if name in failures:
            continue
        # What the chief printed while this example ran.
        section = output.partition(f"[rank 0] --- {name}\n")[2].partition("[rank 0] --- ")[0]
        try:
            _check(name, 2, tmp_path / f"{name}.json", section)
        except AssertionError as e:
            failures[name] = f"{name}: {e}\n--- its output ---\n{section[-4000:]}"
    assert "have crashed" not in output, f"a worker exited early:\n{launches[-1].tail()}"
    assert not failures, f"{sorted(failures)} failed:\n\n" + "\n\n".join(failures.values())


@pytest.mark.multiprocess
@pytest.mark.parametrize("name", [name for name, run in RUNS.items() if len(run) == 3])
def test_example_matches_single_process(name, tmp_path):
    script, flags, workers = RUNS[name]
    results_path = Path(tmp_path) / "results.json"
    run = run_cluster(EXAMPLES / script, workers, *QUICK, *flags, "--results", results_path, timeout=150)
    # The launcher's exit code is 0 only if every worker exited 0.
    assert run.returncode == 0, f"{script} failed:\n{run.tail()}"
    _check(name, workers, results_path, run.output)
