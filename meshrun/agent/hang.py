"""Hang detection: per-rank progress counters, read once per monitor tick.

The channel is a small file per worker (``MESHRUN_PROGRESS_FILE``) of little-endian uint64
slots that the worker's ``meshrun.parallel`` updates through ``mmap`` (stores to memory: no
system call, well under a microsecond): heartbeats (one per step), busy beats (long work inside
``meshrun.parallel.busy()``), collectives issued, whether it is blocked in one now, and the
time it spent blocked (layout: `meshrun.parallel.heartbeat`). A rank is watched from its first
heartbeat on, so a plain torchrun script that never calls it is never called hung.

When a watched rank made no progress (neither heartbeats nor busy beats) for ``--hang-timeout``
seconds, the agent takes every rank's stack and names the culprit (`meshrun.agent.stacks`).
"""

from __future__ import annotations

import os
import struct
import time
from dataclasses import dataclass
from pathlib import Path

from meshrun.agent.stacks import STACK_SIGNAL

# The progress file: five uint64 slots (meshrun.parallel.heartbeat's PROGRESS_BYTES; the agent
# does not import the parallel library, docs/design.md §1).
PROGRESS_BYTES = 40
_SLOTS = struct.Struct("<5Q")


def progress_env(worker_dir: Path) -> dict[str, str]:
    """The environment that tells a worker where to report progress and write its stacks."""
    return {
        "MESHRUN_PROGRESS_FILE": str(worker_dir / "progress"),
        "MESHRUN_STACK_FILE": str(worker_dir / "stack.txt"),
        "MESHRUN_STACK_SIGNAL": str(int(STACK_SIGNAL)),
    }


@dataclass(frozen=True)
class Progress:
    """One rank's counters (`meshrun.parallel.heartbeat`'s slots)."""

    heartbeats: int = 0
    busy_beats: int = 0
    collectives: int = 0  # issued by meshrun.parallel
    blocked: bool = False  # inside one of meshrun.parallel's collectives right now
    blocked_ns: int = 0  # time spent blocked in them, in all


def read_progress(path: Path) -> Progress | None:
    """The counters in the progress file at ``path``, or None when it cannot be read."""
    try:
        beats, busy, issued, blocked, blocked_ns = _SLOTS.unpack(path.read_bytes()[:PROGRESS_BYTES])
    except (OSError, struct.error):
        return None
    return Progress(beats, busy, issued, blocked > 0, blocked_ns)


@dataclass
class _Watched:
    path: Path
    seen: tuple[int, int] = (0, 0)  # (heartbeats, busy beats) at the last change
    changed_at: float = 0.0  # monotonic time they last changed (or 0: never beat)
    base: int = 0  # heartbeats before the last `ProgressWatch.rearm` (watched once past it)
    last: Progress = Progress()


@dataclass(frozen=True)
class Hang:
    """One rank that made no progress: its local rank, heartbeats so far, seconds idle."""

    local_rank: int
    heartbeats: int
    idle_s: float
    last_progress_ms: int  # wall-clock ms of its last observed heartbeat


class ProgressWatch:
    """Reads the progress counters of one group's workers and says who is hung.

    Creates each rank's progress file (zeroed), so it must be made before the workers start:
    a worker whose first heartbeat finds no file never reports progress.

    Args:
        worker_dirs: each local rank's log directory (its progress file lives there).
        timeout: seconds without progress after which a watched rank is hung, or None (the
            counters are read, nobody is ever called hung).

    Raises:
        OSError: a progress file cannot be written (a full log disk).
    """

    def __init__(self, worker_dirs: list[Path], timeout: float | None):
        self.timeout = timeout
        self._ranks = []
        for d in worker_dirs:
            path = Path(progress_env(d)["MESHRUN_PROGRESS_FILE"])
            path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
            flags = os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW | os.O_CLOEXEC
            fd = os.open(path, flags, 0o600)
            try:
                os.write(fd, b"\0" * PROGRESS_BYTES)  # the worker maps it; zero = no beat yet
            finally:
                os.close(fd)
            self._ranks.append(_Watched(path))

    def sample(self, local_rank: int) -> Progress:
        """The rank's counters now (the last ones read when the file cannot be read)."""
        w = self._ranks[local_rank]
        w.last = read_progress(w.path) or w.last
        return w.last

    def rearm(self) -> None:
        """Watch each rank again from its next heartbeat on, as if it had just started: after
        an in-place handover (`meshrun.in_place`) the same process enters a new world, and
        the seconds it waited for the new round (which the agent spent in the rendezvous), or
        a world whose strategies beat no heartbeat, are not a hang."""
        for local_rank, w in enumerate(self._ranks):
            p = self.sample(local_rank)
            w.seen, w.changed_at, w.base = (p.heartbeats, p.busy_beats), time.monotonic(), p.heartbeats

    def check(self) -> list[Hang]:
        """The ranks hung now (empty when all watched ranks progressed within the timeout, and
        always without a timeout)."""
        now, wall = time.monotonic(), time.time()
        hung = []
        for local_rank, w in enumerate(self._ranks):
            p = self.sample(local_rank)
            seen = (p.heartbeats, p.busy_beats)
            if seen != w.seen:
                w.seen, w.changed_at = seen, now
            elif (self.timeout is not None and p.heartbeats > w.base
                  and now - w.changed_at >= self.timeout):
                idle = now - w.changed_at
                hung.append(Hang(local_rank, p.heartbeats, idle, int((wall - idle) * 1000)))
        return hung
