"""Several launchers of one job: settings from Slurm's and Kubernetes's
variables, and bad input that every node reports within the rendezvous
timeout. Workers here only report their environment (no TensorFlow); the
real Slurm cluster is tests/launcher/test_launch_slurm.py.
"""

import json
import re
import subprocess
import time
from pathlib import Path

import pytest

from _cluster import LAUNCHER, cluster_env, free_port_block
from keras_comm import launch
from keras_comm_run import schedulers

pytestmark = pytest.mark.multiprocess

REPORT_ENV = str(Path(__file__).resolve().parent / "report_env.py")


def _slurm_job_port(size):
    """(job id, its rendezvous port 15000 + id % 10000) with `size` free ports there."""
    import random

    for _ in range(200):
        port = random.randint(15000, 24999 - size)
        try:
            launch.pick_ports(size, base_port=port)
        except ValueError:
            continue
        return port - 15000 + 10000 * random.randint(1, 9), port
    raise AssertionError("no free port block")


def _slurm_task(task, num_tasks=2, **extra):
    """The variables srun gives task `task` of a step on one node `localhost`."""
    env = {
        "SLURM_JOB_ID": "4321", "SLURM_STEP_ID": "0", "SLURM_PROCID": str(task),
        "SLURM_STEP_NUM_TASKS": str(num_tasks), "SLURM_NTASKS": str(num_tasks),
        "SLURM_STEP_NODELIST": "localhost", "SLURM_JOB_NODELIST": "localhost",
        "SLURM_STEP_TASKS_PER_NODE": str(num_tasks), "SLURM_NNODES": "1", "SLURM_NODEID": "0",
        "SLURMD_NODENAME": "localhost", "SLURM_CPUS_ON_NODE": str(2 * num_tasks),
    }
    env.update({k: str(v) for k, v in extra.items()})
    return env


def _start(tmp_path, argv, env=None):
    return subprocess.Popen(
        [*LAUNCHER, *argv], env=cluster_env(tmp_path, env), stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )


def _finish(procs, timeout=60):
    outputs = []
    try:
        for proc in procs:
            outputs.append(proc.communicate(timeout=timeout))
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.communicate()
    return outputs


def _results(out_dir, n):
    return [json.loads((Path(out_dir) / f"rank{r}.json").read_text()) for r in range(n)]


# ---------------------------------------------------------------------------
# Slurm's variables, as SlurmClusterResolver reads them.
# ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    "text",
    ["n[1-2],m5,o[3-4,6,7-9]", "node[08-11]", "localhost", "a1,b[001-003]", "gpu[1,3,5]x"],
)
def test_hostlists_expand_as_tensorflow_expands_them(text):
    from tensorflow.python.distribute.cluster_resolver.slurm_cluster_resolver import (
        expand_hostlist, expand_tasks_per_node)

    if text.endswith("x"):  # a suffix after the range: beyond TensorFlow's parser
        assert schedulers.expand_hostlist(text) == ["gpu1x", "gpu3x", "gpu5x"]
    else:
        assert schedulers.expand_hostlist(text) == expand_hostlist(text)
    assert schedulers.expand_tasks_per_node("3(x2),2,1") == expand_tasks_per_node("3(x2),2,1")


@pytest.mark.parametrize("text", ["n[1-2", "n[3-1]", "a,,b", "n]1["])
def test_bad_hostlists_name_the_variable(text):
    with pytest.raises(ValueError, match=re.escape(f"Received: SLURM_STEP_NODELIST={text!r}")):
        schedulers.expand_hostlist(text)


def test_slurm_step_reads_the_step_and_ignores_a_batch_script():
    step = schedulers.slurm_step(_slurm_task(1, 3, SLURM_STEP_NODELIST="n[07-08]",
                                             SLURM_STEP_TASKS_PER_NODE="2,1",
                                             SLURMD_NODENAME="n08", SLURM_CPUS_ON_NODE="8"))
    assert (step.task, step.num_tasks, step.hosts, step.master_addr) == (1, 3, ["n07", "n08"], "n07")
    assert step.tasks_per_node == [2, 1]
    assert step.cpus_per_task == 8  # the only task of this step on n08
    assert step.default_master_port == 15000 + 4321
    # A batch script is not a step: no SLURM_STEP_ID.
    batch = {k: v for k, v in _slurm_task(0).items() if not k.startswith("SLURM_STEP")}
    assert schedulers.slurm_step(batch) is None
    assert "srun keras-comm-run" in schedulers.batch_script_note({**batch, "SLURM_NNODES": "2"})
    with pytest.raises(ValueError, match=r"Received: SLURM_PROCID=2, SLURM_STEP_NUM_TASKS=2"):
        schedulers.slurm_step(_slurm_task(2))


