"""The command line: `keras-comm-run -n N [options] script.py [args ...]`."""

import argparse
import os
import sys
from typing import NamedTuple

from keras_comm_run import cluster
from keras_comm_run import rendezvous
from keras_comm_run import schedulers
from keras_comm_run.cluster import LaunchError
from keras_comm_run.supervisor import EXIT_TIMEOUT
from keras_comm_run.supervisor import PROG
from keras_comm_run.supervisor import run

_EPILOG = """\
environment of each worker (g: global rank, i: rank on this node):
  TF_CONFIG               {"cluster": {"worker": ["127.0.0.1:p0", ...]},
                           "task": {"type": "worker", "index": g}}
                          read by tf.distribute.MultiWorkerMirroredStrategy.
  RANK, KERAS_COMM_RANK                       g
  WORLD_SIZE, KERAS_COMM_WORLD_SIZE           number of workers in the job
  LOCAL_RANK, KERAS_COMM_LOCAL_RANK           i
  LOCAL_WORLD_SIZE, KERAS_COMM_LOCAL_WORLD_SIZE  workers on this node (-n)
  KERAS_COMM_NODE_RANK    --node-rank
  KERAS_COMM_RESTART_ATTEMPT  0, then 1, 2, ... after each --max-restarts restart
  CUDA_VISIBLE_DEVICES    the worker's GPUs (see --gpus-per-worker)
  TF_NUM_INTRAOP_THREADS  unless set: the node's CPUs // -n (at least 1),
                          so the workers of a node share its cores instead
                          of each starting one thread per core.
  PYTHONUNBUFFERED        1, so worker output streams promptly.
  Every other variable is inherited unchanged.

addresses and ports:
  One node: TF_CONFIG names --host (default 127.0.0.1, loopback) with N free
  TCP ports picked below the kernel's ephemeral port range (so no outgoing
  connection can take one before TensorFlow binds it; a worker that still
  finds its port taken restarts the job with new ports, up to 3 times), or
  ports P..P+N-1 given --base-port P. TensorFlow's gRPC server is
  unauthenticated and runs any graph it is sent, so a non-loopback --host or
  --master-addr is refused unless --allow-non-loopback is also given. Note:
  TensorFlow itself listens on 0.0.0.0:port whatever TF_CONFIG says; on a
  machine with other network interfaces, firewall the ports or run in an
  isolated network namespace.

several nodes (torchrun style; run the same command on every node):
  keras-comm-run --nnodes 2 --node-rank K --master-addr HOST --master-port P \\
                 -n 2 script.py
  Node 0's launcher listens on HOST:P; the others report to it (their
  address as node 0 sees it, and their -n) and get the whole cluster back.
  Global ranks are numbered node by node; the worker of global rank g
  listens on port P+1+g of its node. The rendezvous port is unauthenticated
  like TensorFlow's. Slurm (SlurmClusterResolver) and Kubernetes recipes:
  docs/cluster.md.

output:
  Only the chief's (rank 0's) output reaches the console by default, as
  with tf-keras: --console-ranks all shows every rank's, --console-ranks
  0,2 some. --log-dir DIR writes every rank's output, unfiltered, to
  DIR/rank<g>.stdout.log and DIR/rank<g>.stderr.log. When a rank kept off
  the console fails, the end of its stderr (from its last Python traceback
  on) is shown, each line prefixed with "[rank g] ". Output is forwarded as
  it is written: each line (and each line a progress bar redraws with
  '\\r') starts with "[rank g] "; stdout to stdout, stderr to stderr.
  --no-prefix prints the text unchanged. With several ranks on the
  console, --progress chief (default) keeps the other ranks' redrawn lines
  (their progress bars) off it.

restarts:
  --max-restarts K: when a worker fails, or no worker writes anything for
  --stall-timeout seconds, all workers are stopped and the whole job is
  started again, at most K times; the cause is printed and the attempt
  number is in KERAS_COMM_RESTART_ATTEMPT. The script resumes from its own
  checkpoint (keras_comm.callbacks.BackupAndRestore). One node only.

stopping:
  A stop (a failed worker, --timeout, a stall) sends SIGTERM to every
  worker; SIGINT/SIGTERM/SIGHUP to the launcher are forwarded as such. Workers run under a small bootstrap
  (keras_comm_run.bootstrap) so that SIGTERM raises SystemExit(143) in the
  script's main thread even after TensorFlow's coordination service has
  taken the signal over: finally blocks and atexit handlers run, then the
  worker exits, at most KERAS_COMM_STOP_SECONDS (1.5) s after the signal. A
  SIGTERM handler the script installed (e.g. TensorFlow's
  PreemptionCheckpointHandler) is called instead and has the full 5 s.
  A worker whose script ends normally waits (at most
  KERAS_COMM_EXIT_WAIT_SECONDS, 3600 s) until every worker has ended: the
  chief hosts TensorFlow's coordination service, which peers still need.

exit status:
  0        every worker exited 0
  k        the first worker to fail exited with code k; the others were
           stopped (SIGTERM to each process group, SIGKILL 5 s later)
  128+s    the first worker to fail was killed by signal s
  124      --timeout expired, or a stall (--stall-timeout) with no restart
           left; all workers were stopped
  130/143  the launcher got SIGINT/SIGTERM (129: SIGHUP); it was forwarded to
           all workers, which were SIGKILLed if still running 5 s later. If
           the launcher itself is SIGKILLed, the kernel kills the workers
           (Linux).
  2        bad launcher arguments, a busy port or a failed rendezvous

schedulers:
  - Slurm: `srun keras-comm-run script.py` (or the same line in an sbatch
    script): each task is one node of the job; the launcher reads
    SLURM_PROCID, SLURM_STEP_NUM_TASKS and SLURM_STEP_NODELIST as
    TensorFlow's SlurmClusterResolver does, takes the step's first node as
    --master-addr, 15000 + the job id's last 4 digits as --master-port and
    -n 1, unless given; -n above the task's CPUs is refused.
  - Kubernetes: an Indexed Job, one pod per node, each running the same
    keras-comm-run --nnodes N --master-addr <job>-0.<service> line; the
    node rank is JOB_COMPLETION_INDEX (examples/cluster/kubernetes.yaml).
  Bad input on any node (a node rank out of range, too small an
  allocation) is sent to node 0, which stops every node with it.
  Keep the cluster network isolated: the gRPC port accepts any client.

preload:
  --preload tensorflow,keras,keras_comm imports the modules once in the
  launcher, then starts each worker with fork() instead of a new
  interpreter (gunicorn's --preload): each worker still creates its own
  TensorFlow runtime, strategy and gRPC server, and runs the script as
  `python script.py` would (environment, sys.argv, sys.path[0], __main__,
  exit codes, atexit handlers). It saves each worker the import (about
  7 CPU-seconds and 1-2 s of start-up for TensorFlow + Keras). Refused if
  a module cannot be imported, starts a thread on import or creates
  TensorFlow's runtime (runs an op, lists devices). Variables those modules
  read on import keep the launcher's value (KERAS_BACKEND,
  TF_CPP_MIN_LOG_LEVEL, TF_ENABLE_ONEDNN_OPTS).

check:
  --check (no script) runs an all-reduce of 1, 16 and 64 MB across every
  worker instead, prints the time, algbw and busbw (nccl-tests) per size
  and the slowest rank, and checks keras_comm's AllReduce layer against
  the raw collective; exit 3 naming the rank(s) that did not join within
  --rendezvous-timeout, 1 if a result differs.
"""


