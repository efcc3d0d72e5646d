"""Forwarding of worker output: pipe -> per-rank log file, console (prefixed), filtered file.

Each worker's stdout and stderr is a pipe, read by one thread per pipe (:class:`PipeForwarder`)
with ``os.read(fd, 65536)``: whatever the worker wrote is forwarded as soon as it arrives, in
chunks, with no line buffering and no polling of files (torchrun instead redirects to files and
tails them every 0.1 s). Each chunk goes

- to the per-rank log file, byte for byte (flushed per chunk);
- to the console (the agent's stdout or stderr) when asked, with the rank prefix inserted at the
  start of every line: after each ``\\n`` and after each ``\\r``, so a tqdm bar that redraws
  itself with ``\\r`` still renders, prefixed. A partial line is written at once; the prefix
  is inserted where the next line starts. A :class:`Console` serializes the writes of all
  workers, so one chunk is never interleaved with another's; and while one worker's line is
  unfinished on the console, another worker's output waits for it up to ``Console.hold_s``
  (0.1 s), then breaks the line. ``print`` under ``python -u`` writes the text and the
  ``\\n`` separately; without the hold, two ranks printing together would mangle lines;
- for stderr, into a bounded in-memory tail (:class:`StderrTail`) for the failure report;
- to the filtered file, for lines that contain any of the duplicate filters.

Duplicate filters mirror torchrun's ``--duplicate-stdout-filters`` /
``--duplicate-stderr-filters`` (``PContext`` in ``torch/distributed/elastic/multiprocessing/
api.py``): a line is duplicated when *any* filter string is a substring of it, so an empty
filter ``""`` matches every line and ``"*"`` is a literal asterisk (no wildcards); an empty
list duplicates nothing. As in torchrun, only streams that are copied to the console are
duplicated (torch filters the ``tee``'d streams), with the rank prefix, into one file shared by
all ranks. Lines split on ``\\n``, ``\\r\\n`` or ``\\r`` (torch reads the log files with
universal newlines).
"""

from __future__ import annotations

import fcntl
import os
import re
import select
import sys
import threading
import time
from collections.abc import Callable, Sequence
from typing import BinaryIO

__all__ = ["Console", "FilteredSink", "LinePrefixer", "PipeForwarder", "StderrTail", "console"]

_CHUNK = 65536
# A line: any run of non-terminators, then a terminator (or end of data: a partial line).
_SEGMENT = re.compile(rb"[^\r\n]*(?:\r\n|\r|\n)|[^\r\n]+")


class LinePrefixer:
    """Inserts ``prefix`` at the start of every line of a byte stream fed in arbitrary chunks.

    A line starts at the beginning of the stream and after every ``\\n`` or ``\\r`` (a
    ``\\r\\n`` pair counts once, even split across chunks). Output is produced for every byte
    at once; nothing is held back waiting for a newline.
    """

    def __init__(self, prefix: bytes) -> None:
        self.prefix = prefix
        self._at_line_start = True
        self._after_cr = False

    def feed(self, data: bytes) -> bytes:
        """Return ``data`` with the prefix inserted at each line start."""
        if not self.prefix or not data:
            return data
        out = []
        for m in _SEGMENT.finditer(data):
            seg = m.group()
            # "\r" then "\n" in the next chunk: the "\n" ends the same line.
            if self._at_line_start and not (self._after_cr and seg == b"\n" and m.start() == 0):
                out.append(self.prefix)
            out.append(seg)
            self._at_line_start = seg.endswith((b"\n", b"\r"))
            self._after_cr = seg.endswith(b"\r")
        return b"".join(out)

    def break_line(self) -> None:
        """Another writer ended this stream's console line: prefix the next byte."""
        self._at_line_start = True
        self._after_cr = False


