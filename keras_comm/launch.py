"""Local multi-process launcher: `keras-comm-run -n N script.py [args...]`.

Starts N copies of a Python script (or module) on this machine, each with the
`TF_CONFIG` that `tf.distribute.MultiWorkerMirroredStrategy` reads, prefixes
every output line with the worker's rank, and tears the whole job down as soon
as one worker fails, the launcher is interrupted, or an optional timeout
expires.

This module uses only the standard library: the launcher itself never imports
TensorFlow, so starting a job costs nothing beyond the workers' own start-up.

Example:

```
keras-comm-run -n 2 train.py --epochs 1
python -m keras_comm.launch -n 2 -m examples.mnist --epochs 1
```

From Python (tests, benchmarks):

```python
from keras_comm import launch
exit_code = launch.run(["train.py", "--epochs", "1"], num_workers=2, timeout=600)
```
"""

import argparse
import ipaddress
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time

PROG = "keras-comm-run"

# Exit codes of the launcher besides a failed worker's own code.
EXIT_USAGE = 2
EXIT_TIMEOUT = 124  # Same as coreutils `timeout`.

# Stopping the other workers: first signal, then SIGKILL after this grace.
# grace + the SIGKILL wait stays well under the 10 s promised in --help.
_STOP_GRACE_SECONDS = 5.0
_KILL_WAIT_SECONDS = 2.0
_POLL_SECONDS = 0.05
# How long to wait for output still buffered in the pipes after a worker has
# exited (a stray grandchild may hold a pipe open forever).
_DRAIN_SECONDS = 3.0
_MAX_LINE_BYTES = 1 << 16

_EPILOG = """\
environment of each worker:
  TF_CONFIG               {"cluster": {"worker": ["127.0.0.1:p0", ...]},
                           "task": {"type": "worker", "index": i}}
                          read by tf.distribute.MultiWorkerMirroredStrategy.
  KERAS_COMM_RANK         i (informational)
  KERAS_COMM_WORLD_SIZE   N (informational)
  PYTHONUNBUFFERED        1, so worker output streams promptly.
  Every other variable is inherited unchanged.

addresses and ports:
  TF_CONFIG names --host (default 127.0.0.1, loopback) with N free TCP ports,
  or with ports P..P+N-1 given --base-port P. Workers reach each other only
  at these addresses. TensorFlow's gRPC server is unauthenticated and runs any
  graph it is sent, so a non-loopback --host is refused unless
  --allow-non-loopback is also given. Note: TensorFlow itself listens on
  0.0.0.0:port whatever TF_CONFIG says; on a machine with other network
  interfaces, firewall the ports or run in an isolated network namespace.

output:
  Each line a worker writes is printed as "[rank i] <line>": stdout to stdout,
  stderr to stderr. --no-prefix prints the lines unchanged.

exit status:
  0        every worker exited 0
  k        the first worker to fail exited with code k; the others were
           stopped (SIGTERM to each process group, SIGKILL 5 s later)
  128+s    the first worker to fail was killed by signal s
  124      --timeout expired; all workers were stopped
  130/143  the launcher got SIGINT/SIGTERM (129: SIGHUP); it was forwarded to
           all workers, which were SIGKILLed if still running 5 s later. If
           the launcher itself is SIGKILLed, the kernel kills the workers
           (Linux).
  2        bad launcher arguments

several hosts (this launcher only starts processes on this machine):
  - by hand: on each host run the script with TF_CONFIG listing every
    host:port in "cluster" and that host's own "task" index;
  - Slurm: tf.distribute.cluster_resolver.SlurmClusterResolver() passed to
    MultiWorkerMirroredStrategy(cluster_resolver=...) under srun;
  - Kubernetes: a controller that sets TF_CONFIG per pod (e.g. Kubeflow's
    TFJob).
  Keep the cluster network isolated: the gRPC port accepts any client.
"""


class LaunchError(ValueError):
    """Launcher input that cannot be run (bad host, busy port, ...)."""


# ---------------------------------------------------------------------------
# Pure helpers: addresses, ports, environments.
# ---------------------------------------------------------------------------


def _resolve_host(host):
    """Returns the IP addresses `host` resolves to, or raises LaunchError."""
    if not isinstance(host, str) or not host or host != host.strip():
        raise LaunchError(
            f"`host` must be a non-empty IP address or host name. Received: host={host!r}"
        )
    try:
        infos = socket.getaddrinfo(host, None, type=socket.SOCK_STREAM)
    except (socket.gaierror, UnicodeError) as e:
        raise LaunchError(
            f"`host` must be an IP address or a resolvable host name "
            f"({e}). Received: host={host!r}"
        ) from None
    return sorted({info[4][0] for info in infos})


