"""Forwarding of worker output: pipe -> per-rank log file, console (prefixed), filtered file.

The per-rank log files are meshrun's promise: complete, byte for byte. The console copy is best
effort: it never blocks or slows a worker (DESIGN.md §3.6).

Each worker's stdout and stderr is a pipe, read by one thread per pipe (:class:`PipeForwarder`)
with ``os.read(fd, 65536)``: whatever the worker wrote is forwarded as soon as it arrives, in
chunks, with no line buffering and no polling of files (torchrun instead redirects to files and
tails them every 0.1 s). The thread does nothing that can block but that read, so the pipe is
always drained. Each chunk goes

- to the per-rank log file (:class:`LogFile`), byte for byte, with ``os.write`` (nothing is
  buffered in the agent). With ``max_bytes`` (``--log-max-bytes``) the file is rotated before
  it would pass that size, cut after a line end where a line fits: ``stdout.log`` becomes
  ``stdout.log.1``, ``.1`` becomes ``.2``, and so on; ``LogFile.BACKUPS`` (3) older files are
  kept and the oldest is deleted, so a stream never takes more than 4 x ``max_bytes`` of disk.
  A write error (a full disk: ENOSPC, EDQUOT, EIO...) is said once on the agent's stderr and
  that file is dropped; the pipe keeps being drained and the worker never notices;
- to the console (the agent's stdout or stderr) when asked: into the stream's bounded queue
  (:class:`ConsoleStream`), never more (see "The console" below);
- for stderr, into a bounded in-memory tail (:class:`StderrTail`) for the failure report;
- to the filtered file, for lines that contain any of the duplicate filters.

The console: one writer thread per :class:`Console` empties the streams' queues (1 MiB each),
in arrival order, inserting the rank prefix at the start of every line: after each ``\\n`` and
each ``\\r``, so a tqdm bar that redraws itself with ``\\r`` still renders, prefixed. A
partial line is written at once; the prefix goes where the next line starts. While one rank's
line is unfinished, another rank's output waits for it up to ``Console.hold_s`` (0.1 s), then
breaks the line (``print`` under ``python -u`` writes the text and the ``\\n`` separately);
the same hold keeps a Python traceback in one block. Only the writer thread ever waits: when
the console cannot keep up (a slow reader, a stopped one, a pipe nobody reads), a stream's
queue fills and its console output is dropped until the queue has drained to half, resuming
at a line start (a line cut by the drop is ended where the note starts); one note on that
stream then says how many lines and bytes were not shown and which log file has them. A closed console (EPIPE) ends the console copy silently. When the agent's
stdout and stderr are one file (``2>&1``, a terminal), both streams share one writer.

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

import errno
import fcntl
import os
import re
import select
import sys
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import BinaryIO, NamedTuple

__all__ = [
    "Console",
    "ConsoleStream",
    "FilteredSink",
    "LinePrefixer",
    "LogFile",
    "PipeForwarder",
    "StderrTail",
    "console",
]

_CHUNK = 65536
# A line: any run of non-terminators, then a terminator (or end of data: a partial line).
_SEGMENT = re.compile(rb"[^\r\n]*(?:\r\n|\r|\n)|[^\r\n]+")
_LINE_END = re.compile(rb"\r\n|\r|\n")
# A console writer thread with nothing to write for this long ends (the next write starts one).
_IDLE_S = 5.0


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

    @property
    def at_line_start(self) -> bool:
        """True when the next byte fed starts a line."""
        return self._at_line_start

    def feed(self, data: bytes) -> bytes:
        """Return ``data`` with the prefix inserted at each line start."""
        if not data:
            return data
        if not self.prefix:
            self._at_line_start = data.endswith((b"\n", b"\r"))
            self._after_cr = data.endswith(b"\r")
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


class UnsafeLogDir(OSError):
    """A log directory that cannot be made safely: a symlink or a file where a directory of
    this job's would go, one owned by another user, or a name that would leave its parent."""