def _build_parser():
    parser = argparse.ArgumentParser(
        prog=PROG,
        usage=(
            f"{PROG} -n N [options] script.py [script args ...]\n"
            f"       {PROG} -n N [options] -m module [module args ...]\n"
            "       python -m keras_comm_run -n N [options] ..."
        ),
        description=(
            "Run N copies of a Python script on this machine as a "
            "tf.distribute.MultiWorkerMirroredStrategy cluster (over loopback, "
            "or across nodes with --nnodes). Everything after the script (or "
            "-m module) is passed to it unchanged."
        ),
        epilog=_EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
        allow_abbrev=False,
    )
    add = parser.add_argument
    add("-n", "--num-workers", type=int, default=None, metavar="N",
        help="number of worker processes on this node (>= 1; in a Slurm job step: 1 "
             "per task by default)")
    add("--host", default="127.0.0.1",
        help="address the workers reach each other at, one node (default: 127.0.0.1)")
    add("--allow-non-loopback", action="store_true",
        help="permit a non-loopback --host/--master-addr (unauthenticated gRPC: isolated "
             "networks only)")
    add("--base-port", type=int, default=0, metavar="PORT",
        help="use ports PORT..PORT+N-1 instead of picking free ones")
    add("--timeout", type=float, default=None, metavar="SECONDS",
        help=f"stop all workers after SECONDS and exit {EXIT_TIMEOUT}")
    add("--no-prefix", dest="prefix", action="store_false",
        help='do not prefix output lines with "[rank g] "')
    add("--nnodes", type=int, default=None, metavar="N",
        help="number of nodes, each running this launcher (default: 1; in a Slurm job "
             "step: its number of tasks)")
    add("--node-rank", type=int, default=None, metavar="K",
        help="this node's index, 0..N-1 (default: 0; SLURM_PROCID in a Slurm job step, "
             "JOB_COMPLETION_INDEX in a Kubernetes Indexed Job)")
    add("--master-addr", default=None, metavar="HOST",
        help="node 0's address, reachable from every node (default: 127.0.0.1; in a "
             "Slurm job step: the step's first node)")
    add("--master-port", type=int, default=None, metavar="P",
        help="rendezvous port on node 0; worker g listens on P+1+g (in a Slurm job: "
             "15000 + the job id's last 4 digits by default)")
    add("--rendezvous-timeout", type=float, default=300.0, metavar="SECONDS",
        help="how long to wait for every node, and with --check for every worker "
             "(default: 300)")
    add("--max-restarts", type=int, default=0, metavar="K",
        help="restart the whole job up to K times after a failure or stall")
    add("--stall-timeout", type=float, default=None, metavar="SECONDS",
        help="a job with no output from any worker for SECONDS has stalled")
    add("--log-dir", default=None, metavar="DIR",
        help="also write each rank's stdout/stderr to DIR/rank<g>.{stdout,stderr}.log")
    add("--console-ranks", default="0", metavar="RANKS",
        help='ranks whose output reaches the console: "0" (default: the chief), "all", '
             '"none" or e.g. "0,2"; a failed rank\'s error is always shown')
    add("--progress", choices=("chief", "all"), default="chief",
        help="whose progress bars ('\\r' redraws) reach the console (default: chief)")
    add("--gpus-per-worker", type=int, default=None, metavar="G",
        help="pin G GPUs per worker with CUDA_VISIBLE_DEVICES (default: 1 if GPUs are "
             "visible; 0: no pinning)")
    add("-H", "--hosts", default=None, metavar="HOSTS",
        help="not supported: run the launcher on each host with --nnodes (see below)")
    add("--check", action="store_true",
        help="instead of a script, check the cluster: all-reduce 1/16/64 MB across every "
             "worker, print the bus bandwidth and the slowest rank, and check keras_comm's "
             "AllReduce layer against the raw collective (the first command on a new cluster)")
    add("--preload", default=None, metavar="MODULES",
        help="import these comma-separated modules once in the launcher (e.g. "
             "tensorflow,keras,keras_comm) and fork each worker from it instead of "
             "starting a new Python: saves every worker (and restart) that import "
             "(POSIX; see 'preload' below)")
    add("-m", dest="module", metavar="module",
        help="run a module as a script, like `python -m` (must come last)")
    return parser


