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
"""

from __future__ import annotations

import io
import os
import select
import sys

__all__ = ["survive_closed_console"]


class _SurvivingRaw(io.RawIOBase):
    """A raw writer on ``fd`` that turns a write error into "written" (and drops the rest)."""

    def __init__(self, fd: int) -> None:
        super().__init__()
        self._fd = fd
        self.gone = False

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
