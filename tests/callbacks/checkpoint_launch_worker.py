"""Worker: every multi-process checkpoint check in three launches.

Usage: checkpoint_launch_worker.py STATE_DIR LAUNCH, LAUNCH in 1, 2, 3; the
three launches run in order on one STATE_DIR:

1. sharded_checkpoint_worker's ``interrupt`` (STATE_DIR/sharded), then
   checkpoint_worker's configurations: ``plain`` is SIGKILLed (rank 1).
2. backup_agreement_worker (STATE_DIR/agreement), then ``plain`` resumes and
   finishes, ``po1`` is SIGKILLed.
3. sharded_checkpoint_worker's ``resume``, then ``po1`` resumes and finishes.
   The result holds every part: ``sigkill`` (checkpoint_worker), ``sharded``
   and ``agreement`` (read back from launch 2's STATE_DIR/agreement-rank<r>.json).

Why one worker for three checks: each launch of 2 workers pays TensorFlow's
import and the cluster's setup (~8 CPU-seconds per process); the SIGKILL
check needs three launches anyway, and the other two checks (formerly three
launches of their own) ride on them. Whatever a launch runs before the
SIGKILL is written to STATE_DIR first, so a kill loses nothing.
Run by tests/callbacks/test_checkpoint_multiprocess.py.
"""

import json
import sys
from pathlib import Path

from _cluster import finish, write_result

import checkpoint_worker  # noqa: E402  (creates the strategy: _strategy.py)
import backup_agreement_worker  # noqa: E402
import sharded_checkpoint_worker  # noqa: E402

SIGKILL_CONFIGS = ["plain", "po1"]


def main(state_dir, launch):
    state = Path(state_dir)
    rank = checkpoint_worker.RANK
    agreement = state / f"agreement-rank{rank}.json"
    if launch == 1:
        sharded_checkpoint_worker.interrupt(state / "sharded")
    elif launch == 2:
        agreement.write_text(json.dumps(backup_agreement_worker.run(state / "agreement")))
    else:
        sharded = sharded_checkpoint_worker.resume(state / "sharded")
    sigkill = checkpoint_worker.run_configs(state / "sigkill", SIGKILL_CONFIGS)
    if launch != 3:
        raise RuntimeError(f"launch {launch} should have ended in rank 1's SIGKILL")
    write_result({
        "rank": rank,
        "world": checkpoint_worker.N,
        "sigkill": sigkill,
        "sharded": sharded,
        "agreement": json.loads(agreement.read_text()),
    })


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]))
    finish()  # _cluster.finish: skip the slow teardown