def _split_argv(parser, argv):
    """Splits argv into (launcher options, worker command).

    The worker command starts at the first argument that is neither an
    option nor an option's value: the script, or `-m module`. It is passed
    on byte for byte (argparse would drop a `--` after the script).
    """
    takes_value = {
        option
        for action in parser._actions
        if action.nargs != 0
        for option in action.option_strings
    }
    i = 0
    while i < len(argv):
        arg = argv[i]
        if arg == "--":
            return argv[:i], argv[i + 1 :]
        if arg == "-m":
            return argv[:i], argv[i:]
        if arg.startswith("-m") and not arg.startswith("--"):
            return argv[:i], ["-m", arg[2:], *argv[i + 1 :]]
        if not arg.startswith("-") or arg == "-":
            return argv[:i], argv[i:]
        if arg in takes_value:
            i += 2
        else:
            i += 1
    return argv, []


def _parse_console_ranks(parser, text):
    text = text.strip().lower()
    if text == "all":
        return None
    if text == "none":
        return ()
    try:
        ranks = tuple(int(r) for r in text.split(","))
    except ValueError:
        ranks = None
    if not ranks or any(r < 0 for r in ranks):
        parser.error(
            '--console-ranks must be "all", "none" or comma-separated ranks >= 0. '
            f"Received: --console-ranks {text!r}"
        )
    return ranks


