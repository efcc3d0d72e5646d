"""The launcher's own stdout and stderr survive a console that went away.

``meshrun ... 2>&1 | head -1`` closes meshrun's console after one line: every later write gets
EPIPE (Python ignores SIGPIPE, so it is a ``BrokenPipeError``), and an agent line or the
failure report would crash the agent, and with it the job, before or while its workers run. A
disk full under ``meshrun ... > out.txt`` (ENOSPC) or a hung-up terminal (EIO) does the same.
The console is best effort (docs/design.md §3.6): the job and its log files must not depend on it.

`survive_closed_console` puts ``sys.stdout`` and ``sys.stderr`` on a raw writer that, after
the first such error, discards what is written to that stream (the usual fix is to point the
descriptor at ``/dev/null``, as Python's docs advise for SIGPIPE; this does the same without
touching a descriptor that the workers' console copy shares). Only write errors are absorbed;
nothing else about the streams changes (encoding, line buffering, ``isatty``).

While the agent runs (`route_to_console`), what Python code writes to those streams (a
warning, a record of ``logging``'s last-resort handler, as the rendezvous logs) goes through the
agent's console queue (`meshrun.agent.console`: bounded, never blocking, in order with the
workers' and the agent's lines) instead of a blocking write: a console nobody reads never stops
the agent (issue 50). `finish_console` writes what is queued at the exit, bounded.
"""

from __future__ import annotations

import atexit
import io
import os
import select
import sys
from collections.abc import Callable

__all__ = ["finish_console", "route_to_console", "survive_closed_console"]


class _SurvivingRaw(io.RawIOBase):
    """A raw writer on ``fd`` that turns a write error into "written" (and drops the rest)."""

    def __init__(self, fd: int) -> None:
        super().__init__()
        self._fd = fd
        self.gone = False
        #: where writes go instead of the descriptor (`route_to_console`), or None
        self.route: Callable[[bytes], None] | None = None

    def writable(self) -> bool:
        return True

    def fileno(self) -> int:
        return self._fd

    def isatty(self) -> bool:
        try:
            return os.isatty(self._fd)
        except OSError:
            return False

    def write(self, data) -> int:  # type: ignore[override]
        n = len(memoryview(data).cast("B"))
        if self.gone:
            return n
        route = self.route
        if route is not None:
            route(bytes(data))
            return n
        while True:
            try:
                return os.write(self._fd, data)
            except BlockingIOError:  # a descriptor left non-blocking by someone else
                select.select([], [self._fd], [])
            except OSError:  # EPIPE, EIO, ENOSPC, EBADF...: the console is gone
                self.gone = True
                return n


class _SurvivingBuffer(io.BufferedWriter):
    """The buffered layer of a surviving stream (a type of its own, to recognise it)."""


_replaced: list[io.TextIOBase] = []  # the originals, kept alive (they share our descriptors)


def survive_closed_console() -> None:
    """Replace ``sys.stdout`` and ``sys.stderr`` with streams on the same descriptors whose
    write errors (EPIPE and the like) are absorbed: after the first, that stream's output is
    discarded. Idempotent; a stream that is None or has no descriptor is left alone."""
    for name in ("stdout", "stderr"):
        old = getattr(sys, name)
        if old is None or isinstance(getattr(old, "buffer", None), _SurvivingBuffer):
            continue
        try:
            fd = old.fileno()
        except (OSError, ValueError, AttributeError):
            continue
        try:
            old.flush()
        except (OSError, ValueError):
            pass
        new = io.TextIOWrapper(
            _SurvivingBuffer(_SurvivingRaw(fd)),
            encoding=getattr(old, "encoding", None) or "utf-8",
            errors=getattr(old, "errors", None) or "strict",
            line_buffering=getattr(old, "line_buffering", False),
            write_through=getattr(old, "write_through", False),
        )
        _replaced.append(old)
        setattr(sys, name, new)


_routed: list[_SurvivingRaw] = []


def route_to_console() -> None:
    """Send what is written to the surviving ``sys.stdout`` and ``sys.stderr`` (see
    `survive_closed_console`; other streams are left alone) through the agent's console
    (`meshrun.agent.console.Console.write_bytes`), from now on; an exit handler writes what is
    still queued (`finish_console`). For the agent's run only: a subcommand's output (``meshrun
    stacks | less``) is written as usual, waiting for its reader."""
    from meshrun.agent import console

    for name in ("stdout", "stderr"):
        stream = getattr(sys, name)
        raw = getattr(getattr(stream, "buffer", None), "raw", None)
        if not isinstance(raw, _SurvivingRaw) or raw.route is not None:
            continue
        try:
            stream.flush()
        except (OSError, ValueError):
            pass
        raw.route = lambda data, name=name: console.console(name).write_bytes(data)
        _routed.append(raw)
    if _routed:
        atexit.register(finish_console)


def finish_console(stall_s: float = 1.0) -> bool:
    """Write what is queued on the agent's consoles, while they take it (``stall_s`` seconds
    without progress: given up, `meshrun.agent.console.finish`); True when nothing was left.
    Nothing to do unless `route_to_console` was called."""
    if not _routed:
        return True
    from meshrun.agent import console

    for name in ("stdout", "stderr"):
        try:
            getattr(sys, name).flush()
        except (OSError, ValueError, AttributeError):
            pass
    return console.finish(stall_s)
