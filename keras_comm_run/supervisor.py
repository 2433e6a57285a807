"""Supervision: start the workers, watch them, stop them all, restart the job.

`run` is the launcher's engine (the command line in `keras_comm_run.cli` only
parses into it). A job ends as soon as one worker fails, stalls, the
launcher is interrupted, or the timeout expires; with `max_restarts` a failed
or stalled job is stopped as a whole and started again, and the workers
resume from their own checkpoints (`keras_comm.callbacks.BackupAndRestore`).
"""

import os
import signal
import subprocess
import sys
import threading
import time

from keras_comm_run import bootstrap
from keras_comm_run import cluster
from keras_comm_run import output
from keras_comm_run import preload as preloading
from keras_comm_run.cluster import LaunchError
from keras_comm_run.rendezvous import rendezvous

PROG = "keras-comm-run"

# Exit codes of the launcher besides a failed worker's own code.
EXIT_USAGE = 2
EXIT_TIMEOUT = 124  # Same as coreutils `timeout`; also a stall not restarted.

# Stopping the other workers: first signal, then SIGKILL after this grace.
# grace + the SIGKILL wait stays well under the 10 s promised in --help.
_STOP_GRACE_SECONDS = 5.0
_KILL_WAIT_SECONDS = 2.0
_POLL_SECONDS = 0.05
# How long to wait for output still buffered in the pipes after a worker has
# exited (a stray grandchild may hold a pipe open forever).
_DRAIN_SECONDS = 3.0
# A worker that cannot bind its picked port (another program took it in the
# moment between the check and TensorFlow's bind) restarts the job with new
# ports, at most this many times, without counting as a restart.
_PORT_RETRIES = 3
# A hidden rank's stderr: the lines remembered, and the lines shown of a
# failure without a Python traceback.
_KEPT_ERROR_LINES = 400
_SHOWN_ERROR_LINES = 30


def describe_status(returncode):
    """(launcher exit code, human text) for a worker's Popen.returncode."""
    if returncode < 0:
        signum = -returncode
        try:
            name = signal.Signals(signum).name
        except ValueError:
            name = f"signal {signum}"
        return 128 + signum, f"killed by {name}"
    return returncode, f"exit code {returncode}"


def _group_exists(pgid):
    try:
        os.killpg(pgid, 0)
    except (ProcessLookupError, PermissionError):
        return False  # gone, or another user's group by now
    return True


def _parent_death_signal(forked=False):
    """A preexec_fn making a worker die with the launcher (Linux), or None.

    The launcher forwards SIGINT/SIGTERM/SIGHUP, but nothing can forward a
    SIGKILL of the launcher itself; the kernel's PR_SET_PDEATHSIG can. The
    ctypes function is looked up here, before fork, so the child only makes
    one foreign call. A preexec_fn can deadlock a child forked while other
    threads hold locks, so it is used only when the caller has no other
    threads (always true for the command line). A worker forked by
    `--preload` runs Python after the fork anyway (`forked=True`).
    """
    if not sys.platform.startswith("linux") or (threading.active_count() > 1 and not forked):
        return None
    try:
        import ctypes

        prctl = ctypes.CDLL(None, use_errno=True).prctl
    except (OSError, AttributeError):
        return None
    pr_set_pdeathsig = 1
    launcher_pid = os.getpid()

    def set_parent_death_signal():
        prctl(pr_set_pdeathsig, int(signal.SIGKILL), 0, 0, 0)
        # The launcher may have died between fork and prctl.
        if os.getppid() != launcher_pid:
            os._exit(128 + signal.SIGKILL)

    return set_parent_death_signal


