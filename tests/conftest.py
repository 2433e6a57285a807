"""Shared fixtures: in-process replicas on logical CPU devices.

The CPU is split into `NUM_LOGICAL_CPUS` logical devices when this file is
imported, before TensorFlow initialises its devices, so every in-process test
can run 2 or 4 replicas of a `MultiWorkerMirroredStrategy` in this process.
Multi-process tests live beside them and use `tests/_cluster.py`.
"""

import gc
import json
import os
import resource
import shutil
import sys
import tempfile
import time
from pathlib import Path

# One intra-op thread per TensorFlow process, this one and every worker it
# launches (they inherit the environment), unless the caller chose: the
# suite runs two pytest workers, and beside them up to 4 worker processes, on
# 2 cores. An op split over 2 threads waits for its slower half, and under
# that load the slower half waits for a time slice: a 4-replica KerasHub test
# that takes 32 s alone took 108 s beside two busy processes with TF's
# default (one thread per core) and 45 s with one. Values are unchanged.
os.environ.setdefault("TF_NUM_INTRAOP_THREADS", "1")

import _cluster
import _durations
import _schedule
import numpy as np
import pytest
import tensorflow as tf
from _shared import without_tf_data_autotune

NUM_LOGICAL_CPUS = 4


def _split_cpu():
    cpus = tf.config.list_physical_devices("CPU")
    try:
        tf.config.set_logical_device_configuration(
            cpus[0], [tf.config.LogicalDeviceConfiguration()] * NUM_LOGICAL_CPUS
        )
    except RuntimeError:
        # Devices already initialised (e.g. a plugin imported TF first): the
        # in-process fixtures will fail with a clear message instead.
        pass


_split_cpu()
# The epoch-change stall of tf.data autotuning costs the suite more wall time
# than its training does; see the helper's docstring.
without_tf_data_autotune()

_strategies = {}


def make_strategy(num_replicas):
    """A MultiWorkerMirroredStrategy over `num_replicas` local CPU devices."""
    available = len(tf.config.list_logical_devices("CPU"))
    if num_replicas > available:
        pytest.fail(
            f"{num_replicas} replicas need {num_replicas} logical CPUs; "
            f"only {available} exist (TF was initialised before conftest)."
        )
    if num_replicas not in _strategies:
        # Every in-process MWMS numbers its own collective groups from
        # 1 + _collective_key_base; strategies over different device sets
        # must not share numbers, or a second model.fit joins a group of the
        # wrong size ("joining a group with size 4, but that group has size 2").
        cls = tf.distribute.MultiWorkerMirroredStrategy
        cls._collective_key_base = 70000 + 1000 * num_replicas
        try:
            devices = [f"/cpu:{i}" for i in range(num_replicas)]
            _strategies[num_replicas] = cls._from_local_devices(devices)
        finally:
            cls._collective_key_base = 0
    return _strategies[num_replicas]


def live_bytes():
    """The bytes of TensorFlow's live CPU tensors, by its own allocator's count
    (`tf.config.experimental.get_memory_info`), after a garbage collection;
    skips the test where the allocator does not count (the system allocator)."""
    gc.collect()
    try:
        return tf.config.experimental.get_memory_info("CPU:0")["current"]
    except ValueError:
        pytest.skip("TensorFlow's CPU allocator does not count its bytes here")


def run_replicas(strategy, fn, *args, mode="function"):
    """Runs ``fn(*args)`` on every replica; returns one numpy nest per replica.

    `fn` runs in replica context (use ``keras_comm.rank()`` inside). `mode` is
    "eager" or "function" (the whole `strategy.run` inside one tf.function).
    """
    if mode == "function":
        out = tf.function(lambda: strategy.run(fn, args=args))()
    elif mode == "eager":
        out = strategy.run(fn, args=args)
    else:
        raise ValueError(f"mode must be 'eager' or 'function'. Received: {mode!r}")
    per_replica = [
        tf.nest.map_structure(lambda v, i=i: strategy.experimental_local_results(v)[i], out)
        for i in range(strategy.num_replicas_in_sync)
    ]
    return [tf.nest.map_structure(lambda t: np.asarray(t), r) for r in per_replica]


@pytest.fixture(autouse=True)
def _seeded():
    """Every test starts from one random state (Python, NumPy, TensorFlow and
    Keras initializers), whatever ran before it on its pytest-xdist worker:
    a test that draws or initialises without a seed of its own still gets
    the same numbers alone, in the suite, or in another order."""
    import keras  # here, not at the top: the CPU is split before Keras loads

    keras.utils.set_random_seed(0)


