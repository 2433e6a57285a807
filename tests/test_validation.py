"""The shared argument checks: pure Python, importable without TensorFlow."""

import math
import subprocess
import sys

import pytest

from keras_comm import _validation as V


def test_module_needs_only_the_standard_library():
    # Loaded by file path, so the package's __init__ (which imports
    # TensorFlow) does not run: the launcher can use these checks alone.
    code = (
        "import importlib.util, sys; "
        f"spec = importlib.util.spec_from_file_location('v', {V.__file__!r}); "
        "spec.loader.exec_module(importlib.util.module_from_spec(spec)); "
        "assert 'tensorflow' not in sys.modules and 'keras' not in sys.modules"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


@pytest.mark.parametrize(
    "check, value, result",
    [
        (lambda v: V.boolean(v, "flag"), False, False),
        (lambda v: V.integer(v, "axis"), -3, -3),
        (lambda v: V.integer(v, "tag", minimum=0), 0, 0),
        (lambda v: V.positive_int(v, "units"), 4, 4),
        (lambda v: V.accumulation_steps(v), 1, 1),
        (lambda v: V.positive_number(v, "factor"), 0.5, 0.5),
        (lambda v: V.nonzero_number(v, "divisor"), -2, -2),
        (lambda v: V.timeout(v), 3, 3.0),
        (lambda v: V.optional_timeout(v), None, None),
        (lambda v: V.rank(v, "root"), 2, 2),
        (lambda v: V.rank_in(v, (0, 2), "root"), 2, 2),
        (lambda v: V.rank_in(v, None, "root"), 5, 5),
        (lambda v: V.ranks(v), [3, 1], (1, 3)),
        (lambda v: V.one_of(v, ("a", "b"), "mode"), "b", "b"),
        (lambda v: V.divisible(v, 4, "units", "group size"), 8, 8),
        (lambda v: V.shape(v), [None, 3], (None, 3)),
    ],
)
def test_accepts(check, value, result):
    assert check(value) == result


@pytest.mark.parametrize(
    "check, error, text",
    [
        (lambda: V.boolean(1, "flag"), TypeError, "`flag` must be a bool. Received: flag=1"),
        (lambda: V.integer(1.0, "axis"), TypeError, "`axis` must be an int. Received: axis=1.0"),
        (lambda: V.integer(True, "axis"), TypeError, "Received: axis=True"),
        (lambda: V.integer(-1, "tag", minimum=0), ValueError, "an int >= 0. Received: tag=-1"),
        (lambda: V.integer(-1, "tag", 0, rule="an int >= 0 (why)"), ValueError, "(why). Received"),
        (lambda: V.positive_int(0, "units"), ValueError, "`units` must be an int >= 1. Received: units=0"),
        (lambda: V.positive_int(1.5, "units"), ValueError, "Received: units=1.5"),
        (lambda: V.accumulation_steps(True), ValueError, "Received: accumulation_steps=True"),
        (lambda: V.positive_number(0, "factor"), ValueError, "> 0. Received: factor=0"),
        (lambda: V.positive_number(math.nan, "factor"), ValueError, "Received: factor=nan"),
        (lambda: V.nonzero_number(0.0, "divisor"), ValueError, "Received: divisor=0.0"),
        (lambda: V.timeout("1"), TypeError, "Received: timeout='1'"),
        (lambda: V.timeout(math.inf, "seconds"), ValueError, "Received: seconds=inf"),
        (lambda: V.optional_timeout(0), ValueError, "> 0, so that a missing peer"),
        (lambda: V.rank(-1, "root"), ValueError, "global rank >= 0. Received: root=-1"),
        (lambda: V.rank("0", "root"), TypeError, "Received: root='0'"),
        (lambda: V.rank_in(1, (0, 2), "root"), ValueError, "member of `group` [0, 2]. Received: root=1"),
        (lambda: V.ranks("01"), TypeError, "Received: group='01'"),
        (lambda: V.ranks([0, 1.0]), TypeError, "(element 1.0)"),
        (lambda: V.ranks([]), ValueError, "must not be empty. Received: group=[]"),
        (lambda: V.ranks([1, 1], "groups"), ValueError, "(repeated: [1]). Received: groups=[1, 1]"),
        (lambda: V.one_of("c", ("a", "b"), "mode"), ValueError, "['a', 'b']. Received: mode='c'"),
        (lambda: V.divisible(6, 4, "units", "group size"), ValueError, "group size 4. Received: units=6"),
        (lambda: V.shape(None), TypeError, "Received: shape=None"),
        (lambda: V.shape([2, -1]), ValueError, "Received: shape=(2, -1)"),
    ],
)
def test_rejects_naming_argument_rule_and_value(check, error, text):
    with pytest.raises(error) as info:
        check()
    assert text in str(info.value)


def test_renamed_argument():
    kwargs = {"mean_flag": False, "other": 1}
    assert V.renamed(kwargs, "mean_flag", "mean", True, True) is False
    assert kwargs == {"other": 1}
    assert V.renamed({}, "mean_flag", "mean", False, True) is False
    with pytest.raises(TypeError, match="old name of `mean`.*Received: mean=False, mean_flag=True"):
        V.renamed({"mean_flag": True}, "mean_flag", "mean", False, True)
    with pytest.raises(TypeError, match="Received: mean_flag=1"):
        V.renamed({"mean_flag": 1}, "mean_flag", "mean", True, True, check=V.boolean)
    with pytest.raises(TypeError, match="Received: mean=1"):
        V.renamed({}, "mean_flag", "mean", 1, True, check=V.boolean)
