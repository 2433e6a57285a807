"""keras-comm-run under a real Slurm: slurmctld + slurmd on this machine.

The fixture writes its own slurm.conf (its own ports, state and spool
directories, one node `localhost` with 4 CPUs), creates a munge key, and
starts munged, slurmctld and slurmd; it skips with the reason when Debian's
`slurm-wlm` and `munge` are not installed (CI installs them) or the test
cannot run the daemons (not root).

The jobs run tests/launcher/slurm_fit.py: a 2-task job step (one
launcher per task, each reading SLURM_PROCID / SLURM_STEP_NUM_TASKS /
SLURM_STEP_NODELIST) must train exactly what one process trains; a batch job
(examples/cluster/slurm.sbatch) whose first step is killed mid-fit must,
in its second step, resume from the backup to the uninterrupted weights.
If the launcher ignored Slurm, each task would run a one-worker job of its
own and rank 1 would never report.
"""

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from _cluster import LAUNCHER, REPO_DIR, cluster_env
from keras_comm import launch

pytestmark = pytest.mark.multiprocess

SCRIPTS = Path(__file__).resolve().parent
FIT = str(SCRIPTS / "slurm_fit.py")
REPORT_ENV = str(SCRIPTS / "report_env.py")
SBATCH = str(REPO_DIR / "examples" / "cluster" / "slurm.sbatch")
_BINARIES = ("munged", "mungekey", "slurmctld", "slurmd", "srun", "sbatch", "scancel", "sinfo")


def _missing():
    missing = [b for b in _BINARIES if shutil.which(b) is None]
    if missing:
        return (f"Slurm is not installed (no {', '.join(missing)}); "
                "`apt-get install slurm-wlm munge` (Debian) runs these tests")
    if os.geteuid() != 0:
        return "slurmd must run as root to start jobs as the test's user"
    return None


def _conf(root, ports):
    ctld, slurmd, srun_low = ports
    return f"""\
ClusterName=kctest
SlurmctldHost=localhost(127.0.0.1)
SlurmctldPort={ctld}
SlurmdPort={slurmd}
SrunPortRange={srun_low}-{srun_low + 40}
AuthType=auth/munge
AuthInfo=socket={root}/munge.sock
CredType=cred/munge
SlurmUser=root
SlurmdUser=root
StateSaveLocation={root}/state
SlurmdSpoolDir={root}/spool
SlurmctldPidFile={root}/slurmctld.pid
SlurmdPidFile={root}/slurmd.pid
SlurmctldLogFile={root}/slurmctld.log
SlurmdLogFile={root}/slurmd.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SwitchType=switch/none
MpiDefault=none
SchedulerType=sched/builtin
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
JobCompType=jobcomp/none
AccountingStorageType=accounting_storage/none
JobAcctGatherType=jobacct_gather/none
ReturnToService=2
SlurmdParameters=config_overrides
PlugStackConfig=/dev/null
KillWait=5
NodeName=localhost NodeAddr=127.0.0.1 CPUs=4 State=UNKNOWN
PartitionName=test Nodes=localhost Default=YES MaxTime=INFINITE State=UP
"""