def _is_loopback(addresses):
    return all(ipaddress.ip_address(a.split("%")[0]).is_loopback for a in addresses)


def _check_host(host, allow_non_loopback):
    addresses = _resolve_host(host)
    if not allow_non_loopback and not _is_loopback(addresses):
        raise LaunchError(
            f"refusing to run the TensorFlow cluster on the non-loopback "
            f"address {host!r} ({', '.join(addresses)}): its gRPC server is "
            f"unauthenticated and runs any graph it is sent, so anyone who can "
            f"reach the port can run code as you. Use --allow-non-loopback "
            f"(allow_non_loopback=True) only on an isolated network. "
            f"Received: host={host!r}"
        )
    return addresses


def _address(host, port):
    """`host:port`, with IPv6 literals bracketed as gRPC expects."""
    if ":" in host and not host.startswith("["):
        return f"[{host}]:{port}"
    return f"{host}:{port}"


def _socket_family(host):
    """AF_INET6 for an IPv6 literal or a name resolving only to IPv6."""
    try:
        families = {info[0] for info in socket.getaddrinfo(host, None, type=socket.SOCK_STREAM)}
    except (socket.gaierror, UnicodeError):
        families = set()
    if ":" in host or families == {socket.AF_INET6}:
        return socket.AF_INET6
    return socket.AF_INET


def pick_ports(num_workers, host="127.0.0.1", base_port=0):
    """Returns `num_workers` distinct TCP ports that TensorFlow can listen on.

    TensorFlow's gRPC server listens on every interface (`0.0.0.0:port`)
    whatever address TF_CONFIG gives, so ports are probed on the wildcard
    address of `host`'s family: a port free only on loopback would still make
    the worker fail to start. With `base_port=0` the OS chooses each port
    (bind to port 0); all sockets stay open until every port is chosen, so
    the ports are distinct. With a `base_port`, the ports are
    `base_port .. base_port + num_workers - 1` and each is checked to be free.

    Raises:
        LaunchError: if a requested port is in use or cannot be bound.
    """
    family = _socket_family(host)
    wildcard = "::" if family == socket.AF_INET6 else "0.0.0.0"
    sockets = []
    try:
        for i in range(num_workers):
            port = base_port + i if base_port else 0
            s = socket.socket(family, socket.SOCK_STREAM)
            sockets.append(s)
            try:
                s.bind((wildcard, port))
            except OSError as e:
                raise LaunchError(
                    f"cannot use port {port} ({e.strerror or e}); TensorFlow "
                    f"listens on {_address(wildcard, port)}. "
                    f"Received: base_port={base_port}"
                ) from None
        return [s.getsockname()[1] for s in sockets]
    finally:
        for s in sockets:
            s.close()


def tf_config(addresses, rank):
    """The TF_CONFIG dict for worker `rank` of the cluster `addresses`."""
    return {
        "cluster": {"worker": list(addresses)},
        "task": {"type": "worker", "index": rank},
    }


def validate_tf_config(text):
    """Parses a TF_CONFIG string and checks it; returns the dict.

    Checks what tf.distribute otherwise reports late or obscurely: valid
    JSON, a "cluster" mapping job names to non-empty lists of "host:port"
    strings, and a "task" whose "type" is one of those jobs and whose int
    "index" is inside that job's list.

    Raises:
        ValueError: naming the problem and ending with the received value.
    """
    shown = text if len(str(text)) <= 200 else str(text)[:200] + "..."
    received = f"Received: TF_CONFIG={shown!r}"
    if not isinstance(text, str) or not text.strip():
        raise ValueError(f"TF_CONFIG must be a non-empty JSON string. {received}")
    try:
        config = json.loads(text)
    except json.JSONDecodeError as e:
        raise ValueError(f"TF_CONFIG is not valid JSON ({e}). {received}") from None
    if not isinstance(config, dict):
        raise ValueError(f"TF_CONFIG must be a JSON object. {received}")
    cluster = config.get("cluster")
    if not isinstance(cluster, dict) or not cluster:
        raise ValueError(
            'TF_CONFIG needs "cluster": {"worker": ["host:port", ...]}. ' + received
        )
    for job, addresses in cluster.items():
        if (
            not isinstance(addresses, list)
            or not addresses
            or not all(isinstance(a, str) and a.rpartition(":")[2].isdigit() for a in addresses)
        ):
            raise ValueError(
                f'TF_CONFIG "cluster"["{job}"] must be a non-empty list of '
                f'"host:port" strings. {received}'
            )
    task = config.get("task")
    if not isinstance(task, dict):
        raise ValueError(
            'TF_CONFIG needs "task": {"type": "worker", "index": i}. ' + received
        )
    job, index = task.get("type"), task.get("index")
    if job not in cluster:
        raise ValueError(
            f'TF_CONFIG "task"["type"] must be one of {sorted(cluster)}. {received}'
        )
    if isinstance(index, bool) or not isinstance(index, int) or not 0 <= index < len(cluster[job]):
        raise ValueError(
            f'TF_CONFIG "task"["index"] must be an int in 0..{len(cluster[job]) - 1} '
            f'(the "{job}" list has {len(cluster[job])} entries). {received}'
        )
    return config