class _Settings(NamedTuple):
    """The several-node settings, and where each came from (for messages)."""

    nnodes: int
    node_rank: int
    master_addr: str
    master_port: object
    origin: dict
    slurm: object


def _cluster_settings(args, env):
    """Fills what the command line leaves out from Slurm or Kubernetes.

    Inside a Slurm job step every task is a node: `--nnodes` defaults to the
    step's task count, `--node-rank` to `SLURM_PROCID`, `--master-addr` to
    the step's first node, `--master-port` to a port derived from the job id
    and `-n` to 1. In a Kubernetes Indexed Job `--node-rank` defaults to
    `JOB_COMPLETION_INDEX`. An option given on the command line always wins.
    """
    slurm = schedulers.slurm_step(env)
    origin = {}

    def pick(name, given, *candidates):
        if given is not None:
            origin[name] = f"--{name.replace('_', '-')} {given}"
            return given
        for value, source in candidates:
            if value is not None:
                origin[name] = f"{source}={value}" if source else str(value)
                return value
        raise AssertionError(name)

    nnodes = pick("nnodes", args.nnodes,
                  (slurm and slurm.num_tasks, "the Slurm step's task count"), (1, None))
    index = schedulers.kubernetes_node_rank(env) if nnodes > 1 else None
    node_rank = pick("node_rank", args.node_rank,
                     (slurm and slurm.task, "SLURM_PROCID"),
                     (index, schedulers.KUBERNETES_INDEX_VAR), (0, None))
    several = slurm is not None and nnodes > 1
    master_addr = pick("master_addr", args.master_addr,
                       (several and slurm.master_addr or None, "the Slurm step's first node"),
                       ("127.0.0.1", None))
    master_port = args.master_port
    if master_port is None and several:
        master_port = slurm.default_master_port
    if args.num_workers is None and slurm is not None:
        args.num_workers = 1
    return _Settings(nnodes, node_rank, master_addr, master_port, origin, slurm)


def _problem_for_every_node(args, settings):
    """Bad input that the other nodes must hear of too, or None."""
    if settings.nnodes < 1:
        return f"--nnodes must be >= 1. Received: {settings.origin['nnodes']}"
    if not 0 <= settings.node_rank < settings.nnodes:
        return (
            f"the node rank must be in 0..{settings.nnodes - 1} ({settings.origin['nnodes']}). "
            f"Received: {settings.origin['node_rank']}"
        )
    slurm = settings.slurm
    if slurm is not None and args.num_workers > slurm.cpus_per_task:
        return (
            f"-n {args.num_workers} workers need at least one CPU each, but Slurm gives this "
            f"task {slurm.cpus_per_task} ({slurm.cpus_source}); ask Slurm for "
            f"--cpus-per-task={args.num_workers} or lower -n. Received: -n {args.num_workers}"
        )
    return None


def _tell_every_node(args, settings, problem):
    """Sends a node's own bad input to the rendezvous so every node stops with it."""
    port = settings.master_port
    if settings.nnodes < 2 or not isinstance(port, int) or not 1 <= port <= 65535:
        return
    try:
        cluster.check_host(settings.master_addr, args.allow_non_loopback, "master_addr")
    except LaunchError:
        return
    sys.stderr.write(f"{PROG}: telling the other nodes why this node cannot start "
                     f"(at most {args.rendezvous_timeout:g} s, --rendezvous-timeout).\n")
    sys.stderr.flush()
    if settings.node_rank == 0:
        rendezvous.refuse(settings.master_addr, port, settings.nnodes, problem,
                          args.rendezvous_timeout)
    else:
        rendezvous.report_failure(settings.master_addr, port, settings.nnodes,
                                  settings.node_rank, problem, args.rendezvous_timeout)


