"""Runs python code blocks one after the other in each of a launch's workers.

Worker side: ``blocks_worker.py SPEC``, through `run_cluster`, where SPEC is
a JSON list of [label, source]. Each block runs as `python block.py` would
(a fresh namespace named "__main__"), one after the other. Before each block
the worker records it as "current" in its result, so a block that fails,
hangs or kills the worker is named by the test; a block that raises stops
the worker with status 1 (the launcher then stops the other worker, which
may be waiting in a collective of the same block).

Test side: `run_blocks` runs a list of blocks in as few launches as it can
(tests/acceptance/test_docs.py: the docs' cluster blocks;
tests/acceptance/test_examples.py: the examples' `main`). A launch costs
~12 s of worker start-up (TensorFlow's import in each worker) before any
block runs, a block a few seconds.

Every block creates its own `tf.distribute.MultiWorkerMirroredStrategy(...)`.
TensorFlow does not support a second multi-worker strategy in one process
well: measured here, a second or third one hangs broadcasting its first
variable's initial value (`collective_bcast_send`/`recv`) after blocks that
ran ParallelOptimizer, and a strategy created with `communication_options`
after the first one hangs the next block's fit. So the first call creates
the process's one strategy (with that call's arguments), and every later
call without arguments returns it, as a script building several models would
share its strategy; a later call with arguments raises (the test gives each
further block that passes arguments a launch of its own).
"""

import json
import os
import sys
import time
import traceback

from _cluster import run_cluster
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
                    "blocks_worker: a second MultiWorkerMirroredStrategy with arguments "
                    "in one launch; the test must give this block a launch of its own."
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
        start = time.monotonic()
        try:
            exec(compile(source, label, "exec"), {"__name__": "__main__"})
        except BaseException:
            write_result({"done": done, "current": label, "error": traceback.format_exc()})
            print(f"--- {label} FAILED", flush=True)
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(1)
        done.append(label)
        print(f"--- {label} ran in {time.monotonic() - start:.1f} s", flush=True)
    write_result({"done": done, "current": None})
    print("--- all blocks ran", flush=True)
    # Skip TensorFlow's teardown (seconds of garbage collection and server
    # shutdown per worker): the result is written.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def run_blocks(blocks, tmp_path, num_workers=2, timeout=300):
    """Runs `blocks` ([label, source] pairs) in one launch, relaunching after a failure.

    A failing block is named, and the blocks after it run in a fresh
    launch, so one broken block neither hides nor breaks the others' results.

    Returns:
        (outcome, runs): {label: None (passed) or the failure text}, one
        entry per block, and the launches' `ClusterResult`s.
    """
    outcome, runs, todo = {}, [], list(blocks)
    while todo:
        spec = tmp_path / f"blocks{len(runs) + 1}.json"
        spec.write_text(json.dumps(todo))
        run = run_cluster(__file__, num_workers, str(spec), timeout=timeout)
        runs.append(run)
        labels = [label for label, _ in todo]
        # Where each rank stopped: None after its last block.
        stopped = [r["current"] if r else labels[0] for r in run.results]
        if run.returncode == 0 and stopped == [None] * num_workers:
            outcome.update({label: None for label in labels})
            break
        if None in stopped and run.returncode != 0:
            # Every block ran on one rank, but the job failed (e.g. the other
            # rank's exit): blame the last block, the one still running.
            stopped = [labels[-1] if s is None else s for s in stopped]
        failed = min((s for s in stopped if s is not None), key=labels.index)
        errors = [r["error"] for r in run.results if r and r.get("error") and r["current"] == failed]
        done = labels.index(failed)
        outcome.update({label: None for label in labels[:done]})
        outcome[failed] = (
            f"{failed} failed on {num_workers} workers (launcher exit {run.returncode}):\n"
            + ("".join(errors) or "no traceback: the block hung or a worker died\n")
            + f"--- output tail ---\n{run.tail(4000)}"
        )
        todo = todo[done + 1:]
    return outcome, runs


if __name__ == "__main__":
    main(sys.argv[1])