def worker_env(base_env, addresses, rank):
    """A copy of `base_env` with the variables worker `rank` needs."""
    env = dict(base_env)
    env["TF_CONFIG"] = json.dumps(tf_config(addresses, rank))
    env["KERAS_COMM_RANK"] = str(rank)
    env["KERAS_COMM_WORLD_SIZE"] = str(len(addresses))
    env["PYTHONUNBUFFERED"] = "1"
    return env


def _describe_status(returncode):
    """(launcher exit code, human text) for a worker's Popen.returncode."""
    if returncode < 0:
        signum = -returncode
        try:
            name = signal.Signals(signum).name
        except ValueError:
            name = f"signal {signum}"
        return 128 + signum, f"killed by {name}"
    return returncode, f"exit code {returncode}"


# ---------------------------------------------------------------------------
# Output forwarding.
# ---------------------------------------------------------------------------


class _Printer:
    """Writes whole lines to a text stream under a lock, never raising."""

    def __init__(self, stream, lock):
        self._stream = stream
        self._lock = lock

    def write_line(self, text):
        if not text.endswith("\n"):
            text += "\n"
        with self._lock:
            try:
                self._stream.write(text)
                self._stream.flush()
            except UnicodeEncodeError:
                encoding = getattr(self._stream, "encoding", None) or "ascii"
                safe = text.encode(encoding, "backslashreplace").decode(encoding)
                try:
                    self._stream.write(safe)
                    self._stream.flush()
                except (OSError, ValueError):
                    pass
            except (OSError, ValueError):
                # Closed or broken destination (e.g. piped into `head`): keep
                # draining the worker's pipe so the worker never blocks.
                pass


def _pump(pipe, printer, prefix):
    """Copies `pipe` to `printer` line by line until EOF (partial lines too)."""
    try:
        # Bounded reads: a huge line without a newline is printed in pieces
        # instead of growing the launcher's memory without limit.
        for raw in iter(lambda: pipe.readline(_MAX_LINE_BYTES), b""):
            printer.write_line(prefix + raw.decode("utf-8", errors="replace"))
    except (OSError, ValueError):
        pass
    finally:
        try:
            pipe.close()
        except OSError:
            pass


# ---------------------------------------------------------------------------
# The job.
# ---------------------------------------------------------------------------


def _signal_group(proc, signum):
    """Sends `signum` to the worker's process group; False if it is gone."""
    try:
        os.killpg(proc.pid, signum)
        return True
    except (ProcessLookupError, PermissionError):
        return False