def make_private_dir(parent: Path, *names: str) -> Path:
    """Create ``parent/names[0]/names[1]/...`` one component at a time; return the path.

    The log files are private to the job (§3.7): each component is made with ``mkdir`` mode
    0700 and opened with ``O_NOFOLLOW | O_DIRECTORY`` relative to its parent's descriptor
    (``dir_fd``), so a symlink planted in a shared ``--log-dir`` is never followed, and it must
    belong to this user. One that exists already (another agent of the job made it) is used as
    it is. ``parent`` itself is the user's (``--log-dir``, a temp dir): created (0700) when
    missing, followed if it is a symlink. Files made inside are 0600 (`LogFile`).

    Raises:
        UnsafeLogDir: ``parent`` is not a directory; a component is a symlink, not a directory,
            owned by another user, or not a plain name (empty, ``.``, ``..``, with ``/``). The
            message is one line naming the path.
        OSError: the directories cannot be made (permissions, a full disk).
    """
    path = Path(parent)
    try:
        path.mkdir(mode=0o700, parents=True, exist_ok=True)
        fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    except (FileExistsError, NotADirectoryError):
        raise UnsafeLogDir(f"log directory {path} is not a directory") from None
    try:
        for name in names:
            if not name or name in (".", "..") or "/" in name or "\0" in name:
                raise UnsafeLogDir(f"log directory {path}: {name!r} is not a plain name")
            path = path / name
            try:
                os.mkdir(name, 0o700, dir_fd=fd)
                made = True
            except FileExistsError:
                made = False
            flags = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
            try:
                child = os.open(name, flags, dir_fd=fd)
            except OSError as e:
                if e.errno not in (errno.ELOOP, errno.ENOTDIR):
                    raise
                is_link = os.path.islink(path)
                what = "a symlink" if is_link else "not a directory"
                raise UnsafeLogDir(
                    f"log directory {path} is {what}; refusing to write logs through it "
                    "(remove it, or give another --log-dir)"
                ) from None
            os.close(fd)
            fd = child
            owner = os.fstat(fd).st_uid
            if owner != os.geteuid():
                raise UnsafeLogDir(
                    f"log directory {path} belongs to uid {owner}, not to this user "
                    f"(uid {os.geteuid()}); refusing to write logs there"
                )
            if made:
                os.fchmod(fd, 0o700)  # whatever the umask
    finally:
        os.close(fd)
    return path


class LogFile:
    """One log file, written byte for byte with ``os.write``; rotated by size; dropped on error.

    Args:
        path: the file; created, or truncated (a per-rank log starts empty each round), or
            appended to with ``append=True``.
        max_bytes: rotate before the file would pass this many bytes (None: never). The cut
            goes after the last line end that fits; a single line longer than ``max_bytes`` is
            split. Rotation renames ``path`` to ``path.1`` (``.1`` to ``.2``, ...), keeps
            `BACKUPS` older files and deletes the oldest; stale ``path.N`` are removed at open.
        on_error: called once, with one line, when opening, writing or rotating fails with an
            ``OSError`` (ENOSPC, EDQUOT, EIO, ...); the file is dropped then (later writes are
            no-ops). Default: print on the agent's stderr console.

    Nothing is raised: a log that cannot be written must not stop the output's other sinks.
    Not thread-safe: one writer (a :class:`PipeForwarder`) per file, or a lock around it.
    """

    BACKUPS = 3

    def __init__(
        self,
        path: os.PathLike | str,
        *,
        max_bytes: int | None = None,
        on_error: Callable[[str], None] | None = None,
        append: bool = False,
    ) -> None:
        if max_bytes is not None and max_bytes < 1:
            raise ValueError(f"LogFile: max_bytes must be >= 1 (got {max_bytes})")
        self.path = Path(path)
        self.max_bytes = max_bytes
        self._on_error = on_error or console("stderr").say
        self._fd: int | None = None
        self._size = 0
        mode = os.O_WRONLY | os.O_CREAT | os.O_CLOEXEC | os.O_NOFOLLOW
        mode |= os.O_APPEND if append else os.O_TRUNC
        try:
            if max_bytes is not None:
                for i in range(1, self.BACKUPS + 2):
                    self._backup(i).unlink(missing_ok=True)
            self._fd = os.open(self.path, mode, 0o600)
            self._size = os.fstat(self._fd).st_size
        except OSError as e:
            self._fail(e)

    @property
    def dropped(self) -> bool:
        """True once the file could not be written (or after :meth:`close`)."""
        return self._fd is None

    def write(self, data: bytes) -> None:
        """Append ``data`` (rotating first where ``max_bytes`` says so)."""
        if self._fd is None or not data:
            return
        try:
            if self.max_bytes is None:
                self._write_all(data)
                return
            view = memoryview(data)
            while view:
                room = max(0, self.max_bytes - self._size)
                if len(view) <= room:
                    self._write_all(view)
                    return
                cut = bytes(view[:room]).rfind(b"\n") + 1  # after the last line end that fits
                if cut == 0 and self._size == 0:
                    cut = room  # one line longer than a whole file: split it
                if cut:
                    self._write_all(view[:cut])
                    view = view[cut:]
                self._rotate()
        except OSError as e:
            self._fail(e)

    def close(self) -> None:
        if self._fd is not None:
            fd, self._fd = self._fd, None
            try:
                os.close(fd)
            except OSError:
                pass

    def _write_all(self, data: bytes | memoryview) -> None:
        view = memoryview(data)
        while view:
            n = os.write(self._fd, view)  # a full disk: a short write, then ENOSPC
            self._size += n
            view = view[n:]

    def _rotate(self) -> None:
        os.close(self._fd)
        self._fd = None
        self._backup(self.BACKUPS).unlink(missing_ok=True)
        for i in range(self.BACKUPS - 1, 0, -1):
            try:
                os.replace(self._backup(i), self._backup(i + 1))
            except FileNotFoundError:
                pass
        os.replace(self.path, self._backup(1))
        flags = os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC | os.O_NOFOLLOW
        self._fd = os.open(self.path, flags, 0o600)
        self._size = 0

    def _backup(self, i: int) -> Path:
        return self.path.with_name(f"{self.path.name}.{i}")

    def _fail(self, e: OSError) -> None:
        self.close()
        code = errno.errorcode.get(e.errno or 0, "error")
        self._on_error(
            f"cannot write {self.path}: {e.strerror or e} ({code}); that log file gets no more "
            "output, the job goes on"
        )


