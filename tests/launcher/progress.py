"""Worker: draws a progress bar with '\\r' like Keras, pausing mid-bar.

Usage: progress.py GO_FILE. Each rank writes "\\r[bar 1/2]" (no newline),
then waits until GO_FILE exists (the test creates it once it has seen the
first redraw on the launcher's console), then "\\r[bar 2/2]\\n" and a plain
line.
"""

import sys
import time
from pathlib import Path

from _cluster import rank

go = Path(sys.argv[1])
sys.stdout.write(f"\r[bar 1/2 rank {rank()}]")
sys.stdout.flush()
deadline = time.monotonic() + 30
while not go.exists() and time.monotonic() < deadline:
    time.sleep(0.02)
sys.stdout.write(f"\b\b\r[bar 2/2 rank {rank()}]\n")
print(f"done rank {rank()}", flush=True)
