"""Property-based tests on 2 in-process replicas: replicas that agree get the
closed-form answer; replicas that disagree in shape or dtype get an error
within the layer's timeout -- never a hang, never a wrong value.

`tests/layers/test_fuzz_layers.py` fuzzes constructor arguments on one replica; this
file fuzzes what differs *between* replicas.

A disagreement can end in a collective timeout (one replica refuses its input
in Python, e.g. an indivisible axis or an int64 it cannot move, while the
other waits), and a timed-out or mismatched collective aborts TensorFlow's
collective executor for the whole process. So agreeing inputs are fuzzed in
this process (checked mode, both eager and tf.function), and each
disagreeing example runs in a fresh process (forked from a server that
imported TensorFlow once) with a wall-clock bound, in checked or unchecked
mode.
"""

import json
import os
import subprocess
import sys
import time

import numpy as np
import pytest
import tensorflow as tf
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import keras_comm
from keras_comm import layers
from conftest import make_strategy, run_replicas

# Per layer: (constructor, closed form of replica r's output from the inputs
# of both replicas). Each layer gets a short timeout of its own.
TIMEOUT = 5.0
SLACK = 10.0  # scheduling on a loaded 2-core machine, not the collective


def _split0(x, n, i):
    return np.split(x, n, axis=0)[i]


CASES = {
    "AllReduce": (lambda: layers.AllReduce(timeout=TIMEOUT), lambda xs, r: xs[0] + xs[1]),
    "AllGather": (lambda: layers.AllGather(timeout=TIMEOUT),
                  lambda xs, r: np.concatenate(xs, axis=0)),
    "Broadcast": (lambda: layers.Broadcast(root=1, timeout=TIMEOUT), lambda xs, r: xs[1]),
    "ReduceScatter": (lambda: layers.ReduceScatter(timeout=TIMEOUT),
                      lambda xs, r: _split0(xs[0] + xs[1], 2, r)),
    "AlltoAll": (lambda: layers.AlltoAll(2, 0, 0, timeout=TIMEOUT),
                 lambda xs, r: np.concatenate([_split0(x, 2, r) for x in xs], axis=0)),
}

# float16/float64 inputs are autocast by Keras to the layer's float32, so two
# float dtypes do not disagree once inside the layer; ints are not cast.
DTYPES = ["float32", "float64", "int32", "int64"]
SHAPES = st.lists(st.integers(0, 4), min_size=1, max_size=3)


def _input(shape, dtype, rank):
    n = int(np.prod(shape))
    return (np.arange(n).reshape(shape) + 1 + 100 * rank).astype(dtype)


def _effective_dtype(dtype):
    return "float32" if dtype.startswith("float") else dtype


@st.composite
def replica_inputs(draw, differ=("none", "shape", "dtype", "both")):
    shape0 = draw(SHAPES)
    dtype0 = draw(st.sampled_from(DTYPES))
    differ = draw(st.sampled_from(differ))
    shape1 = draw(SHAPES.filter(lambda s: s != shape0)) if differ in ("shape", "both") else shape0
    dtype1 = (draw(st.sampled_from([d for d in DTYPES
                                    if _effective_dtype(d) != _effective_dtype(dtype0)]))
              if differ in ("dtype", "both") else dtype0)
    return [_input(shape0, dtype0, 0), _input(shape1, dtype1, 1)]


def _call(layer, xs, mode):
    strategy = make_strategy(2)

    def fn():
        # The replica id is a Python int here: each replica traces its own input.
        return layer(tf.constant(xs[keras_comm.rank()]))

    return run_replicas(strategy, fn, mode=mode)


def _agree(xs):
    return xs[0].shape == xs[1].shape and (
        _effective_dtype(str(xs[0].dtype)) == _effective_dtype(str(xs[1].dtype))
    )


def _expected_error(e):
    return isinstance(e, (ValueError, TypeError, tf.errors.OpError)) and str(e).strip()


@pytest.fixture
def checked():
    previous = keras_comm.get_check_calls()
    keras_comm.set_check_calls(True)
    yield
    keras_comm.set_check_calls(previous)


@pytest.mark.parametrize("name", sorted(CASES))
@settings(max_examples=10, deadline=None, suppress_health_check=list(HealthCheck))
@given(xs=replica_inputs(("none",)), mode=st.sampled_from(["eager", "function"]))
def test_two_replicas_agree_or_fail_cleanly(checked, name, xs, mode):
    make_layer, expected = CASES[name]
    start = time.monotonic()
    try:
        out = _call(make_layer(), xs, mode)
    except Exception as e:  # noqa: BLE001 (the property is about the type)
        elapsed = time.monotonic() - start
        assert _expected_error(e), f"{name} on {[(x.dtype, x.shape) for x in xs]}: {e!r}"
        assert elapsed < TIMEOUT + SLACK, f"{name} took {elapsed:.1f} s to fail"
        # Agreeing replicas may still be refused, but only for a stated rule
        # (an indivisible first axis, an unsupported dtype).
        assert isinstance(e, (ValueError, TypeError)), repr(e)
        return
    for r in range(2):
        want = expected([x.astype(_effective_dtype(str(x.dtype))) for x in xs], r)
        np.testing.assert_array_equal(out[r], want, err_msg=f"{name} replica {r}")