class _Item(NamedTuple):
    stream: ConsoleStream
    data: bytes
    note: bool  # meshrun's own line: never dropped, not counted against the queue


class ConsoleStream:
    """One worker stream's way to a :class:`Console`: a bounded queue that never blocks.

    Made by :meth:`Console.stream`. :meth:`put` queues a chunk (or drops it, see
    :mod:`meshrun.agent.logs`); :meth:`close` at the stream's end waits for what is queued.
    State is guarded by the console's lock.
    """

    def __init__(self, con: Console, prefix: bytes, label: str, log_path: str) -> None:
        self.console = con
        self.prefixer = LinePrefixer(prefix)
        self.label = label  # e.g. "rank 3's stdout", for the note
        self.log_path = log_path
        self.queued_bytes = 0  # worker output queued, not yet written
        self.queued_items = 0  # the same, in chunks, notes included
        self.dropping = False
        self.dropped_lines = 0
        self.dropped_bytes = 0
        self.dropped_at_line_start = True  # the last dropped byte ended a line
        self.in_traceback = False  # a "Traceback (most recent call last):" line was written
        self.line_head = b""  # the start of the line being written, to spot that header

    def put(self, data: bytes) -> None:
        """Queue ``data`` for the console, or drop it when the queue is full. Never blocks
        (beyond the console's lock, which no one holds while writing)."""
        self.console._put(self, data)

    def close(self) -> bool:
        """End of the stream: queue the note of a drop in progress, then wait until this
        stream's output is written, for as long as the console keeps writing (it gives up
        after ``Console.stall_s`` seconds without progress). True if all was written."""
        return self.console._close(self)

    def _drop(self, data: bytes) -> None:
        self.dropped_lines += data.count(b"\n")
        self.dropped_bytes += len(data)
        self.dropped_at_line_start = data.endswith((b"\n", b"\r"))

    def _note(self) -> bytes:
        n, size = self.dropped_lines, self.dropped_bytes
        self.dropping, self.dropped_lines, self.dropped_bytes = False, 0, 0
        self.dropped_at_line_start = True
        return (
            f"meshrun: console too slow, {n} line{'' if n == 1 else 's'} ({size} bytes) of "
            f"{self.label} not shown; {self.log_path} has all of it\n"
        ).encode()


