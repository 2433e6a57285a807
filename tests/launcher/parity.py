"""Worker: does one thing a Python script can do at its end, for comparing how
a worker started as a new interpreter and one forked by `--preload` behave.

Usage: parity.py MODE (report | exit | raise | exit-message | sigkill |
interrupt). Both ranks report; rank 1 then does MODE while rank 0 waits to
be stopped (in mode report both exit 0). The report
(on stdout, one whole line per write) holds what the script sees of its
start; an atexit handler and a non-daemon thread print when they run.
"""

import atexit
import json
import os
import signal
import sys
import threading
import time

import numpy as np

mode = sys.argv[1]
rank = int(os.environ["RANK"])
tf_config = json.loads(os.environ["TF_CONFIG"])
report = {
    "argv": sys.argv,
    "path0": sys.path[0],
    "name": __name__,
    "file": __file__,
    "rank": rank,
    "task": tf_config["task"],
    "workers": len(tf_config["cluster"]["worker"]),
    "stdin": sys.stdin.read(),
    "unbuffered": os.environ.get("PYTHONUNBUFFERED"),
    "sigint": getattr(signal.getsignal(signal.SIGINT), "__name__", str(signal.getsignal(signal.SIGINT))),
    "sighup": str(signal.getsignal(signal.SIGHUP)),
    "session_leader": os.getsid(0) == os.getpid(),
}
sys.stdout.write("report " + json.dumps(report, sort_keys=True) + "\n")
sys.stderr.write(f"stderr line from rank {rank}\n")
sys.stdout.write(f"partial line from rank {rank}")
sys.stdout.flush()
# numpy draws without a seed: different in every worker, as in new interpreters.
with open(os.path.join(os.environ["KERAS_COMM_TEST_OUT"], f"draw{rank}"), "w") as f:
    f.write(repr(float(np.random.rand())))
atexit.register(lambda: sys.stdout.write(f"atexit of rank {rank}\n"))


def late():
    time.sleep(0.2)
    sys.stdout.write(f"thread of rank {rank} done\n")


threading.Thread(target=late).start()  # non-daemon: joined before atexit

ready = os.path.join(os.environ["KERAS_COMM_TEST_OUT"], "ready0")
if rank == 0 and mode != "report":
    open(ready, "w").close()
    # Stopped by the launcher once rank 1 fails: the stop count is always 1.
    time.sleep(60)
if rank == 1:
    # Rank 0 has written all its lines before rank 1 ends the job.
    deadline = time.monotonic() + 30
    while mode != "report" and not os.path.exists(ready) and time.monotonic() < deadline:
        time.sleep(0.01)
    if mode == "exit":
        sys.exit(42)
    if mode == "raise":
        raise ValueError("boom in rank 1")
    if mode == "exit-message":
        sys.exit("a message instead of a code")
    if mode == "sigkill":
        os.kill(os.getpid(), signal.SIGKILL)
    if mode == "interrupt":
        raise KeyboardInterrupt
