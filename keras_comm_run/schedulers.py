"""What a cluster scheduler tells a launcher: Slurm's and Kubernetes's variables.

Pure functions over an environment mapping (standard library only).

Slurm. Inside a job step (`srun`), every task is one launcher: one "node" of
the rendezvous. The variables are read as TensorFlow's `SlurmClusterResolver`
reads them: the task's rank `SLURM_PROCID`, the step's task count
`SLURM_STEP_NUM_TASKS` (`SLURM_NTASKS` for older Slurm) and node list
`SLURM_STEP_NODELIST` (`SLURM_JOB_NODELIST`), expanded with the same rules
(`n[1-2],m5` -> `n1, n2, m5`). Task 0 runs on the step's first node, which so
hosts the rendezvous. A batch script itself is not a step (no
`SLURM_STEP_ID`): a launcher there starts one node's workers only.

Kubernetes. An Indexed Job gives each pod `JOB_COMPLETION_INDEX` (0, 1, ...),
which is its node rank.
"""

import os
import re
from typing import NamedTuple

from keras_comm_run.cluster import LaunchError

# The rendezvous port in a Slurm job, unless given: 15000 + the job id's last
# four digits (PyTorch Lightning's rule), so that two jobs sharing a node
# rarely collide; a step that restarts in the same job reuses it.
_SLURM_PORT_BASE = 15000

KUBERNETES_INDEX_VAR = "JOB_COMPLETION_INDEX"


class SlurmStep(NamedTuple):
    """The job step this process is a task of."""

    job_id: str
    task: int  # SLURM_PROCID
    num_tasks: int  # tasks in the step
    hosts: list  # the step's nodes, in order
    tasks_per_node: list  # tasks on each of `hosts`
    cpus_per_task: int  # CPUs Slurm gives this task
    cpus_source: str  # the variable(s) `cpus_per_task` comes from

    @property
    def master_addr(self):
        return self.hosts[0]

    @property
    def default_master_port(self):
        digits = re.sub(r"\D", "", self.job_id)[-4:] or "0"
        return _SLURM_PORT_BASE + int(digits)


def expand_hostlist(text, name="SLURM_STEP_NODELIST"):
    """Expands a Slurm host list: `"n[1-2],m5,o[08-10]"` -> `["n1", "n2", "m5", "o08", "o09", "o10"]`.

    Order is kept and nothing is deduplicated, as in `SlurmClusterResolver`.

    Raises:
        LaunchError: naming `name` if `text` is not a host list.
    """
    hosts = []
    # Split at commas outside brackets.
    parts, depth, current = [], 0, ""
    for char in text:
        if char == "[":
            depth += 1
        elif char == "]":
            depth -= 1
        if char == "," and depth == 0:
            parts.append(current)
            current = ""
        else:
            current += char
        if depth not in (0, 1):
            break
    parts.append(current)
    for part in parts:
        match = re.fullmatch(r"([^,\[\]]+)(?:\[([^\[\]]+)\])?([^,\[\]]*)", part)
        if depth != 0 or match is None:
            raise LaunchError(
                f"{name} must be a Slurm host list such as 'node[01-04],gpu7'. "
                f"Received: {name}={text!r}"
            )
        prefix, ranges, suffix = match.groups()
        if ranges is None:
            hosts.append(prefix + suffix)
            continue
        for item in ranges.split(","):
            low, _, high = item.partition("-")
            high = high or low
            if not (low.isdigit() and high.isdigit() and int(low) <= int(high)):
                raise LaunchError(
                    f"{name} has a bad range {item!r} (want 'a-b' with a <= b). "
                    f"Received: {name}={text!r}"
                )
            hosts.extend(f"{prefix}{str(i).zfill(len(low))}{suffix}" for i in range(int(low), int(high) + 1))
    return hosts


def expand_tasks_per_node(text, name="SLURM_STEP_TASKS_PER_NODE"):
    """Expands Slurm's tasks per node: `"3(x2),2"` -> `[3, 3, 2]`."""
    counts = []
    for part in text.split(","):
        match = re.fullmatch(r"(\d+)(?:\(x(\d+)\))?", part.strip())
        if match is None:
            raise LaunchError(
                f"{name} must look like '2(x3),1'. Received: {name}={text!r}"
            )
        counts.extend([int(match.group(1))] * int(match.group(2) or 1))
    return counts


def _int(env, name):
    text = env[name]
    try:
        return int(text)
    except ValueError:
        raise LaunchError(f"{name} must be an integer. Received: {name}={text!r}") from None