class _Job:
    """One attempt: the local worker processes, their output, how to stop them."""

    def __init__(self, command, envs, ranks, view, fork_command=None):
        self.procs = []
        # A worker's process group id is its pid. Once the worker has exited
        # and the last process of its group is gone, the kernel may give that
        # number to an unrelated process group: such a group is never
        # signalled again (see `note_exits`).
        self._gone = set()
        self.ranks = ranks
        self.failed_ranks = []
        self.forwarders = []
        self._stderr = {}
        self.files = []
        self.last_activity = time.monotonic()
        preexec_fn = _parent_death_signal(forked=fork_command is not None)
        try:
            # All workers are forked before any reader thread exists, for
            # the preexec_fn's sake (and the preloaded fork's). The pipes
            # buffer output meanwhile.
            for env in envs:
                if fork_command is not None:
                    self.procs.append(preloading.start(
                        fork_command, env, preexec_fn,
                        close_fds=[p.fileno() for proc in self.procs
                                   for p in (proc.stdout, proc.stderr)],
                    ))
                    continue
                self.procs.append(
                    subprocess.Popen(
                        command,
                        env=env,
                        stdin=subprocess.DEVNULL,
                        stdout=subprocess.PIPE,
                        stderr=subprocess.PIPE,
                        # Own process group: the terminal's Ctrl-C reaches
                        # only the launcher, which forwards it, and killpg
                        # reaches the worker's own children too.
                        start_new_session=True,
                        preexec_fn=preexec_fn,
                    )
                )
            for rank, proc in zip(ranks, self.procs):
                for pipe, name in ((proc.stdout, "stdout"), (proc.stderr, "stderr")):
                    forwarder = view.forwarder(pipe, rank, name, self._active)
                    if name == "stderr":
                        self._stderr[rank] = forwarder
                    self.forwarders.append(forwarder)
                    if forwarder.log_file is not None:
                        self.files.append(forwarder.log_file)
        except BaseException:
            self.stop(signal.SIGKILL, grace=0.0)
            self.close_files()
            raise
        for forwarder in self.forwarders:
            forwarder.start()

    def stderr_forwarder(self, rank):
        return self._stderr.get(rank)

    def _active(self):
        self.last_activity = time.monotonic()

    def running(self):
        return [p for p in self.procs if p.poll() is None]

    def note_exits(self):
        """Records the groups of exited workers that have no process left.

        Called every poll (50 ms), so a group is known to be gone long before
        the kernel could cycle through the pid space and reuse its number.
        While any process of a group lives, its id cannot be reused.
        """
        for proc in self.procs:
            if proc.pid not in self._gone and proc.poll() is not None:
                if not _group_exists(proc.pid):
                    self._gone.add(proc.pid)

    def _signal_group(self, proc, signum):
        """Sends `signum` to a worker's process group unless it is gone."""
        self.note_exits()
        if proc.pid in self._gone:
            return False
        try:
            os.killpg(proc.pid, signum)
            return True
        except (ProcessLookupError, PermissionError):
            self._gone.add(proc.pid)
            return False

    def port_clash(self):
        return any(f.port_clash for f in self.forwarders)

    def stop(self, first_signal, grace=_STOP_GRACE_SECONDS, should_escalate=None):
        """Signals every worker's group, then SIGKILLs what is left.

        Returns the number of workers that were still running.
        """
        alive = self.running()
        for proc in alive:
            self._signal_group(proc, first_signal)
        deadline = time.monotonic() + grace
        while self.running() and time.monotonic() < deadline:
            if should_escalate is not None and should_escalate():
                break
            time.sleep(_POLL_SECONDS)
        # SIGKILL every group, including groups whose leader already exited
        # but left children behind: nothing of the job may outlive it.
        for proc in self.procs:
            self._signal_group(proc, signal.SIGKILL)
        deadline = time.monotonic() + _KILL_WAIT_SECONDS
        for proc in self.procs:
            try:
                proc.wait(timeout=max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                pass
        return len(alive)

    def drain(self):
        """Waits (bounded) for the output threads to print what is buffered."""
        deadline = time.monotonic() + _DRAIN_SECONDS
        for forwarder in self.forwarders:
            forwarder.thread.join(timeout=max(0.0, deadline - time.monotonic()))
        self.close_files()

    def close_files(self):
        for f in self.files:
            try:
                f.close()
            except OSError:
                pass
        self.files = []


class _View:
    """Where each rank's output goes: console (filtered), log files."""

    def __init__(self, out, err, prefix, console_ranks, progress, log_dir):
        self.out = out
        self.err = err
        self.prefix = prefix
        self.console_ranks = console_ranks
        self.progress = progress
        self.log_dir = log_dir
        self.attempt = 0

    def forwarder(self, pipe, rank, name, activity):
        shown = self.console_ranks is None or rank in self.console_ranks
        console = (self.out if name == "stdout" else self.err) if shown else None
        log_file = None
        if self.log_dir is not None:
            log_file = output.open_log(self.log_dir, rank, name, self.attempt)
        return output.Forwarder(
            pipe,
            console,
            f"[rank {rank}] " if self.prefix else "",
            log_file=log_file,
            redraws=self.progress == "all" or rank == 0,
            activity=activity,
            keep_lines=_KEPT_ERROR_LINES if console is None and name == "stderr" else 0,
        )

    def hidden_errors(self, job):
        """Shows the error of each failed rank whose stderr was off the console.

        From the last Python traceback on, or else the last lines, always
        prefixed with the rank (even with --no-prefix: unlabelled lines
        from a worker the console never showed would be unreadable).
        """
        for rank in job.failed_ranks:
            forwarder = job.stderr_forwarder(rank)
            if forwarder is None or forwarder.console is not None:
                continue
            lines = forwarder.tail()
            starts = [i for i, line in enumerate(lines) if line.startswith("Traceback (most recent")]
            lines = lines[starts[-1]:] if starts else lines[-_SHOWN_ERROR_LINES:]
            if not lines:
                continue
            self.err.write_line(
                f"{PROG}: rank {rank}'s output is off the console (--console-ranks); "
                f"the end of its stderr:"
            )
            self.err.write_line("\n".join(f"[rank {rank}] {line}" for line in lines))


class _SignalCatcher:
    """Records SIGINT/SIGTERM/SIGHUP sent to the launcher (main thread only).

    Workers run in their own sessions, so a closed terminal's SIGHUP would
    not reach them: it is forwarded like the others.
    """

    _SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)

    def __init__(self):
        self.received = []
        self._previous = {}

    def _handle(self, signum, frame):
        self.received.append(signum)

    def __enter__(self):
        if threading.current_thread() is threading.main_thread():
            for signum in self._SIGNALS:
                self._previous[signum] = signal.signal(signum, self._handle)
        return self

    def __exit__(self, *exc):
        for signum, handler in self._previous.items():
            signal.signal(signum, handler)
        return False


