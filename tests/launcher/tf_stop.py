"""Worker: after MultiWorkerMirroredStrategy starts, rank 1 fails; rank 0 waits.

Rank 0 sleeps in `try/finally` with an atexit handler; both record the time
they ran in KERAS_COMM_TEST_OUT, so the test sees that the launcher's SIGTERM
let rank 0 clean up and exit (TensorFlow's coordination service otherwise
swallows SIGTERM). Rank 1 records the time it failed.
"""

import atexit
import json
import os
import sys
import time
from pathlib import Path

import tensorflow as tf

from _cluster import rank, write_result

strategy = tf.distribute.MultiWorkerMirroredStrategy()
out = Path(os.environ["KERAS_COMM_TEST_OUT"])
write_result({"pid": os.getpid(), "replicas": strategy.num_replicas_in_sync})
if rank() == 1:
    while not (out / "rank0.json").exists():
        time.sleep(0.05)
    (out / "failed.json").write_text(json.dumps({"time": time.time()}))
    # At once (like a crash): a normal exit would first spend seconds in
    # TensorFlow's teardown, and the test measures the stop, not that.
    sys.stdout.flush()
    os._exit(3)
atexit.register(lambda: (out / "atexit.json").write_text(json.dumps({"time": time.time()})))
try:
    time.sleep(120)
finally:
    (out / "finally.json").write_text(json.dumps({"time": time.time()}))
