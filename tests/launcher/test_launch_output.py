"""keras-comm-run's console: the chief's output by default, every rank's on
request, and a hidden rank's error always (no TensorFlow in the workers)."""

import subprocess
from pathlib import Path

import pytest

from _cluster import LAUNCHER, cluster_env

pytestmark = pytest.mark.multiprocess

SCRIPTS = Path(__file__).resolve().parent
REPORT_ENV = str(SCRIPTS / "report_env.py")
MISBEHAVE = str(SCRIPTS / "misbehave.py")


def _launch(tmp_path, *argv, timeout=60):
    return subprocess.run(
        [*LAUNCHER, *argv], env=cluster_env(tmp_path), stdin=subprocess.DEVNULL,
        capture_output=True, text=True, timeout=timeout,
    )


def test_only_the_chief_reaches_the_console_by_default(tmp_path):
    logs = tmp_path / "logs"  # not in the workers' output directory
    proc = _launch(tmp_path, "-n", "3", REPORT_ENV)

    assert proc.returncode == 0, proc.stderr
    assert proc.stdout == "[rank 0] stdout line from rank 0\n[rank 0] partial line from rank 0\n"
    assert "[rank 0] stderr line from rank 0\n" in proc.stderr
    assert "[rank 1]" not in proc.stderr and "[rank 2]" not in proc.stderr
    assert ("keras-comm-run: the console shows rank(s) 0; the output of rank(s) 1,2 is not kept "
            "(--log-dir DIR keeps it); --console-ranks all shows every rank.") in proc.stderr

    # With --log-dir every rank's output is in its file, and the note says where.
    proc = _launch(tmp_path, "-n", "2", "--log-dir", str(logs), REPORT_ENV)
    assert proc.returncode == 0, proc.stderr
    assert f"the output of rank(s) 1 is in {logs}" in proc.stderr
    assert (logs / "rank1.stdout.log").read_text() == (
        "stdout line from rank 1\npartial line from rank 1")
    assert (logs / "rank1.stderr.log").read_text() == "stderr line from rank 1\n"


def test_console_ranks_all_restores_every_rank(tmp_path):
    proc = _launch(tmp_path, "-n", "2", "--console-ranks", "all", REPORT_ENV)

    assert proc.returncode == 0, proc.stderr
    for r in range(2):
        assert f"[rank {r}] stdout line from rank {r}\n" in proc.stdout
        assert f"[rank {r}] stderr line from rank {r}\n" in proc.stderr
    assert "the console shows" not in proc.stderr


@pytest.mark.parametrize("extra", [[], ["--no-prefix"]], ids=["prefix", "no-prefix"])
def test_a_hidden_rank_that_fails_shows_its_traceback_prefixed(tmp_path, extra):
    script = tmp_path / "fail.py"
    script.write_text(
        "import os, sys, time\n"
        "print('noise before the error', file=sys.stderr, flush=True)\n"
        "def train():\n"
        "    raise RuntimeError('out of memory on rank ' + os.environ['RANK'])\n"
        "if os.environ['RANK'] == '1':\n"
        "    train()\n"
        "time.sleep(60)\n"
    )
    proc = _launch(tmp_path, "-n", "2", *extra, str(script))

    assert proc.returncode == 1, proc.stderr
    lines = proc.stderr.splitlines()
    start = lines.index("[rank 1] Traceback (most recent call last):")
    assert lines[start - 1] == (
        "keras-comm-run: rank 1's output is off the console (--console-ranks); "
        "the end of its stderr:")
    assert all(line.startswith("[rank 1] ") for line in lines[start:start + 4])
    assert "[rank 1] RuntimeError: out of memory on rank 1" in lines
    # From the traceback on: the noise before it stays off the console.
    assert "[rank 1] noise before the error" not in proc.stderr
    assert lines.index("[rank 1] RuntimeError: out of memory on rank 1") < lines.index(
        "keras-comm-run: worker rank 1 failed (exit code 1); stopped the other 1 worker(s).")


def test_a_hidden_rank_killed_without_a_traceback_shows_its_last_lines(tmp_path):
    proc = _launch(tmp_path, "-n", "2", MISBEHAVE, "--fail-rank", "1", "--exit-code", "3")

    assert proc.returncode == 3, proc.stderr
    assert "[rank 1] rank 1 failing now" in proc.stderr
    # A rank the launcher stopped is not a failure: no tail for rank 0.
    assert "rank 0's output is off the console" not in proc.stderr