def python_command(command):
    """The worker argv for `command` (after checking its shape): `command`
    run by this Python under `keras_comm_run.bootstrap`."""
    return bootstrap.command(sys.executable, script_command(command))


def script_command(command):
    """`command` checked and normalised: `[script, *args]` or `["-m", module, *args]`."""
    if isinstance(command, (str, bytes)) or not command:
        raise LaunchError(
            "`command` must be a non-empty list such as ['script.py', '--x'] "
            f"or ['-m', 'package.module']. Received: command={command!r}"
        )
    command = [os.fspath(c) for c in command]
    if command[0] == "-m":
        if len(command) < 2 or not command[1] or command[1].startswith("-"):
            raise LaunchError(
                f"`-m` must be followed by a module name. Received: command={command!r}"
            )
    elif not os.path.isfile(command[0]):
        raise LaunchError(
            f"`script` must be an existing file. Received: script={command[0]!r}"
        )
    return command


# Argument checks (candidates for a shared keras_comm validation module).


def _check_int(name, value, low, high=None):
    if (
        isinstance(value, bool)
        or not isinstance(value, int)
        or value < low
        or (high is not None and value > high)
    ):
        rule = f">= {low}" if high is None else f"in {low}..{high}"
        raise LaunchError(f"`{name}` must be an integer {rule}. Received: {name}={value!r}")


def _check_seconds(name, value):
    if value is not None and (
        isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0
    ):
        raise LaunchError(f"`{name}` must be a number > 0 or None. Received: {name}={value!r}")