class Console:
    """One console stream shared by the workers' forwarders (the agent's stdout, or stderr).

    Each forwarder writes through its own :class:`ConsoleStream` (:meth:`stream`), a bounded
    queue; one writer thread (started on demand, ended when idle) writes the queued chunks in
    the order they arrived, each chunk whole, with the stream's prefix at each line start. A
    worker whose last chunk left a line unfinished (no trailing ``\\n``) "holds" the console
    line: another worker's chunk waits until that line ends, at most ``hold_s`` seconds after
    the holder's last write, then ends it with ``\\n`` itself (the holder's next output starts
    a new, prefixed line). A line that ends in ``\\r`` (a progress bar) is broken at once, so a
    bar on one rank never slows the others. After a ``Traceback (most recent call last):`` line
    a worker holds the console the same way until it has written nothing for ``hold_s`` (or
    its stream closed), so a traceback, written in many small writes, stays one block. Since
    only the writer thread waits, a hold never delays a worker.

    Args:
        stream: a function returning the binary stream to write to, called per write (so a
            replaced ``sys.stdout`` is honoured). A stream with a file descriptor is written
            with ``os.write`` on it (not through its buffer, whose lock a blocked write would
            hold against the agent's own prints); others with ``write`` and ``flush``.
        hold_s: the longest another worker's unfinished line delays a write, in seconds.
        max_queued_bytes: each stream's queue bound, in bytes; beyond it, output is dropped
            until the queue has drained to half, then one note gives the count.
        stall_s: how long :meth:`ConsoleStream.close` waits without any write completing.

    Errors writing (a closed pipe or terminal: EPIPE, EIO) end the console copy silently.
    """

    def __init__(
        self,
        stream: Callable[[], BinaryIO],
        hold_s: float = 0.1,
        max_queued_bytes: int = 1024 * 1024,
        stall_s: float = 0.5,
    ) -> None:
        self._stream = stream
        self.hold_s = hold_s
        self.max_queued_bytes = max_queued_bytes
        self.stall_s = stall_s
        self._cond = threading.Condition()
        self._items: deque[_Item] = deque()
        self._thread: threading.Thread | None = None
        self._broken = False
        self._holder: ConsoleStream | None = None  # whose line or traceback is unfinished
        self._holder_open = False  # the holder's last byte was not "\n" (a line to break)
        self._held_at = 0.0  # monotonic time of the holder's last write
        self._worth_waiting = False  # False for a line ended by "\r" (a progress bar state)
        self._writes = 0  # completed writes, for close()'s progress check
        self._busy = False  # the writer thread is writing an item it took
        self._own = ConsoleStream(self, b"", "meshrun", "")

    def stream(self, prefix: str = "", label: str = "output", log_path: str = "") -> ConsoleStream:
        """A new queue onto this console for one worker stream; ``label`` ("rank 3's stdout")
        and ``log_path`` name it in the note about dropped output."""
        return ConsoleStream(self, prefix.encode(), label, str(log_path))

    def say(self, message: str) -> None:
        """Queue ``meshrun: <message>`` as a line of meshrun's own: never dropped (unless the
        console is closed), never blocks the caller."""
        with self._cond:
            if not self._broken:
                self._append(_Item(self._own, f"meshrun: {message}\n".encode(), True))

    def flush(self, timeout: float) -> bool:
        """Wait up to ``timeout`` seconds until everything queued is written; True if it was."""
        with self._cond:
            return self._cond.wait_for(lambda: not self._items and not self._busy, timeout)

    # --- queue side (forwarder threads) -------------------------------------------------------

    def _put(self, s: ConsoleStream, data: bytes) -> None:
        if not data:
            return
        with self._cond:
            if self._broken:
                return
            if s.dropping:
                if not self._drained(s):
                    s._drop(data)
                    return
                if not s.dropped_at_line_start:  # resume where the next line starts
                    m = _LINE_END.search(data)
                    if m is None:
                        s._drop(data)
                        return
                    s._drop(data[: m.end()])
                    data = data[m.end() :]
                self._append(_Item(s, s._note(), True))
                if not data:
                    return
            if s.queued_bytes + len(data) > self.max_queued_bytes:
                s.dropping = True
                s._drop(data)
                return
            self._append(_Item(s, data, False))

    def _append(self, item: _Item) -> None:
        self._items.append(item)
        item.stream.queued_items += 1
        if not item.note:
            item.stream.queued_bytes += len(item.data)
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="meshrun-console", daemon=True)
            self._thread.start()
        self._cond.notify_all()

    def _close(self, s: ConsoleStream) -> bool:
        with self._cond:
            if s.dropping and not self._broken:
                self._append(_Item(s, s._note(), True))
            seen, since = self._writes, time.monotonic()
            while s.queued_items and not self._broken:
                if self._writes != seen:
                    seen, since = self._writes, time.monotonic()
                left = since + self.stall_s - time.monotonic()
                if left <= 0:
                    # Stalled: forget this stream's queued output (so a blocked console does
                    # not pile up memory round after round), leave one note for its count.
                    kept = deque()
                    for item in self._items:
                        if item.stream is s and not item.note:
                            s._drop(item.data)
                            s.queued_items -= 1
                            s.queued_bytes -= len(item.data)
                        else:
                            kept.append(item)
                    self._items = kept
                    if s.dropped_bytes:
                        self._append(_Item(s, s._note(), True))
                    self._release(s)
                    return False
                self._cond.wait(left)
            self._release(s)
            return not self._broken

    def _release(self, s: ConsoleStream) -> None:
        """A closed stream writes nothing more: the others need not wait for it."""
        s.in_traceback = False
        if self._holder is s:
            self._worth_waiting = False
            if not self._holder_open:
                self._holder = None
        self._cond.notify_all()

    # --- writer side (one thread) -------------------------------------------------------------

    def _run(self) -> None:
        while True:
            with self._cond:
                item = self._next()
                if item is None:
                    self._thread = None
                    return
                out = self._render(item)
                self._busy = True
            ok = self._emit(out)
            with self._cond:
                self._busy = False
                item.stream.queued_items -= 1
                if not item.note:
                    item.stream.queued_bytes -= len(item.data)
                self._writes += 1
                if not ok:
                    self._broken = True
                    for it in self._items:
                        it.stream.queued_items = it.stream.queued_bytes = 0
                    self._items.clear()
                s = item.stream
                if s.dropping and s.dropped_at_line_start and self._drained(s):
                    self._append(_Item(s, s._note(), True))  # caught up: say it at once
                self._cond.notify_all()

    def _drained(self, s: ConsoleStream) -> bool:
        """A dropping stream may resume: its queue is down to half."""
        return s.queued_bytes <= self.max_queued_bytes // 2

    def _next(self) -> _Item | None:
        """The next item to write (the holder's first, while its line is worth waiting for),
        or None after ``_IDLE_S`` with nothing queued. Called with the lock held."""
        idle_until = time.monotonic() + _IDLE_S
        while True:
            now = time.monotonic()
            if self._items:
                holder = self._holder
                if holder is not None and self._worth_waiting:
                    for i, item in enumerate(self._items):
                        if item.stream is holder:
                            del self._items[i]
                            return item
                    remaining = self._held_at + self.hold_s - now
                    if remaining > 0:
                        self._cond.wait(remaining)
                        continue
                return self._items.popleft()
            if now >= idle_until:
                return None
            self._cond.wait(idle_until - now)

    def _render(self, item: _Item) -> bytes:
        s, data = item.stream, item.data
        out = b""
        if item.note and not s.prefixer.at_line_start:
            out = b"\n"  # a note starts a line of its own
            s.prefixer.break_line()
        out += s.prefixer.feed(data)
        holder = self._holder
        if holder not in (None, s):
            if self._holder_open:
                out = b"\n" + out
                holder.prefixer.break_line()
            holder.in_traceback = False  # its hold expired: the block is cut here
        _track_traceback(s, data)
        ends_line = data.endswith(b"\n")
        if ends_line and not s.in_traceback:
            self._holder = None
        else:
            self._holder, self._held_at, self._holder_open = s, time.monotonic(), not ends_line
            self._worth_waiting = s.in_traceback or not data.endswith(b"\r")
        return out

    def _emit(self, out: bytes) -> bool:
        """Write ``out`` whole; False when the console is gone (EPIPE, EIO, closed...)."""
        try:
            stream = self._stream()
            try:
                fd = stream.fileno()
            except (AttributeError, OSError, ValueError):
                fd = None
            if fd is None:
                stream.write(out)
                stream.flush()
            else:
                _write_fd(fd, out)
            return True
        except Exception:  # noqa: BLE001 - whatever it is, the console is gone, not the job
            return False