class Console:
    """One console stream shared by the workers' forwarders (the agent's stdout, or stderr).

    Each forwarder writes through :meth:`write` with its own :class:`LinePrefixer`. Writes are
    serialized (a chunk is written and flushed whole). A worker whose last write left a line
    unfinished (no trailing ``\\n``) "holds" the console line: another worker's write waits
    until that line ends, at most ``hold_s`` seconds after the holder's last write, then ends
    it with ``\\n`` itself (the holder's next output starts a new, prefixed line). A line that
    ends in ``\\r`` (a progress bar) is broken at once, without waiting, so a bar on one rank
    never slows the others. The holder is never delayed: its partial lines appear at once.

    Args:
        stream: a function returning the binary stream to write to, called per write (so a
            replaced ``sys.stdout`` is honoured).
        hold_s: the longest another worker's unfinished line delays a write, in seconds.

    Errors writing (a closed terminal) are ignored; the log files still get everything.
    """

    def __init__(self, stream: Callable[[], BinaryIO], hold_s: float = 0.1) -> None:
        self._stream = stream
        self.hold_s = hold_s
        self._cond = threading.Condition()
        self._holder: LinePrefixer | None = None  # whose line is unfinished on the console
        self._held_at = 0.0  # monotonic time of the holder's last write
        self._worth_waiting = False  # False for a line ended by "\r" (a progress bar state)

    def write(self, writer: LinePrefixer, data: bytes) -> None:
        """Write ``data`` from ``writer``'s worker, with its prefix at each line start."""
        if not data:
            return
        with self._cond:
            if self._holder not in (None, writer) and self._worth_waiting:
                remaining = self._held_at + self.hold_s - time.monotonic()
                if remaining > 0:
                    self._cond.wait_for(lambda: self._holder in (None, writer), remaining)
            out = writer.feed(data)
            if self._holder not in (None, writer):
                out = b"\n" + out
                self._holder.break_line()
            if data.endswith(b"\n"):
                self._holder = None
            else:
                self._holder, self._held_at = writer, time.monotonic()
                self._worth_waiting = not data.endswith(b"\r")
            try:
                stream = self._stream()
                stream.write(out)
                stream.flush()
            except (OSError, ValueError):
                pass
            self._cond.notify_all()


#: The agent's own stdout and stderr (``sys.stdout.buffer`` / ``sys.stderr.buffer``).
_CONSOLES = {
    "stdout": Console(lambda: sys.stdout.buffer),
    "stderr": Console(lambda: sys.stderr.buffer),
}


def console(name: str) -> Console:
    """The process-wide :class:`Console` for ``"stdout"`` or ``"stderr"``."""
    return _CONSOLES[name]


class StderrTail:
    """The last ``max_lines`` lines (and at most ``max_bytes`` bytes) of a stream, in memory.

    For the failure report: :meth:`text` renders each line as a terminal would show it (of a line
    redrawn with ``\\r``, like a progress bar, only the last state is kept).
    """

    def __init__(self, max_lines: int = 50, max_bytes: int = 64 * 1024) -> None:
        self.max_lines = max_lines
        self.max_bytes = max_bytes
        self._buf = bytearray()
        self._lock = threading.Lock()

    def feed(self, data: bytes) -> None:
        with self._lock:
            self._buf += data
            if len(self._buf) > 2 * self.max_bytes:
                del self._buf[: len(self._buf) - self.max_bytes]

    def text(self) -> str:
        """The kept tail as text (UTF-8, undecodable bytes replaced), "" if nothing was kept."""
        with self._lock:
            data = bytes(self._buf[-self.max_bytes :])
        lines = data.decode("utf-8", "replace").replace("\r\n", "\n").split("\n")
        if lines and lines[-1] == "":
            lines.pop()
        shown = [line.rstrip("\r").rsplit("\r", 1)[-1] for line in lines]
        return "\n".join(shown[-self.max_lines :]) + ("\n" if shown else "")


