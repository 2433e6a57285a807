"""Worker: collectives_worker's, mirror_worker's and nontrainable_worker's
checks in one launch.

Each launch of 3 workers pays TensorFlow's import and the cluster's setup
(~8 CPU-seconds per process on the 2-core CI machine, tens of seconds of
wall time); the three sets of checks share one.
Run by tests/acceptance/test_collectives_multiprocess.py.
"""

from _cluster import finish, write_result

import collectives_worker  # noqa: E402  (creates the strategy: _strategy.py)
import mirror_worker  # noqa: E402
import nontrainable_worker  # noqa: E402

write_result({
    "collectives": collectives_worker.results(),
    "mirror": mirror_worker.results(),
    "nontrainable": nontrainable_worker.results(),
})
finish()  # _cluster.finish: skip the slow teardown
