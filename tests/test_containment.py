"""tests/conftest.py's containment: an in-process test that aborts its
process's collectives costs that test only, not every later one.

Runs a small pytest session in a subprocess: one test aborts the process's
collectives (as a keras_comm timeout does), then in-process all-reduces
follow. Under pytest-xdist they pass on the fresh worker that replaces the
aborted one; without xdist they fail at setup, naming the aborting test.
"""

import subprocess
import sys
import textwrap

import pytest

from _cluster import REPO_DIR

_CONFTEST = textwrap.dedent(
    f"""
    import importlib.util
    import sys

    sys.path.insert(0, {str(REPO_DIR / "tests")!r})
    _spec = importlib.util.spec_from_file_location(
        "keras_comm_tests_conftest", {str(REPO_DIR / "tests" / "conftest.py")!r}
    )
    _real = importlib.util.module_from_spec(_spec)
    _spec.loader.exec_module(_real)
    # The real conftest's hooks and fixtures, under this file's names.
    globals().update({{k: v for k, v in vars(_real).items() if k.startswith("pytest_")}})
    make_strategy = _real.make_strategy
    """
)

_TESTS = textwrap.dedent(
    """
    import numpy as np
    import pytest
    import tensorflow as tf

    from conftest import make_strategy
    from keras_comm import ops as kc_ops
    from keras_comm._private import tf_api


    def _sum_on_two_replicas():
        strategy = make_strategy(2)
        out = tf.function(lambda: strategy.run(lambda: kc_ops.all_reduce(tf.ones([2]))))()
        return np.asarray(strategy.experimental_local_results(out)[0])


    @pytest.mark.inprocess
    def test_0_aborts():
        _sum_on_two_replicas()
        tf_api.abort_collective_ops(tf.errors.DEADLINE_EXCEEDED, "containment probe")
        _sum_on_two_replicas()


    @pytest.mark.inprocess
    @pytest.mark.parametrize("i", range(3))
    def test_1_later(i):
        np.testing.assert_array_equal(_sum_on_two_replicas(), [2.0, 2.0])
    """
)


def _session(tmp_path, *args):
    (tmp_path / "conftest.py").write_text(_CONFTEST)
    (tmp_path / "test_probe.py").write_text(_TESTS)
    return subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-o", "addopts=",
         "-o", "markers=inprocess: replicas in this process", "-rA", *args, str(tmp_path / "test_probe.py")],
        cwd=tmp_path, capture_output=True, text=True, timeout=600,
    )


@pytest.mark.multiprocess
def test_an_aborting_test_fails_alone_under_xdist(tmp_path):
    done = _session(tmp_path, "-n", "1")
    out = done.stdout + done.stderr
    assert done.returncode == 1, out
    assert "FAILED test_probe.py::test_0_aborts" in out, out
    assert "containment probe" in out, out
    for i in range(3):
        assert f"PASSED test_probe.py::test_1_later[{i}]" in out, out
    assert "aborted this process's collectives; this pytest-xdist worker exits" in out, out


@pytest.mark.multiprocess
def test_without_xdist_later_tests_name_the_aborting_one(tmp_path):
    done = _session(tmp_path, "-p", "no:xdist")
    out = done.stdout + done.stderr
    assert done.returncode == 1, out
    assert "1 failed" in out and "3 errors" in out and "containment probe" in out, out
    # (The summary lines repeat the reason when the terminal is wide: count
    # the tests, not the text.)
    for i in range(3):
        assert f"ERROR test_probe.py::test_1_later[{i}]" in out, out
    assert "test_probe.py::test_0_aborts aborted this process's collectives" in out, out
