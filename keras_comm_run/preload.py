"""`--preload`: import modules once in the launcher, fork every worker from it.

Every worker started the ordinary way is a new interpreter that imports
TensorFlow, Keras and keras_comm itself: ~7 CPU-seconds and ~680 MB each,
paid again by each restart. With `preload=("tensorflow", "keras",
"keras_comm")` the launcher imports them once and starts each worker (and
each restart's workers) with `os.fork()` instead (gunicorn's `--preload` is
the analogue). A forked worker is still a separate process that creates its
own TensorFlow runtime, strategy and gRPC server: importing TensorFlow
creates none of them (its eager context is created on first use), which is
what makes the fork safe, and what `import_modules` checks.

The child then runs the script exactly as the exec'd worker would
(`python -c BOOTSTRAP script args`): its own session, the parent-death
signal, the per-worker environment set before the script reads it,
`sys.argv`, `sys.path[0]` and `__main__`, stdin from /dev/null and
stdout/stderr into the launcher's pipes (unbuffered, as PYTHONUNBUFFERED=1
asks), the interpreter's exit-code rules (`SystemExit`, an uncaught exception
prints its traceback and exits 1, an uncaught KeyboardInterrupt dies by
SIGINT), non-daemon threads joined, then atexit handlers, then the streams
flushed. `ForkedWorker` is the small part of `subprocess.Popen` the
supervisor uses, so supervision has one code path.

What a fork cannot give a worker, and the launcher therefore refuses or
documents: environment variables read while the preloaded modules were
imported keep the launcher's value (`KERAS_BACKEND`, `TF_CPP_MIN_LOG_LEVEL`,
`TF_ENABLE_ONEDNN_OPTS`; `PYTHONPATH` and `PYTHONHOME` shaped `sys.path`):
extra environment for the workers may not change them (`check_env`); the
string hash seed is the launcher's. numpy's global random state, which
numpy seeds once at import, is reseeded in each worker, as the `random`
module reseeds itself after a fork.
"""

import atexit
import builtins
import importlib
import io
import os
import re
import signal
import subprocess
import sys
import threading
import time
import traceback
import types

from keras_comm_run import bootstrap
from keras_comm_run.cluster import LaunchError

# What the test suite and most users preload: everything a keras_comm worker imports.
DEFAULT_MODULES = ("tensorflow", "keras", "keras_comm")

# Read by the preloaded modules at import time (or shaping sys.path): a
# worker's environment may not give them a value other than the launcher's.
FROZEN_VARIABLES = (
    "KERAS_BACKEND", "TF_CPP_MIN_LOG_LEVEL", "TF_ENABLE_ONEDNN_OPTS", "PYTHONPATH",
    "PYTHONHOME",
)

_MODULE_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z_][A-Za-z0-9_]*)*$")
_WAIT_POLL_SECONDS = 0.01


def check_modules(preload):
    """The module names of `preload` as a tuple (empty: no preloading).

    Args:
        preload: None, or a collection of module names such as
            `("tensorflow", "keras_comm")`.

    Raises:
        LaunchError: `preload` is not a collection of dotted module names,
            or the platform has no `os.fork`.
    """
    if preload is None:
        return ()
    if isinstance(preload, (str, bytes)) or not all(
        isinstance(m, str) and _MODULE_NAME.match(m) for m in preload
    ):
        raise LaunchError(
            "`preload` must be None or a collection of module names such as "
            f"('tensorflow', 'keras_comm'). Received: preload={preload!r}"
        )
    modules = tuple(preload)
    if modules and not hasattr(os, "fork"):
        raise LaunchError(
            "`preload` forks the workers from the launcher, which needs os.fork "
            f"(POSIX); this platform has none. Received: preload={modules!r}"
        )
    return modules


def check_env(env, launcher_env):
    """Refuses extra worker environment that a fork could not honour."""
    for name in FROZEN_VARIABLES:
        if env.get(name) != launcher_env.get(name):
            raise LaunchError(
                f"`preload`: the workers' {name} must be the launcher's, because the "
                "preloaded modules read it when the launcher imported them; set it "
                "for the launcher instead, or start the workers without preload. "
                f"Received: {name}={env.get(name)!r} (launcher: {launcher_env.get(name)!r})"
            )