_TRACEBACK = b"Traceback (most recent call last):"
_LINE_HEAD = 80


def _track_traceback(s: ConsoleStream, data: bytes) -> None:
    """Set ``s.in_traceback`` once a line of ``data`` holds Python's traceback header (also
    "Exception Group Traceback"). It stays set (the console holds other streams for this
    one, ``hold_s`` after each of its writes) until the hold expires or the stream closes: a
    traceback, chained ones included, is written in a burst of small writes."""
    if s.in_traceback:
        return
    for m in _SEGMENT.finditer(data):
        seg = m.group()
        head = (s.line_head + seg)[:_LINE_HEAD]  # the header is near a line's start
        if _TRACEBACK in head:
            s.in_traceback, s.line_head = True, b""
            return
        s.line_head = b"" if seg.endswith((b"\n", b"\r")) else head


def _write_fd(fd: int, data: bytes) -> None:
    """``os.write`` all of ``data``, waiting for room on a non-blocking descriptor."""
    view = memoryview(data)
    while view:
        try:
            view = view[os.write(fd, view) :]
        except BlockingIOError:
            select.select([], [fd], [])


#: The agent's own stdout and stderr (``sys.stdout.buffer`` / ``sys.stderr.buffer``).
_CONSOLES = {
    "stdout": Console(lambda: sys.stdout.buffer),
    "stderr": Console(lambda: sys.stderr.buffer),
}