def _first(env, *names):
    for name in names:
        if env.get(name):
            return name
    return None


def slurm_step(env=None):
    """The Slurm job step this process is a task of, or None outside a step.

    Raises:
        LaunchError: if the step's variables are inconsistent, naming them.
    """
    env = os.environ if env is None else env
    if not env.get("SLURM_STEP_ID") or not env.get("SLURM_PROCID"):
        return None
    tasks_var = _first(env, "SLURM_STEP_NUM_TASKS", "SLURM_NTASKS")
    nodes_var = _first(env, "SLURM_STEP_NODELIST", "SLURM_JOB_NODELIST", "SLURM_NODELIST")
    if tasks_var is None or nodes_var is None:
        raise LaunchError(
            "inside a Slurm job step (SLURM_STEP_ID is set) the launcher needs "
            "SLURM_STEP_NUM_TASKS and SLURM_STEP_NODELIST. Received: "
            f"SLURM_STEP_NUM_TASKS={env.get('SLURM_STEP_NUM_TASKS')!r}, "
            f"SLURM_STEP_NODELIST={env.get('SLURM_STEP_NODELIST')!r}"
        )
    task, num_tasks = _int(env, "SLURM_PROCID"), _int(env, tasks_var)
    hosts = expand_hostlist(env[nodes_var], nodes_var)
    if not 0 <= task < num_tasks:
        raise LaunchError(
            f"SLURM_PROCID must be in 0..{tasks_var}-1. "
            f"Received: SLURM_PROCID={task}, {tasks_var}={num_tasks}"
        )
    per_node_var = _first(env, "SLURM_STEP_TASKS_PER_NODE", "SLURM_TASKS_PER_NODE")
    tasks_per_node = (
        expand_tasks_per_node(env[per_node_var], per_node_var) if per_node_var else [num_tasks]
    )
    cpus, source = _task_cpus(env, hosts, tasks_per_node)
    return SlurmStep(
        job_id=env.get("SLURM_JOB_ID", "0"),
        task=task,
        num_tasks=num_tasks,
        hosts=hosts,
        tasks_per_node=tasks_per_node,
        cpus_per_task=cpus,
        cpus_source=source,
    )


def _task_cpus(env, hosts, tasks_per_node):
    """CPUs Slurm gives this task, and the variables that say so."""
    if env.get("SLURM_CPUS_PER_TASK"):
        return _int(env, "SLURM_CPUS_PER_TASK"), f"SLURM_CPUS_PER_TASK={env['SLURM_CPUS_PER_TASK']}"
    if env.get("SLURM_CPUS_ON_NODE"):
        # The job's CPUs on this node, shared by the step's tasks there.
        node = env.get("SLURMD_NODENAME")
        here = tasks_per_node[hosts.index(node)] if node in hosts and len(tasks_per_node) == len(hosts) else (
            tasks_per_node[0] if len(tasks_per_node) == 1 else 1)
        cpus = _int(env, "SLURM_CPUS_ON_NODE")
        return max(1, cpus // max(1, here)), (
            f"SLURM_CPUS_ON_NODE={cpus} shared by {here} task(s) of this step on the node; "
            f"SLURM_CPUS_PER_TASK is unset")
    return 1, "SLURM_CPUS_PER_TASK is unset (Slurm's default: 1 CPU per task)"


def batch_script_note(env=None):
    """A warning for a launcher in a Slurm batch script outside `srun`, or None."""
    env = os.environ if env is None else env
    if env.get("SLURM_JOB_ID") and not env.get("SLURM_STEP_ID"):
        try:
            nodes = int(env.get("SLURM_NNODES", "1"))
        except ValueError:
            nodes = 1
        if nodes > 1:
            return (
                f"this Slurm job has {nodes} nodes but the launcher runs outside a job step, "
                "so it starts this node's workers only; start one launcher per task with "
                "`srun keras-comm-run ...`."
            )
    return None


def kubernetes_node_rank(env=None):
    """`JOB_COMPLETION_INDEX` as an int (an Indexed Job's pod index), or None."""
    env = os.environ if env is None else env
    text = env.get(KUBERNETES_INDEX_VAR)
    if text is None or text == "":
        return None
    try:
        return int(text)
    except ValueError:
        raise LaunchError(
            f"{KUBERNETES_INDEX_VAR} must be an integer (the pod's index in an Indexed Job). "
            f"Received: {KUBERNETES_INDEX_VAR}={text!r}"
        ) from None