def import_modules(modules):
    """Imports `modules` in the launcher and checks that forking stays safe.

    Raises:
        LaunchError: a module cannot be imported, its import started a
            Python thread (a fork copies no thread but may copy a lock it
            holds), or it initialised TensorFlow's runtime (a forked child
            cannot use a parent's TensorFlow runtime).
    """
    for name in modules:
        try:
            importlib.import_module(name)
        except Exception as e:  # noqa: BLE001 (reported with its type)
            raise LaunchError(
                f"`preload` module {name!r} cannot be imported: {type(e).__name__}: {e}. "
                f"Received: preload={modules!r}"
            ) from e
    check_fork_safe(modules)


def check_fork_safe(modules):
    """Raises LaunchError if this process can no longer fork workers safely."""
    threads = [t.name for t in threading.enumerate() if t is not threading.main_thread()]
    if threads:
        raise LaunchError(
            "`preload`: the launcher has other threads (" + ", ".join(threads) + "); a forked "
            "worker copies the locks they may hold and could deadlock. Preload only modules "
            f"that start no threads on import. Received: preload={modules!r}"
        )
    eager = sys.modules.get("tensorflow.python.eager.context")
    if eager is not None and getattr(eager, "_context", None) is not None:
        raise LaunchError(
            "`preload`: TensorFlow's runtime (its eager context) was created in the "
            "launcher, and a forked worker cannot use its parent's runtime. Preload only "
            "modules that do not run TensorFlow ops or list devices on import. "
            f"Received: preload={modules!r}"
        )


class ForkedWorker:
    """A forked worker, with the part of `subprocess.Popen` the supervisor uses.

    Attributes:
        pid: the child's pid (also its process group id).
        returncode: None while running; the exit code, or -signal for a
            signal death, as `Popen.returncode`.
        stdout, stderr: binary read ends of the child's output pipes.
    """

    def __init__(self, pid, stdout, stderr):
        self.pid = pid
        self.stdout = stdout
        self.stderr = stderr
        self.returncode = None

    def _reap(self, flags):
        if self.returncode is not None:
            return self.returncode
        try:
            pid, status = os.waitpid(self.pid, flags)
        except ChildProcessError:
            # Reaped elsewhere; the status is lost (Popen reports 0 too).
            self.returncode = 0
            return self.returncode
        if pid == self.pid:
            self.returncode = os.waitstatus_to_exitcode(status)
        return self.returncode

    def poll(self):
        return self._reap(os.WNOHANG)

    def wait(self, timeout=None):
        if timeout is None:
            return self._reap(0)
        deadline = time.monotonic() + timeout
        while self.poll() is None:
            if time.monotonic() >= deadline:
                raise subprocess.TimeoutExpired(f"forked worker {self.pid}", timeout)
            time.sleep(_WAIT_POLL_SECONDS)
        return self.returncode

    def send_signal(self, signum):
        if self.poll() is None:
            os.kill(self.pid, signum)

    def kill(self):
        self.send_signal(signal.SIGKILL)

    def terminate(self):
        self.send_signal(signal.SIGTERM)


def start(command, env, set_parent_death_signal=None, close_fds=()):
    """Forks a worker running `command` (`[script, *args]` or `["-m", mod, *args]`).

    Args:
        command: the script command, as given to the launcher.
        env: the worker's whole environment.
        set_parent_death_signal: None, or a function the child calls first
            (see `supervisor._parent_death_signal`).
        close_fds: descriptors of the launcher the child closes (the other
            workers' pipe ends).

    Returns:
        A ForkedWorker.
    """
    out_r, out_w = os.pipe()
    err_r, err_w = os.pipe()
    # Nothing the launcher buffered may be written twice (once by the child).
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError, AttributeError):
            pass
    pid = os.fork()
    if pid == 0:
        code = 1
        try:
            os.setsid()
            if set_parent_death_signal is not None:
                set_parent_death_signal()
            devnull = os.open(os.devnull, os.O_RDONLY)
            os.dup2(devnull, 0)
            os.dup2(out_w, 1)
            os.dup2(err_w, 2)
            for fd in {devnull, out_r, out_w, err_r, err_w, *close_fds}:
                if fd > 2:
                    try:
                        os.close(fd)
                    except OSError:
                        pass
            code = _run_worker(command, env)
        except BaseException:  # noqa: BLE001 (the child must never return)
            try:
                os.write(2, traceback.format_exc().encode("utf-8", "replace"))
            except BaseException:  # noqa: BLE001
                pass
        finally:
            os._exit(code)
    os.close(out_w)
    os.close(err_w)
    return ForkedWorker(pid, os.fdopen(out_r, "rb", buffering=0),
                        os.fdopen(err_r, "rb", buffering=0))