def _parent_death_signal():
    """A preexec_fn making a worker die with the launcher (Linux), or None.

    The launcher forwards SIGINT/SIGTERM/SIGHUP, but nothing can forward a
    SIGKILL of the launcher itself; the kernel's PR_SET_PDEATHSIG can. The
    ctypes function is looked up here, before fork, so the child only makes
    one foreign call. A preexec_fn can deadlock a child forked while other
    threads hold locks, so it is used only when the caller has no other
    threads (always true for the command line).
    """
    if not sys.platform.startswith("linux") or threading.active_count() > 1:
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
    """N worker processes, their output threads, and how to stop them."""

    def __init__(self, commands, envs, prefix, out, err):
        self.procs = []
        self.threads = []
        preexec_fn = _parent_death_signal()
        try:
            # All workers are forked before any reader thread exists, for
            # the preexec_fn's sake. The pipes buffer output meanwhile.
            for command, env in zip(commands, envs):
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
        except BaseException:
            self.stop(signal.SIGKILL, grace=0.0)
            raise
        for rank, proc in enumerate(self.procs):
            tag = f"[rank {rank}] " if prefix else ""
            for pipe, printer in ((proc.stdout, out), (proc.stderr, err)):
                thread = threading.Thread(
                    target=_pump,
                    args=(pipe, printer, tag),
                    name=f"keras-comm-run rank {rank}",
                    daemon=True,
                )
                thread.start()
                self.threads.append(thread)

    def running(self):
        return [p for p in self.procs if p.poll() is None]

    def stop(self, first_signal, grace=_STOP_GRACE_SECONDS, should_escalate=None):
        """Signals every worker's group, then SIGKILLs what is left.

        Returns the number of workers that were still running.
        """
        alive = self.running()
        for proc in alive:
            _signal_group(proc, first_signal)
        deadline = time.monotonic() + grace
        while self.running() and time.monotonic() < deadline:
            if should_escalate is not None and should_escalate():
                break
            time.sleep(_POLL_SECONDS)
        # SIGKILL every group, including groups whose leader already exited
        # but left children behind: nothing of the job may outlive it.
        for proc in self.procs:
            _signal_group(proc, signal.SIGKILL)
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
        for thread in self.threads:
            thread.join(timeout=max(0.0, deadline - time.monotonic()))


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


def _python_command(command):
    """`[sys.executable, *command]` after checking `command`'s shape."""
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
    return [sys.executable, *command]


def _check_positive_int(name, value):
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise LaunchError(f"`{name}` must be an integer >= 1. Received: {name}={value!r}")


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
):
    """Runs `num_workers` copies of a Python command as a local MWMS cluster.

    Args:
        command: list of arguments for the Python interpreter, e.g.
            `["train.py", "--epochs", "1"]` or `["-m", "pkg.mod", "--x"]`.
        num_workers: number of worker processes, >= 1.
        host: address the workers reach each other at (TF_CONFIG). Loopback
            unless `allow_non_loopback=True`. TensorFlow itself listens on
            all interfaces regardless.
        allow_non_loopback: permit a non-loopback `host`. TensorFlow's gRPC
            server is unauthenticated: only use on an isolated network.
        timeout: seconds after which all workers are stopped (None: no limit).
        env: extra environment variables for the workers, layered over
            `os.environ`. The launcher's own environment is never changed.
        prefix: prefix each output line with `[rank i] `.
        stdout: text stream for the workers' stdout (default `sys.stdout`).
        stderr: text stream for the workers' stderr and the launcher's own
            messages (default `sys.stderr`).
        base_port: 0 to pick free ports, else use ports
            `base_port .. base_port + num_workers - 1`.

    Returns:
        0 if every worker exited 0; else the first failed worker's exit code
        (128 + signal number for a signal death), 124 on timeout, or
        130 / 143 / 129 if the launcher received SIGINT / SIGTERM / SIGHUP.

    Raises:
        LaunchError (a ValueError): invalid arguments, a refused host or a
            busy port. Nothing has been started when it is raised.
    """
    _check_positive_int("num_workers", num_workers)
    if timeout is not None and (
        isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or not timeout > 0
    ):
        raise LaunchError(f"`timeout` must be a number > 0 or None. Received: timeout={timeout!r}")
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
    python_command = _python_command(command)
    _check_host(host, allow_non_loopback)
    ports = pick_ports(num_workers, host, base_port)
    addresses = [_address(host, port) for port in ports]

    base_env = dict(os.environ)
    if env:
        base_env.update({str(k): str(v) for k, v in env.items()})
    envs = [worker_env(base_env, addresses, rank) for rank in range(num_workers)]

    lock = threading.Lock()
    out = _Printer(stdout if stdout is not None else sys.stdout, lock)
    err = _Printer(stderr if stderr is not None else sys.stderr, lock)

    with _SignalCatcher() as catcher:
        job = _Job([python_command] * num_workers, envs, prefix, out, err)
        try:
            return _supervise(job, catcher, timeout, err)
        finally:
            # After an unexpected error, nothing may survive either.
            if job.running():
                job.stop(signal.SIGKILL, grace=0.0)


