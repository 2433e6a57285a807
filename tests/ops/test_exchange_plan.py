"""Exchange plans (keras_comm.ops._exchange_plan), tested without TensorFlow.

The plan module is pure Python. It is loaded here without running the
package's ``__init__`` (which imports TensorFlow), and one test checks in a
fresh interpreter that loading it imports no TensorFlow at all.
"""

import contextlib
import importlib
import pathlib
import random
import subprocess
import sys
import types

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]

# Loads keras_comm.ops._exchange_plan with stand-in packages, so that neither
# keras_comm/__init__.py nor keras_comm/ops/__init__.py runs.
_LOADER = f"""
import sys, types
for pkg, path in (("keras_comm", {str(ROOT / "keras_comm")!r}),
                  ("keras_comm.ops", {str(ROOT / "keras_comm" / "ops")!r})):
    module = types.ModuleType(pkg)
    module.__path__ = [path]
    sys.modules[pkg] = module
import keras_comm.ops._exchange_plan
"""


@contextlib.contextmanager
def _stand_in_packages():
    ours = lambda k: k == "keras_comm" or k.startswith("keras_comm.")  # noqa: E731
    saved = {k: sys.modules.pop(k) for k in list(sys.modules) if ours(k)}
    try:
        for pkg, path in (("keras_comm", ROOT / "keras_comm"), ("keras_comm.ops", ROOT / "keras_comm" / "ops")):
            module = types.ModuleType(pkg)
            module.__path__ = [str(path)]
            sys.modules[pkg] = module
        yield
    finally:
        for k in [k for k in sys.modules if ours(k)]:
            del sys.modules[k]
        sys.modules.update(saved)


with _stand_in_packages():
    plan = importlib.import_module("keras_comm.ops._exchange_plan")


def test_the_plan_module_imports_no_tensorflow():
    code = _LOADER + "\nassert 'tensorflow' not in sys.modules, sorted(m for m in sys.modules if 'tensorflow' in m)[:5]\n"
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr


# ---------------------------------------------------------------------------
# A rendezvous simulation: each rank walks its moves in order; a send and the
# matching receive complete together. It finds deadlocks and checks that
# every piece lands where the plan says.
# ---------------------------------------------------------------------------


def _simulate(links, ranks, reverse=False):
    """Runs every rank's moves; returns {(receiver, slot): (sender, slot)}."""
    queues = {r: list(plan.moves(links, r, reverse)) for r in ranks}
    landed = {}
    while any(queues.values()):
        progressed = False
        for a in ranks:
            if not queues[a] or queues[a][0].kind != "send":
                continue
            send = queues[a][0]
            b = send.peer
            if queues[b] and queues[b][0].kind == "recv" and queues[b][0].peer == a:
                recv = queues[b].pop(0)
                queues[a].pop(0)
                landed[(b, recv.slot)] = (a, send.slot)
                progressed = True
        if not progressed:
            raise AssertionError(f"deadlock: heads {[(r, q[0]) for r, q in queues.items() if q]}")
    return landed


def _ring(n):
    return [[(r + 1) % n] for r in range(n)], [[(r - 1) % n] for r in range(n)]


def test_ring_links_run_in_the_global_order_and_deliver_each_input():
    ranks, _, _, _, _, links = plan.exchange_plan(*_ring(4), [[3]], [[3]])
    assert ranks == (0, 1, 2, 3)
    keys = [(min(t.src, t.dst), max(t.src, t.dst), t.src) for t in links]
    assert keys == sorted(keys) and len(links) == 4
    # Forward: rank r's output 0 is rank r-1's input 0.
    assert _simulate(links, ranks) == {(r, 0): ((r - 1) % 4, 0) for r in range(4)}
    # Backward: the same links reversed; rank r's input gradient comes from r+1.
    assert _simulate(links, ranks, reverse=True) == {(r, 0): ((r + 1) % 4, 0) for r in range(4)}