def _stream(fd, mode, errors, unbuffered):
    encoding = os.environ.get("PYTHONIOENCODING", "").partition(":")[0] or "utf-8"
    raw = io.FileIO(fd, mode, closefd=False)
    if mode == "r":
        return io.TextIOWrapper(io.BufferedReader(raw), encoding=encoding, errors=errors)
    if unbuffered:
        return io.TextIOWrapper(raw, encoding=encoding, errors=errors, write_through=True)
    return io.TextIOWrapper(io.BufferedWriter(raw), encoding=encoding, errors=errors)


def _exit_code(exc):
    """The interpreter's exit status for an uncaught SystemExit."""
    code = exc.code
    if code is None:
        return 0
    if isinstance(code, int):
        return code & 0xFF
    try:
        print(code, file=sys.stderr)
    except Exception:  # noqa: BLE001
        pass
    return 1


def _run_worker(command, env):
    """In the forked child: runs BOOTSTRAP as `python -c BOOTSTRAP *command` would.

    Returns the exit status; the caller ends the process with `os._exit`.
    """
    # The interpreter's start-up signal state, not the launcher's handlers.
    signal.signal(signal.SIGINT, signal.default_int_handler)
    for signum in (signal.SIGTERM, signal.SIGHUP):
        signal.signal(signum, signal.SIG_DFL)
    signal.signal(signal.SIGPIPE, signal.SIG_IGN)
    if hasattr(signal, "SIGXFSZ"):
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    signal.pthread_sigmask(signal.SIG_SETMASK, set())

    # Before anything of the worker reads it (os.environ also calls putenv,
    # so TensorFlow's C++ getenv sees it).
    os.environ.clear()
    os.environ.update(env)
    _reseed_numpy()

    unbuffered = bool(env.get("PYTHONUNBUFFERED"))
    sys.stdin = sys.__stdin__ = _stream(0, "r", "strict", unbuffered)
    sys.stdout = sys.__stdout__ = _stream(1, "w", "strict", unbuffered)
    sys.stderr = sys.__stderr__ = _stream(2, "w", "backslashreplace", True)

    # `python -c` puts '' first; the launcher's first entry is its own
    # script's directory, or (with -P) the first PYTHONPATH entry.
    if sys.flags.safe_path:
        sys.path.insert(0, "")
    else:
        sys.path[0] = ""
    sys.argv = ["-c", *command]
    main = types.ModuleType("__main__")
    main.__dict__["__builtins__"] = builtins
    sys.modules["__main__"] = main

    code = 0
    interrupted = False
    try:
        exec(compile(bootstrap.BOOTSTRAP, "<string>", "exec"), main.__dict__)
    except SystemExit as e:
        code = _exit_code(e)
    except BaseException as e:  # noqa: BLE001 (the interpreter's own rule)
        interrupted = isinstance(e, KeyboardInterrupt)
        # Without this function's frame: the traceback `python -c` prints.
        tb = e.__traceback__.tb_next if e.__traceback__ is not None else None
        sys.excepthook(type(e), e.with_traceback(tb), tb)
        code = 1
    # The interpreter's shutdown order: non-daemon threads, atexit, streams.
    shutdown = getattr(threading, "_shutdown", None)
    if shutdown is not None:
        shutdown()
    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except Exception:  # noqa: BLE001
            pass
    if interrupted:
        signal.signal(signal.SIGINT, signal.SIG_DFL)
        os.kill(os.getpid(), signal.SIGINT)
    return code


def _reseed_numpy():
    numpy_random = sys.modules.get("numpy.random")
    if numpy_random is not None:
        numpy_random.seed()