def _check_args(num_workers, timeout, base_port, nnodes, node_rank, master_port,
                max_restarts, stall_timeout, gpus_per_worker, progress, console_ranks):
    _check_int("num_workers", num_workers, 1)
    _check_seconds("timeout", timeout)
    _check_seconds("stall_timeout", stall_timeout)
    _check_int("max_restarts", max_restarts, 0)
    if (
        isinstance(base_port, bool)
        or not isinstance(base_port, int)
        or base_port < 0
        or (base_port and base_port + num_workers - 1 > 65535)
    ):
        raise LaunchError(
            "`base_port` must be 0 (pick free ports) or a port such that "
            f"base_port + num_workers - 1 <= 65535. Received: base_port={base_port!r}"
        )
    _check_int("nnodes", nnodes, 1)
    _check_int("node_rank", node_rank, 0, nnodes - 1)
    if nnodes > 1:
        if master_port is None:
            raise LaunchError(
                "`master_port` is required with several nodes. Received: master_port=None"
            )
        _check_int("master_port", master_port, 1, 65535)
        if base_port:
            raise LaunchError(
                "`base_port` cannot be combined with several nodes (ports derive from "
                f"master_port). Received: base_port={base_port!r}"
            )
        if max_restarts:
            raise LaunchError(
                "`max_restarts` is not supported with several nodes yet (a restart "
                f"must be agreed by every node). Received: max_restarts={max_restarts!r}"
            )
    if gpus_per_worker is not None:
        _check_int("gpus_per_worker", gpus_per_worker, 0)
    if progress not in ("chief", "all"):
        raise LaunchError(f"`progress` must be 'chief' or 'all'. Received: progress={progress!r}")
    if console_ranks is not None and (
        isinstance(console_ranks, (str, bytes))
        or not all(isinstance(r, int) and not isinstance(r, bool) and r >= 0 for r in console_ranks)
    ):
        raise LaunchError(
            "`console_ranks` must be None (all) or a collection of ranks >= 0. "
            f"Received: console_ranks={console_ranks!r}"
        )


def run(
    command,
    num_workers,
    *,
    host="127.0.0.1",
    allow_non_loopback=False,
    timeout=None,
    env=None,
    prefix=True,
    stdout=None,
    stderr=None,
    base_port=0,
    nnodes=1,
    node_rank=0,
    master_addr="127.0.0.1",
    master_port=None,
    rendezvous_timeout=300.0,
    max_restarts=0,
    stall_timeout=None,
    log_dir=None,
    console_ranks=None,
    progress="chief",
    gpus_per_worker=None,
    preload=None,
):
    """Runs `num_workers` copies of a Python command as a MWMS cluster.

    Args:
        command: list of arguments for the Python interpreter, e.g.
            `["train.py", "--epochs", "1"]` or `["-m", "pkg.mod", "--x"]`.
        num_workers: number of worker processes on this node, >= 1.
        host: address the workers reach each other at (TF_CONFIG), one node
            only. Loopback unless `allow_non_loopback=True`. TensorFlow
            itself listens on all interfaces regardless.
        allow_non_loopback: permit a non-loopback `host` / `master_addr`.
            TensorFlow's gRPC server is unauthenticated: isolated networks only.
        timeout: seconds after which all workers are stopped (None: no
            limit); it covers every restart.
        env: extra environment variables for the workers, layered over
            `os.environ`. The launcher's own environment is never changed.
        prefix: prefix each output line with `[rank i] `.
        stdout: text stream for the workers' stdout (default `sys.stdout`).
        stderr: text stream for the workers' stderr and the launcher's own
            messages (default `sys.stderr`).
        base_port: 0 to pick free ports, else use ports
            `base_port .. base_port + num_workers - 1` (one node).
        nnodes: number of nodes (launcher invocations) in the job.
        node_rank: this node's index, 0..nnodes-1; node 0 hosts the
            rendezvous and the chief.
        master_addr: node 0's address, reachable from every node.
        master_port: the rendezvous port on node 0 (several nodes). The
            worker of global rank g listens on `master_port + 1 + g`.
        rendezvous_timeout: seconds to wait for every node.
        max_restarts: how many times a failed or stalled job is stopped and
            started again (one node).
        stall_timeout: seconds without any output from any worker after
            which the job counts as stalled (None: never).
        log_dir: directory receiving `rank<g>.stdout.log` and
            `rank<g>.stderr.log` per worker (appended to across restarts).
        console_ranks: global ranks whose output reaches the console (None:
            all; the command line's default is `(0,)`, the chief). The log
            files get every rank; a hidden rank that fails has the end of
            its stderr shown.
        progress: "chief" shows only rank 0's '\\r'-redrawn lines (progress
            bars) on the console; "all" shows every rank's.
        gpus_per_worker: GPUs pinned to each worker with CUDA_VISIBLE_DEVICES,
            consecutive slices of the visible GPUs; None pins one per worker
            when GPUs are visible; 0 disables pinning.
        preload: None, or module names (e.g. `("tensorflow", "keras",
            "keras_comm")`) the launcher imports once before starting any
            worker; each worker (and each restart's) is then forked from the
            launcher instead of starting a new interpreter, saving every
            worker that import (see `keras_comm_run.preload`). POSIX only.

    Returns:
        0 if every worker exited 0; else the first failed worker's exit code
        (128 + signal number for a signal death), 124 on timeout or a stall,
        or 130 / 143 / 129 if the launcher received SIGINT / SIGTERM / SIGHUP.

    Raises:
        LaunchError (a ValueError): invalid arguments, a refused host, a busy
            port, a failed rendezvous, or a `preload` module that cannot be
            imported or leaves the launcher unsafe to fork. No worker has been started when it
            is raised.
    """
    _check_args(num_workers, timeout, base_port, nnodes, node_rank, master_port,
                max_restarts, stall_timeout, gpus_per_worker, progress, console_ranks)
    modules = preloading.check_modules(preload)
    python = python_command(command)
    base_env = dict(os.environ)
    if env:
        base_env.update({str(k): str(v) for k, v in env.items()})
    if modules:
        preloading.check_env(base_env, os.environ)
        preloading.import_modules(modules)
    gpus = cluster.assign_gpus(cluster.visible_gpus(base_env), num_workers, gpus_per_worker)
    if log_dir is not None:
        os.makedirs(log_dir, exist_ok=True)
    lock_state = output.Console.new_state()
    view = _View(
        output.Console(stdout if stdout is not None else sys.stdout, lock_state),
        output.Console(stderr if stderr is not None else sys.stderr, lock_state),
        prefix,
        None if console_ranks is None else frozenset(console_ranks),
        progress,
        log_dir,
    )

    with _SignalCatcher() as catcher:
        if nnodes > 1:
            _wait_for_master_name(master_addr, allow_non_loopback, rendezvous_timeout,
                                  lambda: bool(catcher.received), view.err)
            nodes = rendezvous(
                master_addr, master_port, nnodes, node_rank, num_workers,
                rendezvous_timeout, interrupted=lambda: bool(catcher.received),
            )
            first_rank = sum(n["num_workers"] for n in nodes[:node_rank])
            addresses = []
            for node in nodes:
                ports = cluster.node_ports(master_port, len(addresses), node["num_workers"])
                addresses.extend(cluster.address(node["host"], p) for p in ports)
            cluster.check_ports(
                cluster.node_ports(master_port, first_rank, num_workers), master_addr,
                f"master_port={master_port}",
            )

            def layout():
                return addresses
        else:
            cluster.check_host(host, allow_non_loopback)
            first_rank = 0
            fixed = cluster.pick_ports(num_workers, host, base_port) if base_port else None

            def layout():
                # Fixed ports are checked once, before anything starts; a
                # restart reuses them (freed by the stopped job).
                ports = fixed or cluster.pick_ports(num_workers, host)
                return [cluster.address(host, p) for p in ports]

        return _supervise_attempts(
            python, base_env, layout, first_rank, num_workers, node_rank, gpus, view,
            catcher, timeout, stall_timeout, max_restarts, picked=nnodes == 1 and not base_port,
            fork_command=script_command(command) if modules else None,
        )


