"""The console copy of the workers' output: best effort, never blocking a worker.

One writer thread per :class:`Console` empties the streams' queues (1 MiB each),
in arrival order, inserting the rank prefix at the start of every line: after each ``\\n`` and
each ``\\r``, so a tqdm bar that redraws itself with ``\\r`` still renders, prefixed. A
partial line is written at once; the prefix goes where the next line starts. While one rank's
line is unfinished, another rank's output waits for it up to ``Console.hold_s`` (0.1 s), then
breaks the line (``print`` under ``python -u`` writes the text and the ``\\n`` separately);
the same hold keeps a Python traceback in one block. Only the writer thread ever waits: when
the console cannot keep up (a slow reader, a stopped one, a pipe nobody reads), a stream's
queue fills and its console output is dropped until the queue has drained to half, resuming
at a line start (a line cut by the drop is ended where the note starts); one note on that
stream then says how many lines and bytes were not shown and which log file has them. A closed console (EPIPE) ends the console copy silently. When the
agent's stdout and stderr are one file (``2>&1``, a terminal), both streams share one writer.

The agent's own lines (`meshrun.agent.say`: ``meshrun: ...`` lines, the failure report) take
the same way, as one more stream of the stderr console (:meth:`Console.say`,
:meth:`Console.write_own`): in arrival order with the workers' output, bounded the same way
(whole messages dropped past the bound, then one note with the count), never blocking the
agent. A blocked console (a pipe nobody reads) so costs lines, never a restart. From the
main thread a line is waited for until written, briefly (``Console.say_wait_s``), so the
console reads as if written at once; after one such wait runs out nothing waits again until
the console has caught up. At the agent's exit `finish` writes what is queued, as long as
the console keeps taking it (a blocked one is left after ``stall_s`` without progress), with
the note of the agent's own lines dropped; `dropped_total` is the run's count.

The per-rank log files (`meshrun.agent.logs`) are the complete record; this copy may drop
output (with a note) but never slows a worker (docs/design.md §3.6).
"""

from __future__ import annotations

import os
import re
import select
import sys
import threading
import time
from collections import deque
from collections.abc import Callable
from typing import BinaryIO, NamedTuple

__all__ = [
    "CONSOLES", "Console", "ConsoleStream", "LinePrefixer", "console", "dropped_total",
    "finish",
]

#: One line with its end (LF, CRLF or CR), or a last partial line.
SEGMENT = re.compile(rb"[^\r\n]*(?:\r\n|\r|\n)|[^\r\n]+")
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
        for m in SEGMENT.finditer(data):
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



class _Item(NamedTuple):
    stream: ConsoleStream
    data: bytes
    note: bool  # meshrun's own line: never dropped, not counted against the queue