@pytest.fixture(scope="session")
def kerashub_references(tmp_path_factory):
    """Where the KerasHub models trained alone are kept, once per pytest run
    for every pytest-xdist worker (fully_shard_kerashub_worker.reference):
    in-process tests and the cluster launches compare with the same ones."""
    import fully_shard_kerashub_worker

    return fully_shard_kerashub_worker.reference_dir(tmp_path_factory)


@pytest.fixture(params=[2, 4], ids=lambda n: f"{n}replicas")
def strategy(request):
    """A 2- or 4-replica in-process MultiWorkerMirroredStrategy."""
    return make_strategy(request.param)


@pytest.fixture(params=["eager", "function"])
def mode(request):
    return request.param


# --- scheduling: longest tests first; the `slow` marker --------------------
#
# With `-n 2` the suite ends when the later of the two pytest-xdist workers
# does; a two-minute test picked up last keeps one core idle for two minutes.
# So tests are collected longest first (a stable sort: the others keep their
# order), and `--maxschedchunk=1` (pytest_configure below) makes xdist hand them out one
# by one as workers free up (its default sends each worker a quarter of its
# share as one consecutive chunk, which would give every long test to the
# first worker): greedy longest-processing-time scheduling.
# `--maxschedchunk` is set here rather than in pyproject's addopts so that
# pytest still starts without pytest-xdist (`-p no:xdist`).
#
# The expected seconds are tests/_durations.py's (a quiet run of the whole
# suite); a test expected to take `SLOW_SECONDS` or more is also marked
# `slow`, so that the inner loop (`-m "not slow and not multiprocess"`,
# docs/contributing.md) leaves it out.

# A test that launches worker processes, not named in _durations: after
# those, before the in-process ones (most take seconds).
_MULTIPROCESS_SECONDS = 30


def _expected_seconds(item):
    path, _, rest = item.nodeid.partition("::")
    name = path.rpartition("/")[2] + "::" + rest
    best = max((s for key, s in _durations.SECONDS.items() if name.startswith(key)), default=0)
    if not best and item.get_closest_marker("multiprocess") is not None:
        best = _MULTIPROCESS_SECONDS
    return best


# tryfirst: the markers added here must exist before pytest's own hook
# deselects by `-m`.
@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(config, items):
    seconds = {item.nodeid: _expected_seconds(item) for item in items}
    for item in items:
        if seconds[item.nodeid] >= _durations.SLOW_SECONDS:
            item.add_marker(pytest.mark.slow)
    # Every xdist worker collects and sorts identically (the key depends only
    # on the node id and markers), as xdist requires.
    items.sort(key=lambda item: -seconds[item.nodeid])
    path = _schedule.launches_file(getattr(config, "workerinput", None))
    if path:
        _schedule.write_launches(path, [
            item.nodeid for item in items
            if item.get_closest_marker("multiprocess") is not None
            and seconds[item.nodeid] >= _schedule.LAUNCH_SECONDS
        ])


def pytest_configure(config):
    if getattr(config.option, "maxschedchunk", "absent") is None:
        config.option.maxschedchunk = 1


# --- scheduling: one cluster launch at a time (tests/_schedule.py) ----------
#
# Optional hooks: pytest-xdist's, absent under `-p no:xdist`.
def _launches_path(config):
    if not hasattr(config, "_keras_comm_launches"):
        config._keras_comm_launches = Path(tempfile.mkdtemp(prefix="keras_comm_sched_")) / "launches.json"
    return config._keras_comm_launches


@pytest.hookimpl(optionalhook=True)
def pytest_configure_node(node):
    node.workerinput[_schedule.FILE_KEY] = str(_launches_path(node.config))


@pytest.hookimpl(optionalhook=True, tryfirst=True)
def pytest_xdist_make_scheduler(config, log):
    if config.getvalue("dist") != "load":
        return None  # another --dist the caller chose: xdist's own
    return _schedule.OneLaunchAtATime(config, log, _launches_path(config))


def pytest_unconfigure(config):
    path = getattr(config, "_keras_comm_launches", None)
    if path is not None:
        shutil.rmtree(path.parent, ignore_errors=True)


# --- a test that starts a cluster says so -----------------------------------
#
# `_cluster.run_cluster` asks before each launch: a test without the
# `multiprocess` marker fails, so `-m "not multiprocess"` (the inner loop)
# never waits for worker processes. (Module fixtures are not checked: they
# serve marked tests.)
_running = None


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_call(item):
    global _running
    _running = item
    try:
        yield
    finally:
        _running = None


def _launch_needs_the_marker():
    if _running is not None and _running.get_closest_marker("multiprocess") is None:
        pytest.fail(
            f"{_running.nodeid} starts worker processes (_cluster.run_cluster) but has no "
            "@pytest.mark.multiprocess: mark it, so that the inner loop leaves it out."
        )


_cluster.before_launch = _launch_needs_the_marker