def _wait_for_master_name(master_addr, allow_non_loopback, timeout, interrupted, err):
    """Checks `master_addr`, waiting (at most `timeout` s) for its name to resolve.

    Node 0's DNS name may appear only once node 0's pod exists (a
    Kubernetes pod's name under its headless Service), on any node.
    """
    deadline = time.monotonic() + timeout
    said = False
    while True:
        try:
            return cluster.check_host(master_addr, allow_non_loopback, "master_addr")
        except cluster.UnresolvedHost:
            if time.monotonic() > deadline or interrupted():
                raise
            if not said:
                err.write_line(f"{PROG}: waiting for --master-addr {master_addr} to resolve "
                               f"(at most {timeout:g} s, --rendezvous-timeout).")
                said = True
            time.sleep(1.0)


def _supervise_attempts(python, base_env, layout, first_rank, num_workers, node_rank, gpus,
                        view, catcher, timeout, stall_timeout, max_restarts, picked,
                        fork_command=None):
    err = view.err
    hidden = [r for r in range(first_rank, first_rank + num_workers)
              if view.console_ranks is not None and r not in view.console_ranks]
    if hidden:
        where = (f"in {view.log_dir}" if view.log_dir is not None
                 else "not kept (--log-dir DIR keeps it)")
        err.write_line(
            f"{PROG}: the console shows rank(s) {_ranks_text(view.console_ranks)}; the output "
            f"of rank(s) {_ranks_text(hidden)} is {where}; --console-ranks all shows every rank."
        )
    deadline = None if timeout is None else time.monotonic() + timeout
    attempt = 0
    port_retries = 0
    while True:
        addresses = layout()
        ranks = list(range(first_rank, first_rank + num_workers))
        envs = [
            cluster.worker_env(
                base_env, addresses, rank, local_rank=i, local_world_size=num_workers,
                node_rank=node_rank, attempt=attempt, gpus=None if gpus is None else gpus[i],
            )
            for i, rank in enumerate(ranks)
        ]
        view.attempt = attempt
        job = _Job(python, envs, ranks, view, fork_command)
        try:
            code, message, retry = _supervise(job, catcher, deadline, timeout, stall_timeout)
        finally:
            # After an unexpected error, nothing may survive either.
            if job.running():
                job.stop(signal.SIGKILL, grace=0.0)
        job.drain()
        view.hidden_errors(job)
        if message:
            err.write_line(message)
        if not retry:
            return code
        if picked and job.port_clash() and port_retries < _PORT_RETRIES:
            port_retries += 1
            err.write_line(
                f"{PROG}: a worker could not bind its port (taken by another program "
                f"after the launcher checked it); starting again with new ports "
                f"({port_retries} of {_PORT_RETRIES})."
            )
            continue
        if attempt >= max_restarts:
            if max_restarts:
                err.write_line(f"{PROG}: no restarts left (--max-restarts {max_restarts}).")
            return code
        attempt += 1
        err.write_line(
            f"{PROG}: restarting the job, attempt {attempt} of {max_restarts} "
            f"(KERAS_COMM_RESTART_ATTEMPT={attempt})."
        )


