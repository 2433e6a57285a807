"""Pipeline schedules (keras_comm.parallel.schedules), tested without TensorFlow.

The module is pure Python; it is loaded from its file so that neither
keras_comm/__init__.py nor keras_comm/parallel/__init__.py (TensorFlow) runs.
`simulate` is a blocking-rendezvous model of the executor: each stage runs
its list in order, a transfer completes when both ends are at its head.
"""

import importlib.util
import pathlib
import subprocess
import sys

import pytest

PATH = pathlib.Path(__file__).resolve().parents[2] / "keras_comm" / "parallel" / "schedules.py"
_spec = importlib.util.spec_from_file_location("_pipeline_schedules", PATH)
S = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(S)

GRID = [(p, m) for p in (2, 3, 4, 5, 8) for m in (1, 2, 3, 4, 8, 16)]


def test_the_module_imports_no_tensorflow():
    code = (
        "import importlib.util, sys\n"
        f"spec = importlib.util.spec_from_file_location('s', {str(PATH)!r})\n"
        "spec.loader.exec_module(importlib.util.module_from_spec(spec))\n"
        "assert 'tensorflow' not in sys.modules\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr


@pytest.mark.parametrize("schedule", S.SCHEDULES)
@pytest.mark.parametrize("p, m", GRID)
def test_every_schedule_runs_without_deadlock_and_each_op_once(schedule, p, m):
    table = S.train_schedule(schedule, p, m)
    assert len(table) == p
    for s, ops in enumerate(table):
        kinds = {S.FORWARD, S.BACKWARD}
        kinds |= {S.RECV_ACT, S.SEND_GRAD} if s > 0 else set()
        kinds |= {S.SEND_ACT, S.RECV_GRAD} if s < p - 1 else set()
        assert sorted(ops) == sorted(S.Op(k, i) for k in kinds for i in range(m))
        # Micro-batches in order, per kind (the executor's tags rely on it).
        for k in kinds:
            assert [op.micro_batch for op in ops if op.kind == k] == list(range(m))
    S.simulate(table)  # raises on a deadlock or a missing input


@pytest.mark.parametrize("schedule", S.SCHEDULES)
@pytest.mark.parametrize("p, m", GRID)
def test_bubble_matches_the_textbook_fraction(schedule, p, m):
    # With backward = 2 x forward and free transfers, both schedules'
    # bubble is exactly (p - 1) / (m + p - 1).
    sim = S.simulate(S.train_schedule(schedule, p, m))
    assert sim["bubble"] == pytest.approx(S.ideal_bubble(p, m), abs=1e-12)
    assert sim["makespan"] == pytest.approx(3 * (m + p - 1))


@pytest.mark.parametrize("p, m", GRID)
def test_1f1b_bounds_activations_gpipe_does_not(p, m):
    gpipe = [S.max_in_flight(ops) for ops in S.train_schedule("gpipe", p, m)]
    ofob = [S.max_in_flight(ops) for ops in S.train_schedule("1f1b", p, m)]
    assert gpipe == [m] * p
    assert ofob == [min(p - s, m) for s in range(p)]


def test_1f1b_interleaves_forwards_and_backwards():
    ops = S.one_f_one_b(0, 4, 8)
    compute = [(op.kind[0].upper(), op.micro_batch) for op in ops if op.kind in (S.FORWARD, S.BACKWARD)]
    assert compute[:6] == [("F", 0), ("F", 1), ("F", 2), ("F", 3), ("B", 0), ("F", 4)]
    # The last stage alternates from the start.
    last = [op for op in S.one_f_one_b(3, 4, 2) if op.kind in (S.FORWARD, S.BACKWARD)]
    assert [op.kind for op in last] == [S.FORWARD, S.BACKWARD] * 2


def test_gpipe_and_1f1b_differ_only_in_order():
    for s in range(4):
        assert sorted(S.gpipe(s, 4, 8)) == sorted(S.one_f_one_b(s, 4, 8))
        # The forward and backward halves of either are GPipe's halves.
        for half in (S.forward_only, S.backward_only):
            assert half(S.gpipe(s, 4, 8)) == half(S.one_f_one_b(s, 4, 8))


def test_the_naive_1f1b_order_deadlocks_under_blocking_transfers():
    # Sending activation i before receiving gradient k (while stage s+1
    # sends gradient k before receiving activation i) deadlocks: the
    # simulation must catch it, or it proves nothing about our tables.
    def naive(stage, p, m):
        warm = min(p - stage - 1, m)
        ops = []
        for i in range(warm):
            ops += S._forward_ops(stage, p, i)
        for k in range(m - warm):
            ops += S._forward_ops(stage, p, warm + k) + S._backward_ops(stage, p, k)
        for k in range(m - warm, m):
            ops += S._backward_ops(stage, p, k)
        return ops

    with pytest.raises(RuntimeError, match="deadlock"):
        S.simulate([naive(s, 2, 4) for s in range(2)])


def test_simulation_catches_a_missing_input():
    table = S.train_schedule("gpipe", 2, 1)
    table[1] = [S.Op(S.FORWARD, 0), S.Op(S.RECV_ACT, 0), S.Op(S.BACKWARD, 0), S.Op(S.SEND_GRAD, 0)]
    with pytest.raises(RuntimeError, match="runs before recv_act"):
        S.simulate(table)


def test_diagram_is_generated_from_the_schedule():
    chart = S.diagram(S.train_schedule("1f1b", 2, 2))
    assert chart.splitlines() == [
        "stage 0 | F0 F1 .. .. B0 B0 .. B1 B1",
        "stage 1 | .. F0 B0 B0 F1 B1 B1 .. ..",
    ]
    assert S.diagram(S.train_schedule("gpipe", 2, 2)).splitlines() == [
        "stage 0 | F0 F1 .. .. .. B0 B0 B1 B1",
        "stage 1 | .. F0 F1 B0 B0 B1 B1 .. ..",
    ]


@pytest.mark.parametrize(
    "call, text",
    [
        (lambda: S.train_schedule("zb", 2, 2), "`schedule` must be one of"),
        (lambda: S.train_schedule("gpipe", 0, 2), "num_stages"),
        (lambda: S.train_schedule("1f1b", 2, 0), "num_micro_batches"),
        (lambda: S.gpipe(0, 2, True), "num_micro_batches"),
    ],
)
def test_bad_arguments(call, text):
    with pytest.raises(ValueError, match="Received") as info:
        call()
    assert text in str(info.value)