def main(argv=None):
    """Console entry point. Returns the exit status (see `--help`)."""
    parser = _build_parser()
    argv = list(sys.argv[1:] if argv is None else argv)
    launcher_args, command = _split_argv(parser, argv)
    args = parser.parse_args(launcher_args)

    if args.hosts is not None:
        parser.error(
            "-H/--hosts (starting workers on other hosts over ssh) is not supported: run "
            f"`{PROG} --nnodes N --node-rank K --master-addr HOST --master-port P -n W "
            "script.py` on each host instead (see docs/cluster.md). "
            f"Received: -H {args.hosts}"
        )
    try:
        settings = _cluster_settings(args, os.environ)
    except LaunchError as e:
        parser.error(str(e))
    if args.num_workers is None:
        parser.error("the following arguments are required: -n/--num-workers")
    if args.num_workers < 1:
        parser.error(f"-n must be >= 1. Received: -n {args.num_workers}")
    if args.timeout is not None and not args.timeout > 0:
        parser.error(f"--timeout must be > 0. Received: --timeout {args.timeout:g}")
    if args.stall_timeout is not None and not args.stall_timeout > 0:
        parser.error(f"--stall-timeout must be > 0. Received: --stall-timeout {args.stall_timeout:g}")
    if args.base_port and not 1 <= args.base_port <= 65536 - args.num_workers:
        parser.error(
            f"--base-port must be 0 or a port with PORT+N-1 <= 65535. "
            f"Received: --base-port {args.base_port}"
        )
    if settings.nnodes > 1 and settings.master_port is None:
        parser.error(f"--master-port is required with --nnodes. Received: --nnodes {settings.nnodes}")
    if args.max_restarts < 0:
        parser.error(f"--max-restarts must be >= 0. Received: --max-restarts {args.max_restarts}")
    problem = _problem_for_every_node(args, settings)
    if problem:
        _tell_every_node(args, settings, problem)
        parser.error(problem)
    console_ranks = _parse_console_ranks(parser, args.console_ranks)
    preload = None
    if args.preload is not None:
        preload = tuple(m.strip() for m in args.preload.split(",") if m.strip())
        if not preload:
            parser.error("--preload must name at least one module, e.g. "
                         f"--preload tensorflow,keras_comm. Received: --preload {args.preload!r}")
    env = None
    if args.check:
        # Imported here: a worker running `-m keras_comm_run.check` imports
        # this package first, which must not have imported that module.
        from keras_comm_run import check

        if command:
            parser.error(
                "--check runs its own workers and takes no script. "
                f"Received: {' '.join(command)!r}"
            )
        command = ["-m", "keras_comm_run.check"]
        # The check's workers give up joining after the rendezvous timeout.
        env = {check.JOIN_SECONDS_VAR: f"{args.rendezvous_timeout:g}"}
    note = schedulers.batch_script_note()
    if note:
        sys.stderr.write(f"{PROG}: note: {note}\n")
    if not command:
        parser.error("a script (or -m module) to run is required, or --check.")
    if command[0] == "-m" and (len(command) < 2 or not command[1]):
        parser.error("-m must be followed by a module name. Received: -m")
    if command[0] != "-m" and not os.path.isfile(command[0]):
        parser.error(f"script must be an existing file. Received: script {command[0]!r}")

    try:
        return run(
            command,
            args.num_workers,
            env=env,
            host=args.host,
            allow_non_loopback=args.allow_non_loopback,
            timeout=args.timeout,
            prefix=args.prefix,
            base_port=args.base_port,
            nnodes=settings.nnodes,
            node_rank=settings.node_rank,
            master_addr=settings.master_addr,
            master_port=settings.master_port,
            rendezvous_timeout=args.rendezvous_timeout,
            max_restarts=args.max_restarts,
            stall_timeout=args.stall_timeout,
            log_dir=args.log_dir,
            console_ranks=console_ranks,
            progress=args.progress,
            gpus_per_worker=args.gpus_per_worker,
            preload=preload,
        )
    except LaunchError as e:
        parser.error(str(e))
