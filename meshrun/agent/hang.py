"""Hang detection: per-rank progress counters, and the Python stack of every rank when stuck.

The channel is a file of 8 bytes per worker (``MESHRUN_PROGRESS_FILE``): the worker's
``meshrun.parallel.heartbeat()`` increments a little-endian uint64 in it through ``mmap`` (a
store to memory: no system call, no lock, well under a microsecond), and the agent reads it
once per monitor tick. A rank is watched from its first heartbeat on, so a plain torchrun
script that never calls it is never called hung.

When a watched rank's counter has not moved for ``--hang-timeout`` seconds, the agent asks every
rank for its stack: ranks whose script called ``meshrun.parallel.init()`` registered Python's
``faulthandler`` on ``MESHRUN_STACK_SIGNAL`` (SIGUSR2) writing to ``MESHRUN_STACK_FILE``; the
others are read with ``py-spy dump`` where py-spy is installed. A signal is only ever sent to a
worker that registered for it (SIGUSR2's default action would kill it).
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import struct
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

STACK_SIGNAL = signal.SIGUSR2
# How long to wait for faulthandler to write a stack after the signal, seconds.
_STACK_WAIT_S = 2.0
_PY_SPY_TIMEOUT_S = 10.0
_FRAME = re.compile(r'File "(?P<file>[^"]+)", line (?P<line>\d+) in (?P<func>\S+)')


def progress_env(worker_dir: Path) -> dict[str, str]:
    """The environment that tells a worker where to report progress and write its stacks."""
    return {
        "MESHRUN_PROGRESS_FILE": str(worker_dir / "progress"),
        "MESHRUN_STACK_FILE": str(worker_dir / "stack.txt"),
        "MESHRUN_STACK_SIGNAL": str(int(STACK_SIGNAL)),
    }


@dataclass
class _Watched:
    path: Path
    count: int = 0
    changed_at: float = 0.0  # monotonic time the count last changed (or 0: never beat)


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
        timeout: seconds without progress after which a watched rank is hung.
    """

    def __init__(self, worker_dirs: list[Path], timeout: float):
        self.timeout = timeout
        self._ranks = []
        for d in worker_dirs:
            path = Path(progress_env(d)["MESHRUN_PROGRESS_FILE"])
            path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
            flags = os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW | os.O_CLOEXEC
            fd = os.open(path, flags, 0o600)
            try:
                os.write(fd, b"\0" * 8)  # the worker maps it; zero = no heartbeat yet
            finally:
                os.close(fd)
            self._ranks.append(_Watched(path))

    def check(self) -> list[Hang]:
        """The ranks hung now (empty when all watched ranks progressed within the timeout)."""
        now, wall = time.monotonic(), time.time()
        hung = []
        for local_rank, w in enumerate(self._ranks):
            try:
                (count,) = struct.unpack("<Q", w.path.read_bytes()[:8])
            except (OSError, struct.error):
                continue
            if count != w.count:
                w.count, w.changed_at = count, now
            elif w.count > 0 and now - w.changed_at >= self.timeout:
                idle = now - w.changed_at
                hung.append(Hang(local_rank, w.count, idle, int((wall - idle) * 1000)))
        return hung


def collect_stack(pid: int, stack_file: Path) -> str:
    """The Python stack of worker ``pid``: from faulthandler if it registered, else py-spy.

    Returns "" when neither is available (the report then says how to get one).
    """
    if stack_file.exists():
        size = stack_file.stat().st_size
        try:
            os.kill(pid, STACK_SIGNAL)
        except ProcessLookupError:
            return ""
        deadline = time.monotonic() + _STACK_WAIT_S
        while time.monotonic() < deadline:
            if stack_file.stat().st_size > size:
                time.sleep(0.1)  # let faulthandler finish writing every thread
                return stack_file.read_text(errors="replace")[size:]
            time.sleep(0.02)
    py_spy = shutil.which("py-spy")
    if py_spy:
        try:
            out = subprocess.run(
                [py_spy, "dump", "--pid", str(pid)],
                capture_output=True, text=True, timeout=_PY_SPY_TIMEOUT_S,
            )  # fmt: skip
            return out.stdout
        except (OSError, subprocess.TimeoutExpired):
            return ""
    return ""


def stuck_at(stack: str) -> str:
    """Where the main thread is, from a faulthandler dump (``Current thread``, most recent call
    first) or a py-spy dump: the innermost frame of the user's code (outside site-packages and
    the standard library), and the innermost frame overall when that is somewhere else.
    """
    section = stack
    for marker in ("Current thread", "(most recent call first)", "Thread "):
        if marker in stack:
            section = stack[stack.index(marker) :]
            break
    frames = [(m["file"], m["line"], m["func"]) for m in _FRAME.finditer(section)]
    if not frames:  # py-spy: "    func (file.py:12)"
        frames = [
            (m["file"], m["line"], m["func"])
            for m in re.finditer(r"^\s+(?P<func>\S+) \((?P<file>[^:()]+):(?P<line>\d+)\)", section, re.M)
        ]
    if not frames:
        return "unknown (no Python stack available)"
    innermost = frames[0]
    user = next((f for f in frames if not _is_library(f[0])), innermost)
    text = f"{user[0]}:{user[1]} in {user[2]}"
    if user != innermost:
        text += f" (inside {Path(innermost[0]).name}:{innermost[1]} in {innermost[2]})"
    return text


def _is_library(path: str) -> bool:
    # py-spy prints library frames relative to their site-packages directory
    relative = not path.startswith("/")
    return relative or "site-packages" in path or "dist-packages" in path or "/lib/python3" in path