def _pid(path):
    try:
        return int(Path(path).read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return None


@pytest.fixture(scope="module")
def slurm(tmp_path_factory):
    """The environment (SLURM_CONF) of a running one-node Slurm cluster."""
    reason = _missing()
    if reason:
        pytest.skip(reason)
    root = tmp_path_factory.mktemp("slurm")
    root.chmod(0o755)  # munged refuses a socket directory others cannot enter
    for name in ("state", "spool"):
        (root / name).mkdir()
    ports = launch.pick_ports(2)
    srun_low = launch.pick_ports(1)[0]
    (root / "slurm.conf").write_text(_conf(root, [*ports, srun_low]))
    env = dict(os.environ, SLURM_CONF=str(root / "slurm.conf"))
    for var in [v for v in env if v.startswith(("SLURM_", "SBATCH_", "SRUN_"))]:
        if var != "SLURM_CONF":
            del env[var]
    pid_files = [root / "slurmd.pid", root / "slurmctld.pid", root / "munged.pid"]
    try:
        subprocess.run(["mungekey", "--create", f"--keyfile={root}/munge.key"],
                       check=True, capture_output=True, timeout=30)
        subprocess.run(
            ["munged", "--force", f"--key-file={root}/munge.key", f"--socket={root}/munge.sock",
             f"--pid-file={root}/munged.pid", f"--log-file={root}/munged.log",
             f"--seed-file={root}/munged.seed"],
            check=True, capture_output=True, timeout=30,
        )
        subprocess.run(["slurmctld", "-i"], env=env, check=True, capture_output=True, timeout=30)
        subprocess.run(["slurmd", "-N", "localhost"], env=env, check=True, capture_output=True,
                       timeout=30)
        deadline = time.monotonic() + 60
        while True:
            state = subprocess.run(["sinfo", "-h", "-o", "%T"], env=env, capture_output=True,
                                   text=True, timeout=30).stdout.strip()
            if state == "idle":
                break
            if time.monotonic() > deadline:
                logs = "".join(
                    f"\n--- {n} ---\n" + (root / n).read_text()[-2000:]
                    for n in ("slurmctld.log", "slurmd.log") if (root / n).exists()
                )
                pytest.fail(f"the test's Slurm node never became idle (state {state!r}){logs}")
            time.sleep(0.5)
        yield env
    finally:
        for path in pid_files:
            pid = _pid(path)
            if pid is not None:
                try:
                    os.kill(pid, signal.SIGTERM)
                except ProcessLookupError:
                    pass
        time.sleep(1.0)


def _env(slurm, out_dir, **extra):
    Path(out_dir).mkdir(parents=True, exist_ok=True)
    env = cluster_env(out_dir, extra)
    env["SLURM_CONF"] = slurm["SLURM_CONF"]
    for var in [v for v in env if v.startswith(("SLURM_", "SBATCH_", "SRUN_"))]:
        if var != "SLURM_CONF":
            del env[var]
    # The console script `keras-comm-run` of this Python, first on PATH.
    env["PATH"] = os.pathsep.join([str(Path(sys.executable).parent), env.get("PATH", "")])
    return env


def _tail(path, chars=3000):
    return Path(path).read_text()[-chars:] if Path(path).exists() else f"(no {path})"


def _results(out_dir, n):
    return [json.loads((Path(out_dir) / f"rank{r}.json").read_text())
            if (Path(out_dir) / f"rank{r}.json").exists() else None for r in range(n)]


def _max_rel(a, b):
    return max(
        float(np.abs(np.asarray(x) - np.asarray(y)).max() / max(np.abs(np.asarray(y)).max(), 1e-12))
        for x, y in zip(a, b)
    )


def test_slurm_job_step_trains_like_one_process_and_a_killed_step_resumes_exactly(slurm, tmp_path):
    if shutil.which("keras-comm-run", path=str(Path(sys.executable).parent)) is None:
        pytest.skip("the keras-comm-run console script is not installed (pip install -e .)")
    # One process, no Slurm: the reference, trained here (slurm_fit.train
    # under the default strategy).
    import tensorflow as tf

    from slurm_fit import train

    one = {"weights": [w.tolist() for w in train(tf.distribute.get_strategy()).get_weights()]}

    # srun: a 2-task job step, one launcher per task, settings from SLURM_*.
    out = tmp_path / "srun-out"
    step = subprocess.run(
        ["srun", "--ntasks=2", "--cpus-per-task=1", "--kill-on-bad-exit=1", "--time=10",
         "keras-comm-run", "--timeout", "300", FIT, str(tmp_path / "srun")],
        env=_env(slurm, out), stdin=subprocess.DEVNULL, capture_output=True, text=True, timeout=400,
    )
    print(f"srun: exit {step.returncode}\n{step.stdout[-2000:]}\n{step.stderr[-2000:]}")
    assert step.returncode == 0, step.stdout[-3000:] + step.stderr[-3000:]
    two = _results(out, 2)
    assert all(r is not None for r in two), (two, step.stderr[-3000:])
    assert [r["rank"] for r in two] == [0, 1]
    assert [r["slurm_procid"] for r in two] == ["0", "1"]
    assert [r["replicas"] for r in two] == [2, 2]
    assert two[0]["workers"] == two[1]["workers"] and len(two[0]["workers"]) == 2
    # The rendezvous port derives from the job id; workers listen above it.
    ports = [int(w.rsplit(":", 1)[1]) for w in two[0]["workers"]]
    assert ports[1] == ports[0] + 1 and 15001 <= ports[0] <= 25000
    assert two[0]["weights"] == two[1]["weights"]
    assert _max_rel(two[0]["weights"], one["weights"]) < 1e-5
    # Only the chief's output on the console (each task's launcher says so).
    assert "[rank 1]" not in step.stdout

    # sbatch: examples/cluster/slurm.sbatch; the first step is killed mid-fit.
    out = tmp_path / "sbatch-out"
    state = tmp_path / "sbatch"
    batch = subprocess.Popen(
        ["sbatch", "--parsable", "--wait", "--nodes=1", "--ntasks=2", "--ntasks-per-node=2",
         "--cpus-per-task=1", "--time=15", f"--output={tmp_path}/job.out", SBATCH,
         FIT, str(state), "--pause-once"],
        env=_env(slurm, out, MAX_ATTEMPTS=2, WORKERS_PER_TASK=1), stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )
    try:
        job_id = batch.stdout.readline().strip().split(";")[0]
        assert job_id.isdigit(), (job_id, batch.stderr.read() if batch.poll() is not None else "")
        deadline = time.monotonic() + 300
        while not (state / "paused").exists():
            assert batch.poll() is None, _tail(tmp_path / "job.out")
            assert time.monotonic() < deadline, "the first step never reached the pause"
            time.sleep(0.2)
        paused = json.loads((state / "paused").read_text())
        killed = subprocess.run(["scancel", "--signal=KILL", f"{job_id}.0"],
                                env=_env(slurm, out), capture_output=True, text=True, timeout=60)
        assert killed.returncode == 0, killed.stderr
        batch.wait(timeout=400)
    finally:
        if batch.poll() is None:
            subprocess.run(["scancel", job_id], env=_env(slurm, out), capture_output=True)
            batch.kill()
        batch.communicate()
    job_out = _tail(tmp_path / "job.out", 100000)
    print(f"sbatch job {job_id}: exit {batch.returncode}\n{job_out[-3000:]}")
    assert batch.returncode == 0, job_out[-4000:]
    assert "step failed (attempt 1 of 2)" in job_out
    assert paused["step"] == 17
    resumed = _results(out, 2)
    assert all(r is not None for r in resumed), job_out[-3000:]
    for r in resumed:
        assert r["restored"] == {"epoch": 1, "step": 3}, r["restored"]
        assert r["replicas"] == 2
        # Exactly the uninterrupted 2-task job's weights.
        assert r["weights"] == two[0]["weights"]


def test_slurm_allocation_smaller_than_n_fails_every_task(slurm, tmp_path):
    start = time.monotonic()
    step = subprocess.run(
        ["srun", "--ntasks=2", "--cpus-per-task=1", "--time=5", *LAUNCHER, "-n", "2",
         "--rendezvous-timeout", "30", REPORT_ENV],
        env=_env(slurm, tmp_path), stdin=subprocess.DEVNULL, capture_output=True, text=True,
        timeout=120,
    )
    elapsed = time.monotonic() - start

    assert step.returncode != 0
    message = ("-n 2 workers need at least one CPU each, but Slurm gives this task 1 "
               "(SLURM_CPUS_PER_TASK=1)")
    # Both tasks (srun gathers their stderr) said it, and nothing started.
    assert step.stderr.count(message) >= 2, step.stderr
    assert "--cpus-per-task=2" in step.stderr
    assert not list(tmp_path.glob("rank*.json"))
    assert elapsed < 60, elapsed