def console(name: str) -> Console:
    """The process-wide :class:`Console` for ``"stdout"`` or ``"stderr"``.

    When the agent's stdout and stderr are one file (``2>&1``, or one terminal), both names
    give the stdout console: one writer for both, so a line of a worker's stderr is never
    written into the middle of a stdout line (a pipe write over ``PIPE_BUF`` is not atomic).
    """
    if name == "stderr" and _same_file(sys.stdout, sys.stderr):
        return _CONSOLES["stdout"]
    return _CONSOLES[name]


def _same_file(a: object, b: object) -> bool:
    try:
        sa, sb = os.fstat(a.fileno()), os.fstat(b.fileno())  # type: ignore[attr-defined]
    except (AttributeError, OSError, ValueError):
        return False
    return (sa.st_dev, sa.st_ino) == (sb.st_dev, sb.st_ino)


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

    Shared by all ranks' forwarders; each forwarder gets its own :meth:`line_filter`. A write
    error is handled as for :class:`LogFile` (said once via ``on_error``, the file dropped).
    """

    def __init__(
        self,
        path: os.PathLike | str,
        filters: Sequence[str],
        on_error: Callable[[str], None] | None = None,
    ) -> None:
        self.filters = [f.encode() for f in filters]
        self._file = LogFile(path, on_error=on_error, append=True)
        self._lock = threading.Lock()

    def line_filter(self, prefix: bytes) -> Callable[[bytes, bool], None]:
        """A per-stream feeder: ``feed(data, eof)`` writes each complete matching line."""
        pending = bytearray()

        def feed(data: bytes, eof: bool = False) -> None:
            pending.extend(data)
            lines = []
            # a snapshot: a match iterator over the bytearray itself holds a buffer export,
            # and resizing it then (the del below) raises BufferError
            for m in _SEGMENT.finditer(bytes(pending)):
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
            self._file.write(data)

    def close(self) -> None:
        with self._lock:
            self._file.close()

    def _matches(self, line: bytes) -> bool:
        return any(needle in line for needle in self.filters)


class PipeForwarder:
    """Forwards one pipe (a worker's stdout or stderr) on a thread, until EOF or :meth:`stop`.

    Args:
        fd: the read end of the pipe; the forwarder owns it and closes it.
        log_path: the per-rank log file (created/truncated), written byte for byte
            (:class:`LogFile`).
        console: the :class:`Console` to copy to, or None for no console copy.
        prefix: inserted at each line start of the console copy ("" = none).
        tail: where to keep the last lines (stderr), or None.
        filtered: a ``FilteredSink.line_filter`` feeder, or None.
        name: the thread's name.
        label: names the stream in meshrun's notes, e.g. "rank 3's stdout".
        max_bytes: rotate the log file past this size (``--log-max-bytes``); None: never.
        notices: the console that meshrun's own notes (a log write error) go to; default the
            agent's stderr.
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
        label: str = "",
        max_bytes: int | None = None,
        notices: Console | None = None,
    ) -> None:
        self._fd = fd
        say = (notices or _CONSOLES["stderr"]).say
        self._file = LogFile(log_path, max_bytes=max_bytes, on_error=say)
        label = label or f"{name}'s output"
        self._console = console.stream(prefix, label, str(log_path)) if console else None
        self._tail = tail
        self._filtered = filtered
        # A self-pipe that stop() writes to; the thread waits on it beside the worker's pipe.
        self._wake_r, self._wake_w = os.pipe()
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)

    def start(self) -> None:
        self._thread.start()

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
            if self._console is not None:
                self._console.close()  # the console copy's last lines, while it keeps up
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
        if self._tail is not None:
            self._tail.feed(chunk)
        if self._filtered is not None:
            self._filtered(chunk, False)
        if self._console is not None:
            self._console.put(chunk)