class FilteredSink:
    """One ``filtered_stdout.log`` / ``filtered_stderr.log``: lines containing any filter.

    Shared by all ranks' forwarders; each forwarder gets its own :meth:`line_filter`.
    """

    def __init__(self, path: os.PathLike | str, filters: Sequence[str]) -> None:
        self.filters = [f.encode() for f in filters]
        self._file: BinaryIO | None = open(path, "ab")  # noqa: SIM115
        self._lock = threading.Lock()

    def line_filter(self, prefix: bytes) -> Callable[[bytes, bool], None]:
        """A per-stream feeder: ``feed(data, eof)`` writes each complete matching line."""
        pending = bytearray()

        def feed(data: bytes, eof: bool = False) -> None:
            pending.extend(data)
            lines = []
            for m in _SEGMENT.finditer(pending):
                seg = m.group()
                if seg.endswith((b"\n", b"\r")) or eof:
                    lines.append(seg.rstrip(b"\r\n"))
                else:
                    del pending[: m.start()]
                    break
            else:
                pending.clear()
            out = b"".join(prefix + line + b"\n" for line in lines if self._matches(line))
            if out:
                self.write(out)

        return feed

    def write(self, data: bytes) -> None:
        with self._lock:
            if self._file is not None:
                self._file.write(data)
                self._file.flush()

    def close(self) -> None:
        with self._lock:
            if self._file is not None:
                self._file.close()
                self._file = None

    def _matches(self, line: bytes) -> bool:
        return any(needle in line for needle in self.filters)


class PipeForwarder:
    """Forwards one pipe (a worker's stdout or stderr) on a thread, until EOF or :meth:`stop`.

    Args:
        fd: the read end of the pipe; the forwarder owns it and closes it.
        log_path: the per-rank log file (created/truncated), written byte for byte.
        console: the :class:`Console` to copy to, or None for no console copy.
        prefix: inserted at each line start of the console copy ("" = none).
        tail: where to keep the last lines (stderr), or None.
        filtered: a ``FilteredSink.line_filter`` feeder, or None.
        name: the thread's name.
    """

    def __init__(
        self,
        fd: int,
        log_path: os.PathLike | str,
        *,
        console: Console | None = None,
        prefix: str = "",
        tail: StderrTail | None = None,
        filtered: Callable[[bytes, bool], None] | None = None,
        name: str = "meshrun-output",
    ) -> None:
        self._fd = fd
        self._file = open(log_path, "wb")  # noqa: SIM115
        self._console = console
        self._prefixer = LinePrefixer(prefix.encode())
        self._tail = tail
        self._filtered = filtered
        # A self-pipe that stop() writes to; the thread waits on it beside the worker's pipe.
        self._wake_r, self._wake_w = os.pipe()
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)

    def start(self) -> None:
        self._thread.start()

    @property
    def done(self) -> bool:
        """True once the forwarder reached EOF (or was stopped) and closed its files."""
        return self._done.is_set()

    def join(self, timeout: float) -> bool:
        """Wait up to ``timeout`` seconds for EOF; True if the forwarder has finished."""
        return self._done.wait(timeout)

    def stop(self, timeout: float = 1.0) -> bool:
        """Forward what is already in the pipe, then stop even without EOF (a grandchild may
        hold the pipe open). Waits up to ``timeout`` seconds; True if finished."""
        if not self._done.is_set():
            try:
                os.write(self._wake_w, b"x")
            except OSError:
                pass
        return self._done.wait(timeout)

    def _run(self) -> None:
        poller = select.poll()
        poller.register(self._fd, select.POLLIN)
        poller.register(self._wake_r, select.POLLIN)
        try:
            while True:
                ready = {fd for fd, _ in poller.poll()}
                if self._wake_r in ready:
                    self._drain_available()
                    break
                chunk = os.read(self._fd, _CHUNK)
                if not chunk:
                    break
                self._forward(chunk)
        except OSError:
            pass
        finally:
            if self._filtered is not None:
                self._filtered(b"", True)
            for fd in (self._fd, self._wake_r, self._wake_w):
                try:
                    os.close(fd)
                except OSError:
                    pass
            self._file.close()
            self._done.set()

    def _drain_available(self) -> None:
        flags = fcntl.fcntl(self._fd, fcntl.F_GETFL)
        fcntl.fcntl(self._fd, fcntl.F_SETFL, flags | os.O_NONBLOCK)
        while True:
            try:
                chunk = os.read(self._fd, _CHUNK)
            except BlockingIOError:
                return
            if not chunk:
                return
            self._forward(chunk)

    def _forward(self, chunk: bytes) -> None:
        self._file.write(chunk)
        self._file.flush()
        if self._tail is not None:
            self._tail.feed(chunk)
        if self._filtered is not None:
            self._filtered(chunk, False)
        if self._console is not None:
            self._console.write(self._prefixer, chunk)
