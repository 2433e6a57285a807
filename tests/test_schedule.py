"""The suite's xdist scheduler (tests/_schedule.py) keeps cluster launches apart.

A simulated run: two fake pytest workers, a collection sorted longest first
as conftest.py sorts it, and tests that finish in a chosen order. What each
worker is sent, and when, is the scheduler's own decision through xdist's
real LoadScheduling code.
"""

import json

import _schedule
import pytest


class _Config:
    """What LoadScheduling reads of pytest's config under `-n 2`."""

    def getoption(self, name):
        return {"maxschedchunk": 1}[name]

    def getvalue(self, name):
        return {"tx": ["2*popen"]}[name]


class _Node:
    def __init__(self, name):
        self.gateway = type("Gateway", (), {"id": name})()
        self.shutting_down = False
        self.sent = []

    def send_runtest_some(self, indices):
        self.sent.extend(indices)

    def shutdown(self):
        self.shutting_down = True


def _simulate(tmp_path, collection, launches, finish_order):
    """Runs the scheduler; returns per-node lists of the test names each ran."""
    path = tmp_path / "launches.json"
    _schedule.write_launches(path, launches)
    sched = _schedule.OneLaunchAtATime(_Config(), None, path)
    nodes = [_Node("gw0"), _Node("gw1")]
    for node in nodes:
        sched.add_node(node)
    for node in nodes:
        sched.add_node_collection(node, collection)
    sched.schedule()
    overlaps = []
    for name in finish_order:  # the node holding `name` finishes it
        node = next(n for n in nodes if sched.collection.index(name) in sched.node2pending[n])
        # What runs now on every node: the head of its pending list.
        running = [collection[sched.node2pending[n][0]] for n in nodes if sched.node2pending[n]]
        if sum(r in launches for r in running) > 1:
            overlaps.append(running)
        sched.mark_test_complete(node, sched.collection.index(name), duration=1.0)
    return [[collection[i] for i in n.sent] for n in nodes], overlaps, sched


def test_a_launch_waits_while_the_other_worker_holds_one(tmp_path):
    collection = ["L1", "L2", "L3", "i1", "i2", "i3", "i4", "i5", "i6"]
    launches = ["L1", "L2", "L3"]
    # gw0 ends L1 while gw1 works through in-process tests, and so on: any
    # order in which in-process tests remain until the launches are done.
    order = ["i1", "L1", "i2", "i3", "L2", "i4", "L3", "i5", "i6"]
    sent, overlaps, sched = _simulate(tmp_path, collection, launches, order)
    assert sent[0] == ["L1", "L2", "L3", "i6"], sent
    assert sent[1] == ["i1", "i2", "i3", "i4", "i5"], sent
    assert overlaps == []
    assert not sched.pending


def test_launches_overlap_only_when_nothing_else_is_left(tmp_path):
    collection = ["L1", "L2", "L3", "i1"]
    launches = ["L1", "L2", "L3"]
    sent, overlaps, sched = _simulate(tmp_path, collection, launches, ["i1", "L1", "L3", "L2"])
    assert sent[1] == ["i1", "L3"], sent  # rather than sitting idle
    assert overlaps == [["L1", "L3"], ["L2", "L3"]]


def test_without_the_file_it_is_plain_longest_first_load_scheduling(tmp_path):
    collection = ["L1", "L2", "i1", "i2"]
    sched = _schedule.OneLaunchAtATime(_Config(), None, tmp_path / "absent.json")
    nodes = [_Node("gw0"), _Node("gw1")]
    for node in nodes:
        sched.add_node(node)
        sched.add_node_collection(node, collection)
    sched.schedule()
    assert [n.sent for n in nodes] == [[0, 1], [2, 3]]


@pytest.mark.parametrize("content", ["not json", json.dumps(["L1"])])
def test_the_file_names_the_launches_and_an_unreadable_one_names_none(tmp_path, content):
    path = tmp_path / "launches.json"
    path.write_text(content)
    sched = _schedule.OneLaunchAtATime(_Config(), None, path)
    sched.collection = ["L1", "i1"]
    assert sched._launch_indices() == ({0} if content.startswith("[") else set())
