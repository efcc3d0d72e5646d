"""`heartbeat()`: tell the agent this rank made progress; stack dumps on request.

The agent (``meshrun --hang-timeout``) gives each worker ``MESHRUN_PROGRESS_FILE``, an 8-byte
file holding a little-endian uint64. `heartbeat()` maps it once and then only increments the
counter in memory: no system call, no lock, well under a microsecond, so it can be called every
step (the library's strategies do; a script may call it too, e.g. once per batch of its own
loop). Without the variable (plain python, torchrun) it does nothing.

`register_stack_dump()` (called by ``meshrun.parallel.init()``) arms Python's ``faulthandler``
on ``MESHRUN_STACK_SIGNAL`` to write every thread's stack to ``MESHRUN_STACK_FILE``, which the
agent reads when a rank is hung. The file exists only once armed, so the agent never sends the
signal to a process that would die of it.
"""

from __future__ import annotations

import faulthandler
import mmap
import os
import signal

_progress: mmap.mmap | None | bool = None  # None: not opened yet; False: no channel
_count = 0
_stack_file = None  # kept open: faulthandler writes to its file descriptor


def heartbeat() -> None:
    """Record one unit of progress of this rank (a training step, say).

    Costs one store to memory after the first call. A no-op when the process was not started
    by ``meshrun --hang-timeout``.
    """
    global _progress, _count
    if _progress is None:
        _progress = _open_progress()
    if _progress is False:
        return
    _count += 1
    _progress[:8] = _count.to_bytes(8, "little")


def _open_progress():
    path = os.environ.get("MESHRUN_PROGRESS_FILE")
    if not path:
        return False
    try:
        with open(path, "r+b") as f:
            return mmap.mmap(f.fileno(), 8)
    except (OSError, ValueError):
        return False


def register_stack_dump() -> bool:
    """Arm faulthandler so the agent can ask for this process's stacks; idempotent.

    Returns True when armed (the agent asked for it through ``MESHRUN_STACK_FILE`` and
    ``MESHRUN_STACK_SIGNAL``), False otherwise. Mirrors what ``py-spy dump`` gives, from inside.
    """
    global _stack_file
    if _stack_file is not None:
        return True
    path, signum = os.environ.get("MESHRUN_STACK_FILE"), os.environ.get("MESHRUN_STACK_SIGNAL")
    if not path or not signum:
        return False
    try:
        stack_file = open(path, "w")  # noqa: SIM115 - must stay open for faulthandler
        faulthandler.register(signal.Signals(int(signum)), file=stack_file, all_threads=True)
    except (OSError, ValueError, RuntimeError):
        return False
    _stack_file = stack_file
    return True