def _supervise(job, catcher, timeout, err):
    """Waits for the job to finish, fail, time out or be interrupted."""
    start = time.monotonic()
    message = None
    exit_code = 0
    while True:
        if catcher.received:
            signum = catcher.received[0]
            name = signal.Signals(signum).name
            # A second Ctrl-C while stopping skips the grace period.
            stopped = job.stop(signum, should_escalate=lambda: len(catcher.received) > 1)
            exit_code = 128 + signum
            message = f"{PROG}: received {name}; stopped {stopped} worker(s)."
            break
        failed = None
        for rank, proc in enumerate(job.procs):
            code = proc.poll()
            if code is not None and code != 0:
                failed = (rank, code)
                break
        if failed is not None:
            rank, code = failed
            exit_code, text = _describe_status(code)
            exit_code = exit_code or 1
            # Ctrl-C while stopping skips the grace period; the exit code
            # stays the failed worker's.
            stopped = job.stop(signal.SIGTERM, should_escalate=lambda: bool(catcher.received))
            message = (
                f"{PROG}: worker rank {rank} failed ({text}); "
                f"stopped the other {stopped} worker(s)."
            )
            break
        if all(p.returncode == 0 for p in job.procs):
            job.stop(signal.SIGTERM, grace=1.0)  # Leftover grandchildren only.
            break
        if timeout is not None and time.monotonic() - start > timeout:
            stopped = job.stop(signal.SIGTERM, should_escalate=lambda: bool(catcher.received))
            exit_code = EXIT_TIMEOUT
            message = (
                f"{PROG}: timed out after {timeout:g} s; stopped {stopped} worker(s)."
            )
            break
        time.sleep(_POLL_SECONDS)
    job.drain()
    if message:
        err.write_line(message)
    return exit_code


# ---------------------------------------------------------------------------
# Command line.
# ---------------------------------------------------------------------------


def _build_parser():
    parser = argparse.ArgumentParser(
        prog=PROG,
        usage=(
            f"{PROG} -n N [options] script.py [script args ...]\n"
            f"       {PROG} -n N [options] -m module [module args ...]\n"
            "       python -m keras_comm.launch -n N [options] ..."
        ),
        description=(
            "Run N copies of a Python script on this machine as a "
            "tf.distribute.MultiWorkerMirroredStrategy cluster over loopback. "
            "Everything after the script (or -m module) is passed to it unchanged."
        ),
        epilog=_EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
        allow_abbrev=False,
    )
    parser.add_argument(
        "-n", "--num-workers", type=int, required=True, metavar="N",
        help="number of worker processes (>= 1)",
    )
    parser.add_argument(
        "--host", default="127.0.0.1",
        help="address the workers reach each other at (default: 127.0.0.1)",
    )
    parser.add_argument(
        "--allow-non-loopback", action="store_true",
        help="permit a non-loopback --host (unauthenticated gRPC: isolated networks only)",
    )
    parser.add_argument(
        "--base-port", type=int, default=0, metavar="PORT",
        help="use ports PORT..PORT+N-1 instead of picking free ones",
    )
    parser.add_argument(
        "--timeout", type=float, default=None, metavar="SECONDS",
        help=f"stop all workers after SECONDS and exit {EXIT_TIMEOUT}",
    )
    parser.add_argument(
        "--no-prefix", dest="prefix", action="store_false",
        help='do not prefix output lines with "[rank i] "',
    )
    parser.add_argument(
        "-m", dest="module", metavar="module",
        help="run a module as a script, like `python -m` (must come last)",
    )
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


def main(argv=None):
    """Console entry point. Returns the exit status (see `--help`)."""
    parser = _build_parser()
    argv = list(sys.argv[1:] if argv is None else argv)
    launcher_args, command = _split_argv(parser, argv)
    args = parser.parse_args(launcher_args)

    if args.num_workers < 1:
        parser.error(f"-n must be >= 1. Received: -n {args.num_workers}")
    if args.timeout is not None and not args.timeout > 0:
        parser.error(f"--timeout must be > 0. Received: --timeout {args.timeout:g}")
    if args.base_port and not 1 <= args.base_port <= 65536 - args.num_workers:
        parser.error(
            f"--base-port must be 0 or a port with PORT+N-1 <= 65535. "
            f"Received: --base-port {args.base_port}"
        )
    if not command:
        parser.error("a script (or -m module) to run is required.")
    if command[0] == "-m" and (len(command) < 2 or not command[1]):
        parser.error("-m must be followed by a module name. Received: -m")
    if command[0] != "-m" and not os.path.isfile(command[0]):
        parser.error(f"script must be an existing file. Received: script {command[0]!r}")

    try:
        return run(
            command,
            args.num_workers,
            host=args.host,
            allow_non_loopback=args.allow_non_loopback,
            timeout=args.timeout,
            prefix=args.prefix,
            base_port=args.base_port,
        )
    except LaunchError as e:
        parser.error(str(e))


if __name__ == "__main__":
    sys.exit(main())
