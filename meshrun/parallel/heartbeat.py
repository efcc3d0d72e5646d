"""Progress for meshrun's agent (``--hang-timeout``, stragglers): heartbeats, long work,
collectives; stack dumps.

The agent gives each worker ``MESHRUN_PROGRESS_FILE``, a small file of little-endian uint64
slots that this module maps once and then updates in memory (a store: no system call, no lock,
well under a microsecond), and the agent reads once per monitor tick:

====  ============================================================================
slot  meaning
====  ============================================================================
0     heartbeats: one per training step (`heartbeat()`; the strategies call it)
1     busy beats: ticks of a `busy()` block (long work that is not a step)
2     collectives issued by meshrun.parallel (`note_issued`)
3     depth of meshrun.parallel calls blocked in a collective right now (`blocked`)
4     nanoseconds spent blocked in meshrun.parallel collectives, in all
====  ============================================================================

Slots 0 and 1 are progress; 2-4 tell the agent where a stalled rank is (waiting in a
collective, or behind the others in collectives issued) and how much of each step a rank spends
waiting for its peers (a straggler waits least). Without the variable (plain python, torchrun)
all of it does nothing; nor inside a ``torch.compile`` trace (collectives traced into a graph,
TP's in a compiled block, are not counted: an mmap cannot be traced).

`register_stack_dump()` (called by ``meshrun.parallel.init()``; meshrun's worker site does the
same for every Python worker) arms Python's ``faulthandler`` on ``MESHRUN_STACK_SIGNAL`` to
write every thread's stack to ``MESHRUN_STACK_FILE``, which the agent reads when a rank is hung
or stopped after a failure. The file exists only once armed, and the agent signals only a
process that handles the signal, so it never sends it to a process that would die of it.
"""

from __future__ import annotations

import contextlib
import mmap
import os
import threading
import time
from collections.abc import Iterator

import torch

from meshrun import worker_signals

#: Bytes of the progress file: five uint64 slots (see the module docstring).
PROGRESS_BYTES = 40
_HEARTBEATS, _BUSY, _ISSUED, _BLOCKED, _BLOCKED_NS = 0, 8, 16, 24, 32

_progress: mmap.mmap | None | bool = None  # None: not opened yet; False: no channel
_lock = threading.Lock()  # slots written from a busy() thread and the main thread


def heartbeat() -> None:
    """Record one unit of progress of this rank (a training step, say).

    Costs a few stores to memory after the first call. A no-op outside meshrun (plain
    python, torchrun); under meshrun the agent reads it for ``--hang-timeout`` and for
    straggler lines.
    """
    _bump(_HEARTBEATS, 1)


@contextlib.contextmanager
def busy(what: str = "work", *, interval: float = 0.25, timeout: float | None = None) -> Iterator[None]:
    """Count long work that is not a training step (an evaluation, a checkpoint) as progress.

    While the block runs, a thread beats every ``interval`` seconds, so ``--hang-timeout``
    does not call the rank hung; after ``timeout`` seconds (None: never) it stops beating, so a
    block that truly hangs is still caught. Use it on *every* rank that takes part, also on the
    ranks that only wait for the work (a barrier after rank 0's evaluation): a rank waiting
    outside ``busy()`` makes no progress. meshrun's checkpoint save and load use it.

    Args:
        what: a name for the work (for the reader; not sent anywhere).
        interval: seconds between beats (> 0); well under the shortest ``--hang-timeout``
            (1 s): beats 1 s apart against a 1 s timeout made one late beat a "hang".
        timeout: seconds after which the block no longer counts as progress, or None.
    """
    del what
    if _channel() is None:
        yield
        return
    done = threading.Event()
    until = None if timeout is None else time.monotonic() + timeout

    def beat() -> None:
        while not done.wait(interval):
            if until is not None and time.monotonic() > until:
                return
            _bump(_BUSY, 1)

    thread = threading.Thread(target=beat, name="meshrun-busy", daemon=True)
    _bump(_BUSY, 1)
    worker_signals.start_thread(thread)  # every signal blocked: they stay the script's
    try:
        yield
    finally:
        done.set()
        thread.join()
        _bump(_BUSY, 1)


def note_issued(n: int = 1) -> None:
    """Count ``n`` collectives issued by this rank (meshrun.parallel's collectives call it)."""
    _bump(_ISSUED, n)


@contextlib.contextmanager
def blocked() -> Iterator[None]:
    """Mark this rank as blocked in a collective for the block's duration (a synchronous
    collective, or ``work.wait()``), and add the time to the blocked-nanoseconds slot."""
    slots = _channel()
    if slots is None:
        yield
        return
    _bump(_BLOCKED, 1)
    start = time.monotonic_ns()
    try:
        yield
    finally:
        _bump(_BLOCKED_NS, time.monotonic_ns() - start)
        _bump(_BLOCKED, -1)


def _bump(offset: int, delta: int) -> None:
    slots = _channel()
    if slots is None:
        return
    with _lock:
        value = int.from_bytes(slots[offset : offset + 8], "little") + delta
        slots[offset : offset + 8] = max(0, value).to_bytes(8, "little")


def _channel() -> mmap.mmap | None:
    global _progress
    if torch.compiler.is_compiling():  # inside a torch.compile trace (a TP collective in a
        return None  # compiled block): an mmap is not traceable; the counters skip it
    if _progress is None:
        _progress = _open_progress()
    return _progress or None


def _open_progress():
    path = os.environ.get("MESHRUN_PROGRESS_FILE")
    if not path:
        return False
    try:
        with open(path, "r+b") as f:
            if os.fstat(f.fileno()).st_size < PROGRESS_BYTES:
                return False
            return mmap.mmap(f.fileno(), PROGRESS_BYTES)
    except (OSError, ValueError):
        return False


def register_stack_dump() -> bool:
    """Arm faulthandler so the agent can ask for this process's stacks; idempotent.

    Returns True when armed (the agent asked for it through ``MESHRUN_STACK_FILE`` and
    ``MESHRUN_STACK_SIGNAL``), False otherwise (under torchrun). Mirrors what ``py-spy dump``
    gives, from inside. meshrun's worker site arms every Python worker it starts already
    (`meshrun.worker_signals.arm_stack_dump`, the one place it is done); this call covers a
    worker whose site did not run (``python -S``, a ``PYTHONPATH`` the script replaced).
    """
    return worker_signals.arm_stack_dump()