def test_moves_reverse_swaps_roles_and_slots():
    links = [plan.Link(0, 1, 2, 5)]
    assert plan.moves(links, 0) == [plan.Move("send", 1, 2)]
    assert plan.moves(links, 1) == [plan.Move("recv", 0, 5)]
    assert plan.moves(links, 0, reverse=True) == [plan.Move("recv", 1, 2)]
    assert plan.moves(links, 1, reverse=True) == [plan.Move("send", 0, 5)]
    assert plan.moves(links, 7) == []


@pytest.mark.parametrize("seed", range(20))
def test_random_patterns_never_deadlock_and_backward_is_the_transpose(seed):
    rng = random.Random(seed)
    n = rng.randint(2, 6)
    k = rng.randint(1, 3)  # input slots = output slots (each send matched)
    send = [[None] * k for _ in range(n)]
    recv = [[None] * k for _ in range(n)]
    free_out = {r: list(range(k)) for r in range(n)}
    for a in range(n):
        for i in range(k):
            b = rng.randrange(n)
            if b == a or not free_out[b] or rng.random() < 0.3:
                continue
            # Output slots at b are filled in the order a's sends arrive.
            j = free_out[b].pop(0)
            send[a][i] = b
            recv[b][j] = a
    # The n-th slot a sends to b must be the n-th slot b receives from a.
    ranks, _, _, _, _, links = plan.exchange_plan(send, recv, [[2]] * k, [[2]] * k)
    forward = _simulate(links, ranks)
    backward = _simulate(links, ranks, reverse=True)
    assert {v: key for key, v in forward.items()} == backward
    assert len(forward) == sum(s is not None for row in send for s in row)


def test_subgroup_rows_belong_to_its_ranks():
    ranks, _, _, _, _, links = plan.exchange_plan([[3], [1]], [[3], [1]], [[3]], [[3]], group=[3, 1])
    assert ranks == (1, 3)
    assert links == [plan.Link(1, 3, 0, 0), plan.Link(3, 1, 0, 0)]


@pytest.mark.parametrize(
    "args, error, text",
    [
        (([[1], [0]], [[1]], [[3]], [[3]]), ValueError, "one row per group member"),
        (([[0], [0]], [[1], [0]], [[3]], [[3]]), ValueError, "names rank 0 itself"),
        (([[5], [0]], [[1], [0]], [[3]], [[3]]), ValueError, "not in the group"),
        (([[1], [None]], [[None], [None]], [[3]], [[3]]), ValueError, "receives 0"),
        (([[1], [0]], [[1], [0]], [[3]], [[4]]), ValueError, "the shapes must match"),
        (([[1], [0]], [[1], [0]], [[-1]], [[3]]), ValueError, "send_shapes[0]"),
        (("ab", [[1], [0]], [[3]], [[3]]), TypeError, "send_ranks"),
        (([[1.5], [0]], [[1], [0]], [[3]], [[3]]), TypeError, "send_ranks[0] entry"),
    ],
)
def test_exchange_plan_rejects_bad_patterns(args, error, text):
    with pytest.raises(error, match="Received") as info:
        plan.exchange_plan(*args)
    assert text in str(info.value)


def test_rows_must_match_the_group():
    with pytest.raises(ValueError, match=r"one row per member of `group` \[0, 1, 2\]"):
        plan.exchange_plan(*_ring(2), [[3]], [[3]], group=[0, 1, 2])


# ---------------------------------------------------------------------------
# Halo plans.
# ---------------------------------------------------------------------------


def test_halo_rank_ids():
    assert plan.halo_rank_ids(1, 2) == [[-1, -1, 1, -1, -1, -1, -1, -1], [-1, -1, -1, -1, -1, -1, 0, -1]]
    torus = plan.halo_rank_ids(3, 3, periodic=True)
    assert torus[0] == [6, 7, 1, 4, 3, 5, 2, 8]
    # A 2x2 grid: rank 0's right is 1, bottom 2, bottom-right 3.
    assert plan.halo_rank_ids(2, 2)[0] == [-1, -1, 1, 3, 2, -1, -1, -1]
    with pytest.raises(ValueError, match="Received: grid_cols=0"):
        plan.halo_rank_ids(2, 0)


