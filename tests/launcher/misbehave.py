"""Worker: reports its pid, then sleeps, fails or ignores signals on request.

Usage: misbehave.py [--fail-rank R] [--exit-code C | --sigkill]
                    [--exit-on-term C] [--ignore-signals] [--sleep S]

Every rank first writes {"pid": ...} and prints "ready". The failing rank
waits until every rank has written its pid in this attempt, so a test can check afterwards
that the launcher stopped all of them.
"""

import argparse
import json
import os
import signal
import sys
import time
from pathlib import Path

from _cluster import rank, write_result

parser = argparse.ArgumentParser()
parser.add_argument("--fail-rank", type=int, default=None)
parser.add_argument("--exit-code", type=int, default=3)
parser.add_argument("--sigkill", action="store_true")
parser.add_argument("--exit-on-term", type=int, default=None)
parser.add_argument("--ignore-signals", action="store_true")
parser.add_argument("--sleep", type=float, default=60.0)
args = parser.parse_args()

if args.ignore_signals:
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
if args.exit_on_term is not None:
    signal.signal(signal.SIGTERM, lambda *_: os._exit(args.exit_on_term))

def _written(path, attempt):
    try:
        return json.loads(path.read_text()).get("attempt") == attempt
    except (OSError, ValueError):  # not there yet, or being written
        return False


write_result({"pid": os.getpid(), "attempt": os.environ["KERAS_COMM_RESTART_ATTEMPT"]})
print("ready", flush=True)

if rank() == args.fail_rank:
    out_dir = Path(os.environ["KERAS_COMM_TEST_OUT"])
    world_size = int(os.environ["KERAS_COMM_WORLD_SIZE"])
    attempt = os.environ["KERAS_COMM_RESTART_ATTEMPT"]
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:
        # This attempt's files: after a restart the last attempt's are still there.
        if all(_written(out_dir / f"rank{r}.json", attempt) for r in range(world_size)):
            break
        time.sleep(0.05)
    print(f"rank {rank()} failing now", file=sys.stderr, flush=True)
    if args.sigkill:
        os.kill(os.getpid(), signal.SIGKILL)
    sys.exit(args.exit_code)

time.sleep(args.sleep)
