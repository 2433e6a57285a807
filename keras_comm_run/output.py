"""Forwarding the workers' output: live, rank-prefixed, filtered, logged.

Each worker pipe is read in whatever pieces the worker writes (not per line),
so a progress bar redrawn with '\\r' reaches the terminal as it is drawn.
Every line (and every '\\r'-redrawn line) starts with `[rank i] `. Lines of
several workers never run into each other: when another worker writes while
a line is unfinished, that line is ended first and continues later under a
fresh prefix. A pipe kept off the console still remembers its last lines
(`Forwarder.tail`), from which the launcher shows a failed worker's error.
"""

import codecs
import collections
import os
import threading
import time

_READ_BYTES = 1 << 16

# Text a worker writes when TensorFlow cannot bind its port.
PORT_CLASH_MARKERS = ("Could not start gRPC server", "Address already in use")


class Console:
    """Text streams shared by many workers, written under one lock, never raising.

    `Console(stream, state)`: consoles built with the same `state` (e.g. the
    launcher's stdout and stderr, usually one terminal) know which worker's
    line is unfinished on any of them.
    """

    def __init__(self, stream, state):
        self._stream = stream
        self.state = state

    @staticmethod
    def new_state():
        return {"lock": threading.Lock(), "open": None}

    @property
    def lock(self):
        return self.state["lock"]

    def write(self, text):
        """Writes `text`; the caller holds `lock`."""
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

    def end_open_line(self, owner=None):
        """Ends another writer's unfinished line; the caller holds `lock`."""
        current = self.state["open"]
        if current is not None and current is not owner:
            current.console.write("\n")
            current.at_line_start = True
            # The newline that really ends that line may still be in its pipe:
            # it must not print a second, empty line when it arrives.
            current.line_ended_for_it = True
            self.state["open"] = None

    def write_line(self, text):
        """Writes a whole line of the launcher's own."""
        if not text.endswith("\n"):
            text += "\n"
        with self.lock:
            self.end_open_line()
            self.write(text)


class Forwarder:
    """Copies one worker pipe to a Console (optionally) and a log file (optionally).

    Args:
        console: a Console, or None to keep this pipe off the terminal.
        prefix: text put before each line on the console (and on the
            kept tail).
        log_file: a binary file that receives the bytes unchanged, or None.
        redraws: False to drop '\\r'-redrawn lines (another worker's progress
            bar) from the console; the log file keeps them.
        activity: a callable run on each read (stall detection).
        keep_lines: for a pipe kept off the console, how many of its last
            lines to remember (`tail`), so that a failed worker's error can
            still be shown; 0 keeps none.
    """

    def __init__(self, pipe, console, prefix, log_file=None, redraws=True, activity=None,
                 keep_lines=0):
        self.pipe = pipe
        self.console = console
        self.prefix = prefix
        self.log_file = log_file
        self.redraws = redraws
        self.activity = activity
        self.at_line_start = True
        self._redrawing = False  # this line has had a '\r' (progress bar)
        self._decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
        self._tail = ""
        self.port_clash = False
        self.keep_lines = keep_lines
        self._kept = collections.deque(maxlen=keep_lines or 1)
        self._kept_partial = ""
        self.thread = threading.Thread(target=self._run, name="keras-comm-run output", daemon=True)

    def start(self):
        self.thread.start()

    def _run(self):
        fd = self.pipe.fileno()
        try:
            while True:
                data = os.read(fd, _READ_BYTES)
                if not data:
                    break
                if self.activity is not None:
                    self.activity()
                if self.log_file is not None:
                    try:
                        self.log_file.write(data)
                        self.log_file.flush()
                    except (OSError, ValueError):
                        pass
                self._feed(self._decoder.decode(data))
            self._feed(self._decoder.decode(b"", final=True))
            if self.console is not None:
                with self.console.lock:
                    if not self.at_line_start and not self._redrawing:
                        self.console.write("\n")
                        self.at_line_start = True
                    if self.console.state["open"] is self:
                        self.console.state["open"] = None
        except (OSError, ValueError):
            pass
        finally:
            try:
                self.pipe.close()
            except OSError:
                pass

    def _feed(self, text):
        if not text:
            return
        window = self._tail + text
        if any(marker in window for marker in PORT_CLASH_MARKERS):
            self.port_clash = True
        self._tail = window[-64:]
        if self.console is None:
            if self.keep_lines:
                self._keep(text)
            return
        with self.console.lock:
            if getattr(self, "line_ended_for_it", False):
                self.line_ended_for_it = False
                if text.startswith("\n"):
                    text = text[1:]
            pieces = []
            start = 0
            for i, char in enumerate(text):
                if char not in "\r\n":
                    continue
                self._piece(pieces, text[start:i], char)
                start = i + 1
            self._piece(pieces, text[start:], "")
            if pieces:
                # Only a writer that shows something ends another's line.
                self.console.end_open_line(owner=self)
                out = "".join(pieces)
                self.console.write(out)
                self.console.state["open"] = None if out.endswith("\n") else self

    def _keep(self, text):
        # A '\r' redraw replaces the line it redraws, as a terminal shows it.
        lines = (self._kept_partial + text).split("\n")
        self._kept_partial = lines.pop()
        for line in lines:
            self._kept.append(line.rsplit("\r", 1)[-1])

    def tail(self):
        """The last lines (at most `keep_lines`) of a pipe kept off the console."""
        lines = list(self._kept)
        partial = self._kept_partial.rsplit("\r", 1)[-1]
        if partial:
            lines.append(partial)
        return lines[-self.keep_lines :] if self.keep_lines else []

    def _piece(self, pieces, run, end):
        """Appends `run` followed by the control character `end` to `pieces`."""
        if end == "\r" and not self.redraws:
            if not self._redrawing and not self.at_line_start:
                pieces.append("\n")  # end what was shown of this line
            self._redrawing = True
        if self._redrawing:
            if end == "\n":
                self._redrawing = False
                self.at_line_start = True
            return
        if run:
            if self.at_line_start:
                pieces.append(self.prefix)
                self.at_line_start = False
            pieces.append(run)
        if end == "\n":
            pieces.append("\n")
            self.at_line_start = True
        elif end == "\r":
            pieces.append("\r")
            self.at_line_start = True


def open_log(log_dir, rank, stream_name, attempt):
    """Opens `log_dir/rank<rank>.<stream_name>.log` for appending (bytes)."""
    path = os.path.join(log_dir, f"rank{rank}.{stream_name}.log")
    f = open(path, "ab")
    if attempt:
        stamp = time.strftime("%Y-%m-%d %H:%M:%S")
        f.write(f"\n=== keras-comm-run: restart attempt {attempt} at {stamp} ===\n".encode())
        f.flush()
    return f
