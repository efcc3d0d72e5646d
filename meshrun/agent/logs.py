"""Forwarding of worker output: pipe -> per-rank log file, console (prefixed), filtered file.

The per-rank log files are meshrun's promise: complete, byte for byte. The console copy is best
effort: it never blocks or slows a worker (docs/design.md §3.6).

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
  (`meshrun.agent.console.ConsoleStream`), never more;
- for stderr, into a bounded in-memory tail (:class:`StderrTail`) for the failure report;
- to the filtered file, for lines that contain any of the duplicate filters.

The console copy and its rules (bounded queues, the rank prefix, what is dropped) are
`meshrun.agent.console`'s.

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
import select
import threading
from collections.abc import Callable, Sequence
from pathlib import Path

from meshrun.agent.console import CONSOLES, SEGMENT, Console, console

__all__ = [
    "FilteredSink",
    "LogFile",
    "PipeForwarder",
    "StderrTail",
]

_CHUNK = 65536
# A line: any run of non-terminators, then a terminator (or end of data: a partial line).
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
            for m in SEGMENT.finditer(bytes(pending)):
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
        say = (notices or CONSOLES["stderr"]).say
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