# One disagreeing call per process (it may abort the executor). A fork
# server imports TensorFlow, keras_comm and this file once (TensorFlow's
# runtime not started) and forks a fresh child per example, which starts its
# own runtime: each example still runs alone in a new process, without paying
# the ~7 s import each time.
_SERVER = r"""
import json, os, sys, time, traceback
# This file and conftest.py (tests/), as pytest imports them.
sys.path[:0] = [sys.argv[1], os.path.dirname(sys.argv[1])]
import numpy as np
import test_fuzz_replicas as T
import keras_comm
from tensorflow.python.eager import context

def example(name, mode, checked, specs):
    keras_comm.set_check_calls(checked)
    xs = [T._input(s, d, r) for r, (s, d) in enumerate(specs)]
    start = time.monotonic()
    try:
        T._call(T.CASES[name][0](), xs, mode)
        result = {"status": "returned"}
    except Exception as e:
        result = {"status": "error", "type": type(e).__name__, "message": str(e)[:500],
                  "expected": bool(T._expected_error(e))}
    result["elapsed"] = time.monotonic() - start
    print("RESULT " + json.dumps(result), flush=True)

for line in sys.stdin:
    request = json.loads(line)
    # A forked child must start its own TensorFlow runtime, never share ours.
    ctx = context.context_safe()
    assert ctx is None or not ctx._initialized, "the fork server initialised TensorFlow"
    log = request["log"]
    sys.stdout.flush(); sys.stderr.flush()
    pid = os.fork()
    if pid == 0:
        code = 1
        try:
            fd = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
            os.dup2(fd, 1); os.dup2(fd, 2); os.close(fd)
            example(*request["example"])
            code = 0
        except BaseException:
            traceback.print_exc()
        finally:
            sys.stdout.flush(); sys.stderr.flush()
            os._exit(code)
    deadline = time.monotonic() + request["timeout"]
    status = None
    while status is None and time.monotonic() < deadline:
        done, status = os.waitpid(pid, os.WNOHANG)
        status = status if done else None
        time.sleep(0.01)
    if status is None:
        os.kill(pid, 9)
        os.waitpid(pid, 0)
        code = None
    else:
        code = os.waitstatus_to_exitcode(status)
    print(json.dumps({"returncode": code}), flush=True)
"""
_EXAMPLE_TIMEOUT = 120


@pytest.fixture(scope="module")
def fork_server(tmp_path_factory):
    here = os.path.dirname(os.path.abspath(__file__))
    repo = os.path.dirname(os.path.dirname(here))
    env = dict(os.environ, PYTHONPATH=repo + os.pathsep + os.environ.get("PYTHONPATH", ""))
    server = subprocess.Popen([sys.executable, "-c", _SERVER, here], stdin=subprocess.PIPE,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    logs = tmp_path_factory.mktemp("fuzz_examples")
    count = [0]

    def run(example):
        """Runs `example` in a new forked process: (its output, exit code or None if hung)."""
        count[0] += 1
        log = logs / f"example{count[0]}.log"
        server.stdin.write(json.dumps({"example": example, "log": str(log),
                                       "timeout": _EXAMPLE_TIMEOUT}) + "\n")
        server.stdin.flush()
        reply = server.stdout.readline()
        if not reply:
            server.kill()
            pytest.fail("the fork server died: " + server.communicate()[1][-3000:])
        output = log.read_text(errors="replace") if log.exists() else ""
        return output, json.loads(reply)["returncode"]

    yield run
    server.stdin.close()
    try:
        server.wait(timeout=30)
    except subprocess.TimeoutExpired:
        server.kill()
        server.wait()


@pytest.mark.parametrize("name", sorted(CASES))
@settings(max_examples=2, deadline=None, suppress_health_check=list(HealthCheck))
@given(xs=replica_inputs().filter(lambda xs: not _agree(xs)),
       mode=st.sampled_from(["eager", "function"]), checked=st.booleans())
def test_disagreement_errors_in_a_fresh_process(fork_server, name, xs, mode, checked):
    specs = [[list(x.shape), str(x.dtype)] for x in xs]
    output, returncode = fork_server([name, mode, checked, specs])
    if returncode is None:
        pytest.fail(f"{name} {mode} checked={checked} on {specs} hung "
                    f"(no result in {_EXAMPLE_TIMEOUT} s)")
    lines = [l for l in output.splitlines() if l.startswith("RESULT ")]
    assert lines, output[-5000:]
    result = json.loads(lines[-1][len("RESULT "):])
    if result["status"] == "returned" and not any(x.size for x in xs):
        # Nothing to move: no collective is launched for empty inputs (TF's
        # CPU collectives crash on some), so each replica keeps its own.
        return
    assert result["status"] == "error", f"{name} {mode} checked={checked} on {specs} returned a value"
    assert result["expected"], result
    assert result["elapsed"] < TIMEOUT + SLACK, result