# --- containment: one aborted collective must not fail every later test -----
#
# Once a collective of a process is aborted (a keras_comm timeout, a peer's
# error), TensorFlow fails every later collective of that process, and
# nothing short of discarding the eager context (and with it every variable
# and strategy the process holds) resets it. An in-process test that fails
# that way would take every later in-process test on the same pytest-xdist
# worker with it (one timeout can fail a hundred tests).
# So after such a test, an xdist worker process exits: xdist reports the
# test once more ("worker crashed"), starts a fresh worker and hands it the
# rest. Without xdist (`-n 0`) the later in-process tests fail at setup,
# naming the test that aborted the process's collectives.
_ABORT_TEXT = "Collective ops is aborted"
_aborted_by = None


def _is_collective_abort(exc):
    seen = set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        if isinstance(exc, tf.errors.OpError) and _ABORT_TEXT in (exc.message or ""):
            return True
        exc = exc.__cause__ or exc.__context__
    return False


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    global _aborted_by
    outcome = yield
    if call.when == "teardown" and hasattr(item, "_cpu_start"):
        own, children = _cpu_seconds()
        report = outcome.get_result()
        report.user_properties.append(("cpu_seconds", own + children - sum(item._cpu_start)))
        report.user_properties.append(("child_cpu_seconds", children - item._cpu_start[1]))
        # When and where it ran, for KERAS_COMM_TEST_CPU_JSON's timeline.
        worker = getattr(item.config, "workerinput", {}).get("workerid", "main")
        report.user_properties.append(("ran", [worker, item._wall_start, time.time()]))
    if _aborted_by is None and call.excinfo is not None and _is_collective_abort(call.excinfo.value):
        _aborted_by = item.nodeid


def pytest_runtest_setup(item):
    if _aborted_by is not None and item.get_closest_marker("inprocess") is not None:
        pytest.fail(
            f"{_aborted_by} aborted this process's collectives, and TensorFlow "
            "fails every later one: run this test in a fresh process."
        )


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    item._cpu_start = _cpu_seconds()
    item._wall_start = time.time()
    yield
    # `workerinput` marks a pytest-xdist worker process (not the environment
    # variable, which a pytest session started by a test inherits).
    if _aborted_by == item.nodeid and hasattr(item.config, "workerinput"):
        sys.stderr.write(
            f"\nconftest: {item.nodeid} aborted this process's collectives; "
            "this pytest-xdist worker exits so that a fresh one runs the rest.\n"
        )
        sys.stderr.flush()
        os._exit(3)


# --- CPU seconds per test ----------------------------------------------------
#
# Wall time hides what a test costs the 2-core machine: a launch of four
# workers can take little wall time and much CPU, which the other xdist
# worker then waits for. Each test's CPU seconds (this process and every
# child it waited for: launchers, workers, subprocesses) travel with its
# teardown report, and the run ends with the costliest, next to the total
# and the part spent in child processes. KERAS_COMM_TEST_CPU_JSON=PATH also
# writes every test's figures to PATH.
_CPU_SUMMARY_LINES = 15


def _cpu_seconds():
    """(this process's CPU seconds, its waited-for children's)."""
    own = resource.getrusage(resource.RUSAGE_SELF)
    children = resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime, children.ru_utime + children.ru_stime


def pytest_terminal_summary(terminalreporter):
    spent, in_children, ran = {}, {}, {}
    for reports in terminalreporter.stats.values():
        for report in reports:
            if getattr(report, "when", None) == "teardown":
                for key, value in getattr(report, "user_properties", ()):
                    if key == "cpu_seconds":
                        spent[report.nodeid] = value
                    elif key == "child_cpu_seconds":
                        in_children[report.nodeid] = value
                    elif key == "ran":
                        ran[report.nodeid] = value
    if not spent:
        return
    dump = os.environ.get("KERAS_COMM_TEST_CPU_JSON")
    if dump:
        # "ran": [pytest worker, wall start, wall end] (seconds since the epoch).
        Path(dump).write_text(json.dumps(
            {n: {"cpu_s": spent[n], "child_cpu_s": in_children.get(n, 0.0), "ran": ran.get(n)}
             for n in spent},
            indent=1, sort_keys=True,
        ))
    terminalreporter.write_sep("=", f"{_CPU_SUMMARY_LINES} most CPU-costly tests")
    for nodeid, seconds in sorted(spent.items(), key=lambda kv: -kv[1])[:_CPU_SUMMARY_LINES]:
        terminalreporter.write_line(f"{seconds:8.1f} CPU-s  {nodeid}")
    terminalreporter.write_line(
        f"{sum(spent.values()):8.1f} CPU-s in all, {len(spent)} tests "
        "(each test's process and the children it waited for; "
        f"{sum(in_children.values()):.1f} CPU-s of it in child processes)"
    )
