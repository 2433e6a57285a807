"""Worker: every group of checks that shares the suite's launch of 2 or 3 workers.

Usage: shared_launch_worker.py STATE_DIR (run through `_cluster.shared_cluster`,
whose tests each check their own group of the result).

Each launch pays TensorFlow's import and the cluster's setup (~7 CPU-seconds
per process on the 2-core CI machine, 9-12 s of wall time before any check):
the groups of one worker count share one. Groups run in order, each under its
name in the result (`_cluster.run_groups`):

- 3 workers: collectives, mirror, nontrainable
  (tests/acceptance/test_collectives_multiprocess.py), parallel_optimizer
  (tests/callbacks/test_parallel_optimizer_multiprocess.py), compat_flow
  (tests/compat/test_compat.py), p2p (tests/ops/test_p2p_multiprocess.py);
- 2 workers: parallel (tests/parallel/test_parallel_multiprocess.py),
  stock_keras (tests/compat/test_compat.py), p2p.

p2p runs last: its timed-out receive aborts the process's collectives.
The 4-worker groups share tests/parallel/pipeline_worker.py's launch.
"""

from _cluster import finish, load_worker_module, run_groups, write_result
from _strategy import strategy

p2p = load_worker_module("ops/p2p_worker.py")

if strategy.num_replicas_in_sync == 3:
    import collectives_worker  # noqa: E402
    import mirror_worker  # noqa: E402
    import nontrainable_worker  # noqa: E402

    flows = load_worker_module("compat/flows.py")
    po = load_worker_module("callbacks/parallel_optimizer_worker.py")
    groups = [
        ("collectives", collectives_worker.results),
        ("mirror", mirror_worker.results),
        ("nontrainable", nontrainable_worker.results),
        ("parallel_optimizer", lambda: po.results(strategy, po.CONFIGS[3])),
        ("compat_flow", lambda: flows.run_all(strategy)),
    ]
elif strategy.num_replicas_in_sync == 2:
    parallel = load_worker_module("parallel/parallel_worker.py")
    stock_keras = load_worker_module("compat/stock_keras_worker.py")
    groups = [
        ("parallel", lambda: parallel.results(strategy)),
        ("stock_keras", lambda: stock_keras.results(strategy)),
    ]
else:
    raise ValueError(f"shared_launch_worker runs on 2 or 3 workers. Received: {strategy.num_replicas_in_sync}")
groups.append(("p2p", lambda: p2p.results(strategy)))

write_result(run_groups(groups))
finish()  # _cluster.finish: skip the slow teardown (and keeps every rank up until all wrote)
