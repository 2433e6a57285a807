"""How each worker starts: the script under a bootstrap that makes SIGTERM work.

Creating a `MultiWorkerMirroredStrategy` starts TensorFlow's coordination
service, whose preemption notifier installs a C-level SIGTERM handler that
only records the signal: a worker then ignores the launcher's (or a
scheduler's) SIGTERM, and is SIGKILLed after the grace period without
running its `finally` blocks or atexit handlers.

The bootstrap (`BOOTSTRAP`, run with `python -c`, so nothing needs to be
importable in the worker) blocks SIGTERM before the script runs (every thread
TensorFlow starts later inherits the mask, so its handler is never invoked)
and hands it to a thread waiting in `sigwait`, which delivers it to the main
thread's Python-level SIGTERM handler (through a real-time signal sent to the
main thread, which also interrupts a blocking call such as `time.sleep`):

- by default that handler raises `SystemExit(143)`, so `finally` blocks and
  atexit handlers run, and the worker then exits with 143 (128 + SIGTERM)
  without TensorFlow's own slow teardown of its servers; if the main thread
  is stuck in TensorFlow and cannot take the exception, or the cleanup takes
  longer than `KERAS_COMM_STOP_SECONDS` (1.5 s), SIGALRM ends the worker
  (status 142) at that deadline;
- a handler the script installed itself (`signal.signal(SIGTERM, ...)`, as
  TensorFlow's `PreemptionCheckpointHandler` does) is called instead, and
  given the launcher's whole grace period.

The script then runs as `python script.py` / `python -m module` would run it:
`sys.argv`, `sys.path[0]` and `__main__` are set the same way.

A worker whose script ends normally (returns, or `sys.exit(0)`) after it
joined a TensorFlow cluster waits at an exit barrier of the coordination
service until every worker has ended too (at most
`KERAS_COMM_EXIT_WAIT_SECONDS`, 3600 s): the chief hosts that service, and a
chief that exits first takes it away from peers still in their last
collectives (a pipeline's data-group gather, an evaluation only some ranks
run), which then fail with "Failed to send RPC to coordination service". A
peer that failed fails the barrier at once (the launcher stops the job
anyway); a failing script never waits.
"""

# The code is a string run with `python -c`: the worker's sys.path may not
# contain this package (e.g. benchmarks of an older snapshot).
BOOTSTRAP = r'''
import atexit, os, runpy, signal, sys, threading

def _keras_comm_run_bootstrap():
    grace = float(os.environ.get("KERAS_COMM_STOP_SECONDS", "1.5"))
    # A real signal to the main thread (interrupt_main would not wake a
    # blocking call); a real-time one, which TensorFlow leaves alone.
    hop = signal.SIGRTMAX - 2
    main = threading.main_thread().ident

    stopping = []

    def finish():
        # Runs last among the atexit handlers (registered first): after the
        # script's cleanup, skip TensorFlow's slow teardown of its servers.
        if stopping:
            for stream in (sys.stdout, sys.stderr):
                try:
                    stream.flush()
                except Exception:
                    pass
            os._exit(128 + signal.SIGTERM)

    def default_handler(signum, frame):
        stopping.append(signum)
        raise SystemExit(128 + signum)

    def on_hop(signum, frame):
        handler = signal.getsignal(signal.SIGTERM)
        if callable(handler):
            handler(signal.SIGTERM, frame)
        elif handler == signal.SIG_DFL:
            raise SystemExit(128 + signal.SIGTERM)

    def deliver():
        while True:
            signal.sigwait({signal.SIGTERM})
            ours = signal.getsignal(signal.SIGTERM) is default_handler
            signal.pthread_kill(main, hop)
            if ours and signal.getsignal(signal.SIGALRM) == signal.SIG_DFL:
                # A main thread stuck in TensorFlow never takes the exception:
                # SIGALRM ends the process after the grace, without the GIL.
                signal.setitimer(signal.ITIMER_REAL, grace)

    def wait_for_peers():
        # Only a worker that joined a cluster has the coordination service.
        # TensorFlow's own module, not keras_comm's tf_api: this bootstrap
        # imports nothing of keras_comm (see the note on BOOTSTRAP).
        # A worker forked by --preload has TensorFlow imported even if its
        # script never used it: only an existing context can have joined.
        eager = sys.modules.get("tensorflow.python.eager.context")
        if eager is None:
            return
        ctx = eager.context_safe() if hasattr(eager, "context_safe") else eager.context()
        if ctx is None or not ctx.coordination_service:
            return
        # keras_comm's fit/evaluate return before the iterators they released
        # are destroyed (keras_comm.training.step, RELEASE_THREAD_NAME); the
        # interpreter joins those threads anyway, and joined here every
        # worker's wait overlaps its peers' instead of following the barrier.
        for thread in threading.enumerate():
            if thread.name == "keras_comm_iterator_release":
                thread.join()
        seconds = float(os.environ.get("KERAS_COMM_EXIT_WAIT_SECONDS", "3600"))
        try:
            ctx.wait_at_barrier("keras_comm_run/exit", int(seconds * 1000))
        except Exception as e:
            first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
            print(f"keras-comm-run: this worker ended, but not every peer reached the exit "
                  f"barrier: {first}", file=sys.stderr, flush=True)

    atexit.register(finish)
    signal.signal(signal.SIGTERM, default_handler)
    signal.signal(hop, on_hop)
    signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGTERM})
    threading.Thread(target=deliver, name="keras-comm-run SIGTERM", daemon=True).start()
    args = sys.argv[1:]
    try:
        if args[0] == "-m":
            sys.argv = [args[1], *args[2:]]
            sys.path[0] = os.getcwd()
            runpy.run_module(args[1], run_name="__main__", alter_sys=True)
        else:
            sys.argv = args
            sys.path[0] = os.path.dirname(os.path.realpath(args[0]))
            runpy.run_path(args[0], run_name="__main__")
    except SystemExit as e:
        if e.code not in (None, 0) or stopping:
            raise
        wait_for_peers()
        raise
    wait_for_peers()

_keras_comm_run_bootstrap()
'''


def command(python, script_command):
    """The argv that runs `script_command` (`[script, *args]` or `["-m", mod, *args]`)."""
    return [python, "-c", BOOTSTRAP, *script_command]