def test_two_slurm_tasks_form_one_job_from_slurm_variables_alone(tmp_path):
    job_id, port = _slurm_job_port(3)
    procs = [_start(tmp_path, ["--console-ranks", "all", "--timeout", "60", REPORT_ENV],
                    _slurm_task(t, SLURM_JOB_ID=job_id)) for t in (1, 0)]
    outputs = _finish(procs)

    assert [p.returncode for p in procs] == [0, 0], outputs
    results = _results(tmp_path, 2)
    workers = json.loads(results[0]["tf_config"])["cluster"]["worker"]
    # The step's first node hosts the rendezvous at 15000 + the job id's last digits.
    assert [w.rsplit(":", 1)[1] for w in workers] == [str(port + 1), str(port + 2)]
    for g, r in enumerate(results):
        assert json.loads(r["tf_config"])["task"]["index"] == g
        assert (r["RANK"], r["WORLD_SIZE"], r["LOCAL_WORLD_SIZE"]) == (str(g), "2", "1")
        assert r["KERAS_COMM_NODE_RANK"] == str(g)


def test_the_command_line_wins_over_slurm(tmp_path):
    # Slurm alone would make this task node 0 of 2 and wait for task 1.
    proc = _start(tmp_path, ["--nnodes", "1", "-n", "2", "--rendezvous-timeout", "5",
                             "--console-ranks", "all", REPORT_ENV],
                  _slurm_task(0, SLURM_CPUS_PER_TASK=2))
    outputs = _finish([proc])

    assert proc.returncode == 0, outputs
    assert [r["WORLD_SIZE"] for r in _results(tmp_path, 2)] == ["2", "2"]


# ---------------------------------------------------------------------------
# Bad input: every node stops with the same clear error, well within the
# rendezvous timeout.
# ---------------------------------------------------------------------------

RENDEZVOUS_TIMEOUT = 30


def _two_nodes(tmp_path, node_args, envs=(None, None)):
    port = free_port_block(4)
    start = time.monotonic()
    procs = [
        _start(tmp_path, ["--master-addr", "127.0.0.1", "--master-port", str(port),
                          "--rendezvous-timeout", str(RENDEZVOUS_TIMEOUT), *args, REPORT_ENV],
               env)
        for args, env in zip(node_args, envs)
    ]
    outputs = _finish(procs, timeout=RENDEZVOUS_TIMEOUT + 30)
    return procs, outputs, time.monotonic() - start


def test_a_node_rank_out_of_range_stops_every_node(tmp_path):
    procs, outputs, elapsed = _two_nodes(
        tmp_path, [["--nnodes", "2", "--node-rank", "0", "-n", "1"],
                   ["--nnodes", "2", "--node-rank", "2", "-n", "1"]])

    assert [p.returncode for p in procs] == [2, 2], outputs
    message = "the node rank must be in 0..1 (--nnodes 2). Received: --node-rank 2"
    for _, err in outputs:
        assert message in err, err
    assert "node 2 (127.0.0.1) cannot start" in outputs[0][1]
    assert elapsed < RENDEZVOUS_TIMEOUT / 2, elapsed
    assert not list(tmp_path.glob("rank*.json"))


def test_a_kubernetes_index_beyond_nnodes_names_job_completion_index(tmp_path):
    procs, outputs, elapsed = _two_nodes(
        tmp_path, [["--nnodes", "2", "-n", "1"]] * 2,
        envs=[{"JOB_COMPLETION_INDEX": "0"}, {"JOB_COMPLETION_INDEX": "2"}])

    assert [p.returncode for p in procs] == [2, 2], outputs
    for _, err in outputs:
        assert "Received: JOB_COMPLETION_INDEX=2" in err, err
    assert elapsed < RENDEZVOUS_TIMEOUT / 2, elapsed