class ConsoleStream:
    """One worker stream's way to a :class:`Console`: a bounded queue that never blocks.

    Made by :meth:`Console.stream`. :meth:`put` queues a chunk (or drops it, see
    this module); :meth:`close` at the stream's end waits for what is queued.
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
        lines = data.count(b"\n")
        self.dropped_lines += lines
        self.dropped_bytes += len(data)
        self.dropped_at_line_start = data.endswith((b"\n", b"\r"))
        self.console.dropped_lines += lines
        self.console.dropped_bytes += len(data)

    def _note(self) -> bytes:
        n, size = self.dropped_lines, self.dropped_bytes
        self.dropping, self.dropped_lines, self.dropped_bytes = False, 0, 0
        self.dropped_at_line_start = True
        where = f"; {self.log_path} has all of it" if self.log_path else ""
        return (
            f"meshrun: console too slow, {n} line{'' if n == 1 else 's'} ({size} bytes) of "
            f"{self.label} not shown{where}\n"
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
        say_wait_s: how long :meth:`say` on the main thread waits for its line to be written
            (the console keeping up reads as written at once); see this module.

    Errors writing (a closed pipe or terminal: EPIPE, EIO) end the console copy silently.
    """

    def __init__(
        self,
        stream: Callable[[], BinaryIO],
        hold_s: float = 0.1,
        max_queued_bytes: int = 1024 * 1024,
        stall_s: float = 0.5,
        say_wait_s: float = 0.25,
    ) -> None:
        self._stream = stream
        self.hold_s = hold_s
        self.max_queued_bytes = max_queued_bytes
        self.stall_s = stall_s
        self.say_wait_s = say_wait_s
        #: lines and bytes this console did not show (every stream, the agent's own included)
        self.dropped_lines = 0
        self.dropped_bytes = 0
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
        self._lagging = False  # a say() wait ran out; none waits until the queue is empty
        self._gave_up = -1  # self._writes when finish() last gave up
        self._own = ConsoleStream(self, b"", "meshrun's own lines", "")
        self._py = ConsoleStream(self, b"", "meshrun's other output (warnings, log records)", "")

    def stream(self, prefix: str = "", label: str = "output", log_path: str = "") -> ConsoleStream:
        """A new queue onto this console for one worker stream; ``label`` ("rank 3's stdout")
        and ``log_path`` name it in the note about dropped output."""
        return ConsoleStream(self, prefix.encode(), label, str(log_path))

    def say(self, message: str) -> None:
        """Queue ``meshrun: <message>`` as a line of meshrun's own (`write_own`)."""
        self.write_own(f"meshrun: {message}\n")

    def write_own(self, text: str) -> None:
        """Queue ``text`` (whole lines, e.g. the failure report) as meshrun's own output.

        Never blocks beyond ``say_wait_s``: on the main thread the call waits that long at most
        for the console to write it, and not at all while the console lags (an earlier wait
        ran out and the queue has not emptied since); other threads never wait. The agent's
        own output is bounded as a worker stream is (``max_queued_bytes``): past the bound a
        whole message is dropped, and once the queue has drained to half (or at `finish`)
        one note says how many lines and bytes were not shown. Nothing is queued once the
        console is closed (EPIPE)."""
        data = text.encode("utf-8", "replace")
        if not data.endswith(b"\n"):
            data += b"\n"
        s = self._own
        with self._cond:
            if not self._queue(s, data) or self._lagging:
                return
            if threading.current_thread() is not threading.main_thread():
                return
            if not self._cond.wait_for(
                lambda: not s.queued_items or self._broken, self.say_wait_s
            ):
                self._lagging = True

    def write_bytes(self, data: bytes) -> None:
        """Queue ``data`` that Python code of the agent wrote to ``sys.stdout`` or
        ``sys.stderr`` (a warning, a log record of ``logging``'s last-resort handler:
        `meshrun.launcher.stdio.route_to_console` sends them here while the agent runs), as
        a stream of its own: bounded and dropped as a worker stream is, never waiting."""
        self._put(self._py, bytes(data))

    def flush(self, timeout: float) -> bool:
        """Wait up to ``timeout`` seconds until everything queued is written; True if it was."""
        with self._cond:
            return self._cond.wait_for(lambda: not self._items and not self._busy, timeout)

    def finish(self, stall_s: float = 1.0) -> bool:
        """The agent exits: queue the note of meshrun's own output dropped (if any), then wait
        until everything queued is written, for as long as writes keep completing (giving up
        after ``stall_s`` seconds without one: a blocked console never holds the exit; what
        is still queued then is dropped and counted in ``dropped_lines``/``dropped_bytes``).
        True if everything was written."""
        with self._cond:
            for s in (self._own, self._py):
                if s.dropping and not self._broken:
                    self._append(_Item(s, s._note(), True))
            seen, since = self._writes, time.monotonic()
            if self._gave_up == seen:  # stalled at an earlier finish, no write since
                since -= stall_s
            while (self._items or self._busy) and not self._broken:
                if self._writes != seen:
                    seen, since = self._writes, time.monotonic()
                left = since + stall_s - time.monotonic()
                if left <= 0:
                    self._gave_up = seen
                    self._forget(lambda item: True)
                    return False
                self._cond.wait(left)
            return not self._broken

    # --- queue side (forwarder threads) -------------------------------------------------------

    def _put(self, s: ConsoleStream, data: bytes) -> None:
        if not data:
            return
        with self._cond:
            self._queue(s, data)

    def _queue(self, s: ConsoleStream, data: bytes) -> bool:
        """Queue ``data`` of ``s``, or drop it (see this module); True if some of it was
        queued. Called with the lock held."""
        if self._broken:
            return False
        if s.dropping:
            if not self._drained(s):
                s._drop(data)
                return False
            if not s.dropped_at_line_start:  # resume where the next line starts
                m = _LINE_END.search(data)
                if m is None:
                    s._drop(data)
                    return False
                s._drop(data[: m.end()])
                data = data[m.end() :]
            self._append(_Item(s, s._note(), True))
            if not data:
                return False
        if s.queued_bytes + len(data) > self.max_queued_bytes:
            s.dropping = True
            s._drop(data)
            return False
        self._append(_Item(s, data, False))
        return True

    def _forget(self, which: Callable[[_Item], bool]) -> None:
        """Drop the queued items ``which`` picks, counted as not shown (notes aside). Called
        with the lock held."""
        kept: deque[_Item] = deque()
        for item in self._items:
            if not which(item):
                kept.append(item)
                continue
            item.stream.queued_items -= 1
            if not item.note:
                item.stream.queued_bytes -= len(item.data)
                item.stream._drop(item.data)
        self._items = kept

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
                    self._forget(lambda item: item.stream is s and not item.note)
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
                if not self._items:
                    self._lagging = False
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
    for m in SEGMENT.finditer(data):
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
CONSOLES = {
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
        return CONSOLES["stdout"]
    return CONSOLES[name]


def finish(stall_s: float = 1.0) -> bool:
    """At the agent's exit: `Console.finish` on each of the agent's consoles (stdout and
    stderr, once when they are one); True if each wrote everything it had queued."""
    done = True
    for con in CONSOLES.values():  # one that was never used has nothing queued
        done = con.finish(stall_s) and done
    return done


def dropped_total() -> tuple[int, int]:
    """Lines and bytes the agent's consoles did not show so far (workers' and meshrun's own)."""
    cons = CONSOLES.values()
    return sum(c.dropped_lines for c in cons), sum(c.dropped_bytes for c in cons)


def _same_file(a: object, b: object) -> bool:
    try:
        sa, sb = os.fstat(a.fileno()), os.fstat(b.fileno())  # type: ignore[attr-defined]
    except (AttributeError, OSError, ValueError):
        return False
    return (sa.st_dev, sa.st_ino) == (sb.st_dev, sb.st_ino)