def _ranks_text(ranks):
    ranks = sorted(ranks)
    if not ranks:
        return "none"
    if len(ranks) > 2 and ranks == list(range(ranks[0], ranks[-1] + 1)):
        return f"{ranks[0]}-{ranks[-1]}"
    return ",".join(str(r) for r in ranks)


def _supervise(job, catcher, deadline, timeout, stall_timeout):
    """Waits for one attempt to finish, fail, stall, time out or be interrupted.

    Returns:
        (exit code, message or None, whether a restart may help).
    """
    while True:
        if catcher.received:
            signum = catcher.received[0]
            name = signal.Signals(signum).name
            # A second Ctrl-C while stopping skips the grace period.
            stopped = job.stop(signum, should_escalate=lambda: len(catcher.received) > 1)
            return 128 + signum, f"{PROG}: received {name}; stopped {stopped} worker(s).", False
        job.note_exits()
        for rank, proc in zip(job.ranks, job.procs):
            code = proc.poll()
            if code is not None and code != 0:
                exit_code, text = describe_status(code)
                # Every rank that had failed by now, before the stop below.
                job.failed_ranks = [
                    r for r, p in zip(job.ranks, job.procs) if p.poll() not in (None, 0)
                ]
                # Ctrl-C while stopping skips the grace period; the exit code
                # stays the failed worker's.
                stopped = job.stop(signal.SIGTERM, should_escalate=lambda: bool(catcher.received))
                message = (
                    f"{PROG}: worker rank {rank} failed ({text}); "
                    f"stopped the other {stopped} worker(s)."
                )
                return exit_code or 1, message, not catcher.received
        if all(p.returncode == 0 for p in job.procs):
            job.stop(signal.SIGTERM, grace=1.0)  # Leftover grandchildren only.
            return 0, None, False
        now = time.monotonic()
        if deadline is not None and now > deadline:
            stopped = job.stop(signal.SIGTERM, should_escalate=lambda: bool(catcher.received))
            return EXIT_TIMEOUT, f"{PROG}: timed out after {timeout:g} s; stopped {stopped} worker(s).", False
        if stall_timeout is not None and now - job.last_activity > stall_timeout:
            stopped = job.stop(signal.SIGTERM, should_escalate=lambda: bool(catcher.received))
            message = (
                f"{PROG}: no output from any worker for {stall_timeout:g} s "
                f"(--stall-timeout); stopped {stopped} worker(s)."
            )
            return EXIT_TIMEOUT, message, not catcher.received
        time.sleep(_POLL_SECONDS)