def test_halo_links_pair_each_strip_with_the_opposite_halo():
    ids = plan.halo_rank_ids(2, 2)
    ranks, _, _, _, _, links = plan.halo_plan(ids, [1, 1, 1, 1], ids, [1, 1, 1, 1])
    # 4 ranks, each with 3 neighbours.
    assert len(links) == 12
    for link in links:
        assert link.recv_slot == (link.send_slot + 4) % 8
        assert ids[link.src][link.send_slot] == link.dst
    landed = _simulate(links, ranks)
    # Rank 3 (bottom right) gets rank 0's bottom-right corner in its top-left halo.
    assert landed[(3, plan.DIRECTIONS.index("top_left"))] == (0, plan.DIRECTIONS.index("bottom_right"))
    _simulate(links, ranks, reverse=True)


def test_zero_length_strips_are_not_sent():
    ids = plan.halo_rank_ids(2, 1)  # two row strips
    _, _, _, _, _, links = plan.halo_plan(ids, [0, 2, 0, 0], ids, [2, 0, 0, 0])
    # Only rank 0 sends its 2 bottom rows; rank 1 sends no top rows.
    assert links == [plan.Link(0, 1, plan.DIRECTIONS.index("bottom"), plan.DIRECTIONS.index("top"))]


@pytest.mark.parametrize(
    "send_ids, send_lens, recv_ids, recv_lens, text",
    [
        (plan.halo_rank_ids(1, 2), [1, 1, 1, 1], plan.halo_rank_ids(1, 2), [1, 1, 2, 1], "must equal the halo"),
        (plan.halo_rank_ids(1, 2), [1, 1, 1], plan.halo_rank_ids(1, 2), [1, 1, 1, 1], "4 ints"),
        ([[-1, -1, 1, -1, -1, -1, -1, -1], [-1] * 8], [1] * 4, plan.halo_rank_ids(1, 2), [1] * 4, "not 0"),
        ([[-1, -1, 0, -1, -1, -1, -1, -1], [-1] * 8], [1] * 4, [[-1] * 8] * 2, [1] * 4, "itself"),
    ],
)
def test_halo_plan_rejects_inconsistent_tables(send_ids, send_lens, recv_ids, recv_lens, text):
    with pytest.raises(ValueError, match="Received") as info:
        plan.halo_plan(send_ids, send_lens, recv_ids, recv_lens)
    assert text in str(info.value)


def test_halo_regions_cover_the_padded_tile():
    height, width = 4, 5
    send_lens, recv_lens = (1, 2, 1, 3), (2, 1, 3, 1)
    strips, halos, interior = plan.halo_regions(height, width, send_lens, recv_lens)
    d = plan.DIRECTIONS.index
    assert strips[d("top")] == ((0, 1), (0, 5))
    assert strips[d("bottom_right")] == ((2, 4), (2, 5))
    assert strips[d("left")] == ((0, 4), (0, 1))
    assert interior == ((2, 6), (3, 8))
    # The 8 halos and the interior tile the padded plane exactly once.
    ph, pw = 2 + height + 1, 3 + width + 1
    covered = [[0] * pw for _ in range(ph)]
    for (r0, r1), (c0, c1) in halos + [interior]:
        for r in range(r0, r1):
            for c in range(c0, c1):
                covered[r][c] += 1
    assert all(v == 1 for row in covered for v in row)


def test_data_format_and_lens_checks():
    assert plan.check_data_format("NHWC") == "NHWC"
    with pytest.raises(ValueError, match="Received: data_format='nhwc'"):
        plan.check_data_format("nhwc")
    assert plan.normalize_lens([1, 0, 2, 3], "send_lens") == (1, 0, 2, 3)
    with pytest.raises(ValueError, match="Received: recv_lens="):
        plan.normalize_lens([1, -1, 0, 0], "recv_lens")
