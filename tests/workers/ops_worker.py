"""Worker: collectives_worker's and mirror_worker's checks in one launch.

Each launch of 3 workers pays TensorFlow's import and the cluster's setup
(tens of seconds on the 2-core CI machine); the two sets of checks share one.
Run by tests/test_collectives_multiprocess.py.
"""

from _cluster import finish, write_result

import collectives_worker  # noqa: E402  (creates the strategy: _ops_strategy)
import mirror_worker  # noqa: E402

write_result({"collectives": collectives_worker.results(), "mirror": mirror_worker.results()})
finish()  # _cluster.finish: skip the slow teardown
