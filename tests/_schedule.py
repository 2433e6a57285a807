"""pytest-xdist scheduling for tests/conftest.py: one cluster launch at a time.

xdist's `load` scheduler hands each pytest worker the next tests in collection
order (longest first, see conftest.py), so the longest tests, which are
cluster launches, start together on both workers: 6 worker processes on 2
cores, where every ring collective waits for a peer that is not running. Run
alone one after the other, the 4-worker pipeline launch, the distribution
launch and the FullyShard KerasHub launch take 109, 88 and 41 s; started
together beside each other they take 153, 122 and 119 s.

`OneLaunchAtATime` keeps xdist's load scheduling (tests go out one at a time,
longest first, as workers free up) with one rule: a test that launches a
cluster (`LAUNCH_SECONDS` or more, `multiprocess` marker) is not sent to a
worker while the other worker runs or holds one; that worker gets the longest
test that launches nothing instead. Only when nothing else is left do two
launches overlap. Which tests launch is known only where tests are collected
(the pytest workers, which see markers); the scheduler runs in the controller,
which sees node ids. So each worker writes the launching node ids to a file
the controller named (`pytest_configure_node`), and the controller reads it
once collection is complete.

Nothing here changes which tests run or what they check: only their order.
"""

import json
import os
from pathlib import Path

from xdist.scheduler import LoadScheduling

# A multiprocess test expected to take this long (tests/_durations.py) counts
# as a launch; shorter ones (a launcher's argument check, a subprocess that
# imports the package) start and end between two in-process tests.
LAUNCH_SECONDS = 10

FILE_KEY = "keras_comm_launches_file"


def launches_file(workerinput):
    """Where a pytest worker writes its launching node ids (None outside xdist)."""
    return workerinput.get(FILE_KEY) if workerinput else None


def write_launches(path, nodeids):
    tmp = Path(f"{path}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps(sorted(nodeids)))
    os.replace(tmp, path)


class OneLaunchAtATime(LoadScheduling):
    """LoadScheduling where two cluster launches never run at once while other
    tests wait (see the module docstring)."""

    def __init__(self, config, log, path):
        super().__init__(config, log)
        self._path = Path(path)
        self._launches = None

    def _launch_indices(self):
        if self._launches is None:
            try:
                ids = set(json.loads(self._path.read_text()))
            except (OSError, ValueError):
                ids = set()  # no worker wrote it: plain load scheduling
            self._launches = {i for i, nodeid in enumerate(self.collection) if nodeid in ids}
        return self._launches

    def _next_for(self, node):
        launches = self._launch_indices()
        elsewhere = any(
            index in launches
            for other, pending in self.node2pending.items()
            if other is not node
            for index in pending
        )
        if elsewhere:
            for position, index in enumerate(self.pending):
                if index not in launches:
                    return position
        return 0

    def _send_tests(self, node, num):
        for _ in range(min(num, len(self.pending))):
            index = self.pending.pop(self._next_for(node))
            self.node2pending[node].append(index)
            node.send_runtest_some([index])