def test_nnodes_that_differ_stop_every_node(tmp_path):
    procs, outputs, elapsed = _two_nodes(
        tmp_path, [["--nnodes", "2", "--node-rank", "0", "-n", "1"],
                   ["--nnodes", "3", "--node-rank", "1", "-n", "1"]])

    assert [p.returncode for p in procs] == [2, 2], outputs
    for _, err in outputs:
        assert "--nnodes differs: node 0 has 2. Received: nnodes=3" in err, err
    assert elapsed < RENDEZVOUS_TIMEOUT / 2, elapsed


def test_an_allocation_smaller_than_n_stops_every_task(tmp_path):
    # Task 1 has one CPU for two workers; task 0 is fine but hears of it.
    job_id, _ = _slurm_job_port(5)
    envs = [_slurm_task(0, SLURM_JOB_ID=job_id, SLURM_CPUS_PER_TASK=2),
            _slurm_task(1, SLURM_JOB_ID=job_id, SLURM_CPUS_PER_TASK=1)]
    start = time.monotonic()
    procs = [_start(tmp_path, ["-n", "2", "--rendezvous-timeout", str(RENDEZVOUS_TIMEOUT),
                               REPORT_ENV], env) for env in envs]
    outputs = _finish(procs, timeout=RENDEZVOUS_TIMEOUT + 30)
    elapsed = time.monotonic() - start

    assert [p.returncode for p in procs] == [2, 2], outputs
    message = ("-n 2 workers need at least one CPU each, but Slurm gives this task 1 "
               "(SLURM_CPUS_PER_TASK=1); ask Slurm for --cpus-per-task=2 or lower -n")
    assert message in outputs[1][1]
    assert f"node 1 (127.0.0.1) cannot start: {message}" in outputs[0][1]
    assert elapsed < RENDEZVOUS_TIMEOUT / 2, elapsed
    assert not list(tmp_path.glob("rank*.json"))


def test_an_unreachable_master_is_named_within_the_rendezvous_timeout(tmp_path):
    port = free_port_block(3)
    start = time.monotonic()
    proc = _start(tmp_path, ["--nnodes", "2", "--node-rank", "1", "--master-addr", "127.0.0.1",
                             "--master-port", str(port), "--rendezvous-timeout", "3", "-n", "1",
                             REPORT_ENV])
    ((_, err),) = _finish([proc])
    elapsed = time.monotonic() - start

    assert proc.returncode == 2, err
    assert f"cannot reach node 0 at 127.0.0.1:{port}" in err
    assert f"Received: master_addr='127.0.0.1', master_port={port}" in err
    assert 3 <= elapsed < 3 + 10, elapsed

    # Node 0 alone: names the node that never came and the settings to check.
    proc = _start(tmp_path, ["--nnodes", "2", "--node-rank", "0", "--master-port", str(port),
                             "--rendezvous-timeout", "3", "-n", "1", REPORT_ENV])
    ((_, err),) = _finish([proc])
    assert proc.returncode == 2, err
    assert "waiting for node(s) [1]" in err and "--rendezvous-timeout" in err
    assert f"--master-addr 127.0.0.1 --master-port {port}" in err


def test_a_master_addr_that_is_not_node_0s_is_named(tmp_path):
    port = free_port_block(3)
    proc = _start(tmp_path, ["--nnodes", "2", "--node-rank", "0", "--master-addr", "192.0.2.1",
                             "--allow-non-loopback", "--master-port", str(port),
                             "--rendezvous-timeout", "3", "-n", "1", REPORT_ENV])
    ((_, err),) = _finish([proc])

    assert proc.returncode == 2, err
    assert "--master-addr must be an address of node 0" in err
    assert f"Received: master_addr='192.0.2.1', master_port={port}" in err


def test_a_master_name_that_never_resolves_is_named_within_the_timeout(tmp_path):
    port = free_port_block(3)
    start = time.monotonic()
    proc = _start(tmp_path, ["--nnodes", "2", "--node-rank", "1", "--master-addr",
                             "no-such-host.invalid", "--allow-non-loopback", "--master-port",
                             str(port), "--rendezvous-timeout", "3", "-n", "1", REPORT_ENV])
    ((_, err),) = _finish([proc])
    elapsed = time.monotonic() - start

    assert proc.returncode == 2, err
    assert "waiting for --master-addr no-such-host.invalid to resolve" in err
    assert "Received: master_addr='no-such-host.invalid'" in err
    assert elapsed < 3 + 10, elapsed
