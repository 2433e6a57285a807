"""Runs the docs' `<!-- test: cluster -->` blocks in one worker process.

Usage (through run_cluster, by tests/acceptance/test_docs.py): docs_blocks_worker.py
SPEC, where SPEC is a JSON list of [label, source]. Each block runs as
`python block.py` would (a fresh namespace named "__main__"), one after the
other. Before each block the worker records it as "current" in its result,
so a block that fails, hangs or kills the worker is named by the test; a
block that raises stops the worker with status 1 (the launcher then stops
the other worker, which may be waiting in a collective of the same block).

Every block creates its own `tf.distribute.MultiWorkerMirroredStrategy(...)`.
TensorFlow does not support a second multi-worker strategy in one process
well: measured here, a second or third one hangs broadcasting its first
variable's initial value (`collective_bcast_send`/`recv`) after blocks that
ran ParallelOptimizer, and a strategy created with `communication_options`
after the first one hangs the next block's fit. So the first call creates
the process's one strategy (with that call's arguments), and every later
call without arguments returns it, as a script building several models would
share its strategy; a later call with arguments raises (tests/acceptance/test_docs.py
gives each further block that passes arguments a launch of its own).
"""

import json
import os
import sys
import traceback

from _cluster import write_result


def main(spec):
    blocks = json.loads(open(spec).read())
    done = []
    import tensorflow as tf

    base = tf.distribute.MultiWorkerMirroredStrategy

    class SharedStrategy(base):
        """`MultiWorkerMirroredStrategy()` returns the process's one strategy."""

        _shared = None

        def __new__(cls, *args, **kwargs):
            if cls._shared is None:
                return super().__new__(cls)
            if args or kwargs:
                raise RuntimeError(
                    "docs_blocks_worker: a second MultiWorkerMirroredStrategy with arguments "
                    "in one launch; tests/acceptance/test_docs.py must give this block its own launch."
                )
            return cls._shared

        def __init__(self, *args, **kwargs):
            if self is SharedStrategy._shared:
                return
            super().__init__(*args, **kwargs)
            SharedStrategy._shared = self

    tf.distribute.MultiWorkerMirroredStrategy = SharedStrategy
    for label, source in blocks:
        write_result({"done": done, "current": label})
        print(f"--- {label}", flush=True)
        try:
            exec(compile(source, label, "exec"), {"__name__": "__main__"})
        except BaseException:
            write_result({"done": done, "current": label, "error": traceback.format_exc()})
            print(f"--- {label} FAILED", flush=True)
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(1)
        done.append(label)
    write_result({"done": done, "current": None})
    print("--- all blocks ran", flush=True)
    # Skip TensorFlow's teardown (seconds of garbage collection and server
    # shutdown per worker): the result is written.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


if __name__ == "__main__":
    main(sys.argv[1])
