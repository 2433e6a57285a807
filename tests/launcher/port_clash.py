"""Worker: on the first start, fails as TensorFlow does when its port is taken.

Usage: port_clash.py MARKER_DIR. Rank 1 fails once (while MARKER_DIR/clashed
does not exist) with TensorFlow's message; every later start succeeds.
"""

import os
import sys
from pathlib import Path

from _cluster import rank, write_result

marker = Path(sys.argv[1]) / "clashed"
if rank() == 1 and not marker.exists():
    marker.write_text("1")
    print("UNKNOWN: Could not start gRPC server", file=sys.stderr, flush=True)
    sys.exit(1)
write_result({"attempt": os.environ["KERAS_COMM_RESTART_ATTEMPT"], "tf_config": os.environ["TF_CONFIG"]})
