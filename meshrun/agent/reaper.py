"""The reaper: a tiny process per node that kills the workers if the agent dies.

Why a separate process
    Every worker runs in its own session and process group (``start_new_session=True``), so a
    Ctrl-C or a group kill aimed at the agent does not reach the workers directly; the agent
    forwards signals itself. If the agent dies without doing so (kill -9, an OOM kill, a crash
    in native code) the workers would be orphans holding GPUs and ports. ``PR_SET_PDEATHSIG``
    does not close that hole (docs/design.md §3.5): it covers only the direct child, it fires when the
    *thread* that forked the child exits rather than the process, and setting it needs a
    ``preexec_fn``, which is unsafe in a threaded agent. So cleanup does not rest on it.

How it works
    ``Reaper.start()`` spawns ``python -I -S reaper.py`` (stdlib only, no site, no meshrun
    import: it starts in a few ms) in its own session, with the read end of a pipe as its stdin.
    Only the agent holds the write end: ``os.pipe()`` descriptors are close-on-exec and
    ``subprocess`` closes other descriptors, so workers never inherit it. The agent writes one
    line per event::

        watch <pgid>     a worker's process group to kill if the agent dies
        forget <pgid>    that group was stopped and reaped by the agent
        close            clean shutdown: exit without killing anything

    The kernel closes the write end whenever the agent process dies, however it dies, so the
    reaper reads EOF. On EOF without ``close`` it sends SIGKILL to every member of every
    still-watched process group, and also to every descendant of those members that moved to
    another group or session (found in ``/proc`` before anything is killed, because a killed
    parent's children are re-parented and can no longer be traced), then exits.

No pid is signalled after it was reaped
    A group id is a number that can be reused once every member is gone. The agent never reaps
    a watched worker (it forgets the group first), but once the agent is dead its zombies are
    re-parented and reaped by someone else. So the reaper signals nothing by number: on
    ``watch`` it opens a pidfd of the group's leader (``pidfd_open``; the leader is then an
    unreaped child of the agent, so the pid is surely the worker's), and on EOF it opens a
    pidfd of every process it is about to kill and checks, through ``/proc``, that the pid
    still names the process it found (same start time). A member of a watched group is ours
    while the group's leader is unreaped (its pidfd still reaches it: the id cannot have
    been reused), or when it started before the agent's death was seen (a reused id can only
    be taken after the leader was reaped, which is after that). The reaper ignores
    SIGINT, SIGTERM, SIGHUP, SIGQUIT and whatever else the agent handles
    (``--signals-to-handle``), survives SIGUSR1 and SIGUSR2 (telling the agent it got one:
    `Reaper.signals_seen`), and lives in its own session, so terminal signals and a kill
    of the agent's process group do not take it out before its job is done. It exits when the
    agent closes the pipe either way, so it never outlives the agent.

Limits
    A worker is not covered from its spawn until ``watch`` is written (``Popen`` returns once
    the child has exec'd: about 0.2 ms with CPython's vfork, per worker) if the agent dies
    with SIGKILL in that window: it is orphaned. If the agent ``os.fork()``s without exec
    (e.g. multiprocessing's "fork" start method), the forked child holds the write end and the
    reaper sees EOF only when both are gone. A daemon that a worker's tree double-forked away
    (re-parented to the agent, a child subreaper) has left every watched group: the agent's
    own stop kills it at the end of each round, but after a kill -9 of the agent it is not
    found.
"""

from __future__ import annotations

import os
import signal
import sys
import time

#: The warning signals schedulers send (SLURM's ``--signal``, ``scancel -s``): the reaper
#: survives them and tells the agent it got one.
PROBED_SIGNALS = (signal.SIGUSR1, signal.SIGUSR2)
#: What the reaper ignores whatever the agent handles: the stop signals a job step gets (the
#: agent's default --signals-to-handle, and SIGPIPE for a reader gone).
IGNORED = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP, signal.SIGQUIT, signal.SIGPIPE)
#: Never ignored: signals of the reaper's own faults, which it must die of.
_FAULTS = {signal.SIGSEGV, signal.SIGBUS, signal.SIGFPE, signal.SIGILL, signal.SIGSYS,
           signal.SIGTRAP, signal.SIGABRT, signal.SIGKILL, signal.SIGSTOP}

if __name__ != "__main__":
    # The agent side. The reaper process itself (run as a script) needs none of these, and
    # skipping them halves its start-up time.
    import logging
    import select
    import subprocess
    import threading

    from meshrun.agent.spawn import popen

    log = logging.getLogger(__name__)

__all__ = ["Reaper", "scan_processes"]


class Reaper:
    """Kills watched worker process groups with SIGKILL when the agent process dies.

    Usage::

        reaper = Reaper()
        reaper.start()            # before the first worker is spawned
        reaper.watch(pgid)        # after spawning each worker (WorkerGroup does this)
        reaper.forget(pgid)       # after stopping it (WorkerGroup.stop does this)
        reaper.close()            # on a clean agent exit: the reaper exits, killing nothing

    Methods are thread-safe. ``watch``/``forget`` after the reaper died (it should not; it is
    SIGKILL-only) log a warning and do nothing. There is no torch equivalent: torchrun stops
    its workers from its signal handlers, so a torchrun killed with SIGKILL leaks them.
    """

    def __init__(self, also_ignore: tuple[int, ...] = ()) -> None:
        """``also_ignore``: signals the reaper ignores beside `IGNORED` (the agent's
        --signals-to-handle: a signal sent to every process of the job step reaches the
        reaper too, and must not end it before the agent's last word). Fault signals
        (SIGSEGV and the like) are never ignored."""
        self._ignored = tuple(sorted({int(s) for s in (*IGNORED, *also_ignore)} - _FAULTS))
        self._lock = threading.Lock()
        self._proc: subprocess.Popen | None = None
        self._wfd: int | None = None
        self._warned = False
        self._seen_buf = b""  # a partial line of the reaper's signal reports

    @property
    def pid(self) -> int | None:
        """The reaper process's pid, or None before ``start()``."""
        return self._proc.pid if self._proc else None

    def start(self, timeout: float = 10.0) -> None:
        """Spawn the reaper process and wait until it is ready (signals ignored). Idempotent.

        Args:
            timeout: seconds to wait for the reaper's "ready" line (it takes ~20 ms).

        Raises:
            OSError: the process could not be spawned.
            RuntimeError: it did not report ready within ``timeout`` (it is killed).
        """
        with self._lock:
            if self._proc is not None:
                return
            rfd, wfd = os.pipe()
            try:
                proc = popen(  # its signals blocked until its handlers are in place
                    [sys.executable, "-I", "-S", os.path.abspath(__file__),
                     ",".join(map(str, self._ignored))],
                    blocked=(*self._ignored, *PROBED_SIGNALS),
                    stdin=rfd,
                    stdout=subprocess.PIPE,
                    start_new_session=True,
                    close_fds=True,
                )
            except BaseException:
                os.close(wfd)
                raise
            finally:
                os.close(rfd)
            ready, _, _ = select.select([proc.stdout], [], [], timeout)
            line = proc.stdout.readline() if ready else b""
            if line != b"ready\n":
                proc.stdout.close()
                os.close(wfd)
                proc.kill()
                proc.wait()
                raise RuntimeError(
                    f"Reaper: the reaper process did not start within {timeout} s "
                    f"(got {line!r}, exit code {proc.returncode})"
                )
            os.set_blocking(proc.stdout.fileno(), False)
            self._proc, self._wfd = proc, wfd

    def signals_seen(self) -> list[tuple[int, float]]:
        """The warning signals (`PROBED_SIGNALS`) the reaper received since the last call, in
        order, each with the `time.monotonic()` (CLOCK_MONOTONIC, one clock for every process
        of the host) at which the reaper got it: a signal that reached the reaper too was sent
        to the whole job step (SLURM's proctrack/linuxproc or cgroup signals every process of
        the step), so the workers got it as well; one the reaper did not get was sent to the
        agent alone (or its group). The reaper's own time, not the time of this call, so an
        agent that looks seconds later (a long --monitor-interval) still matches them."""
        proc = self._proc
        if proc is None or proc.stdout is None or proc.stdout.closed:
            return []
        try:
            data = os.read(proc.stdout.fileno(), 4096)
        except (BlockingIOError, InterruptedError):
            return []
        except OSError:
            return []
        self._seen_buf += data
        *lines, self._seen_buf = self._seen_buf.split(b"\n")
        seen = []
        for line in lines:
            signum, _, at = line.partition(b" ")
            try:
                seen.append((int(signum), float(at)))
            except ValueError:
                continue
        return seen

    def watch(self, pgid: int) -> None:
        """Ask the reaper to SIGKILL process group ``pgid`` if the agent dies."""
        self._send(f"watch {int(pgid)}\n")

    def forget(self, pgid: int) -> None:
        """Tell the reaper that process group ``pgid`` is gone (stopped by the agent)."""
        self._send(f"forget {int(pgid)}\n")

    def close(self, timeout: float = 5.0) -> None:
        """Stop the reaper without killing anything, and reap it. Idempotent.

        Args:
            timeout: seconds to wait for the reaper to exit before SIGKILLing it.
        """
        with self._lock:
            if self._wfd is not None:
                try:
                    os.write(self._wfd, b"close\n")
                except OSError:
                    pass
                os.close(self._wfd)
                self._wfd = None
            proc = self._proc
        if proc is not None and proc.stdout is not None:
            proc.stdout.close()
        if proc is not None and proc.returncode is None:
            try:
                proc.wait(timeout)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()

    def __enter__(self) -> Reaper:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _send(self, line: str) -> None:
        with self._lock:
            if self._wfd is None:
                raise RuntimeError(
                    "Reaper: call start() before watch()/forget() (or it was closed)"
                )
            try:
                # Lines are far below PIPE_BUF, so each write is atomic.
                os.write(self._wfd, line.encode())
            except OSError as e:
                if not self._warned:
                    self._warned = True
                    log.warning(
                        "reaper process is gone (%s); workers are not protected "
                        "against the agent's death",
                        e,
                    )


# --- the reaper process itself (stdlib only; runs as `python -I -S reaper.py`) -----------------


def _main() -> int:
    # argv[1]: the signals to ignore (`Reaper`'s IGNORED and the agent's handled ones)
    ignored = [int(n) for n in sys.argv[1].split(",") if n] if len(sys.argv) > 1 else []
    ignored = ignored or list(IGNORED)
    for sig in ignored:
        signal.signal(sig, signal.SIG_IGN)
    # The schedulers' warning signals: not the reaper's to die of; each one received is told
    # to the agent (a line: the signal number and the monotonic time it came), which learns from it whether the signal
    # went to the whole job step (and so to the workers) or to the agent alone.
    os.set_blocking(1, False)
    for sig in PROBED_SIGNALS:
        signal.signal(sig, _tell_agent)
    # Tell the agent that the signals are handled; stdout then carries only those bytes.
    os.write(1, b"ready\n")
    # started with these blocked (`Reaper.start`): any that came meanwhile is delivered now
    signal.pthread_sigmask(signal.SIG_UNBLOCK, [*ignored, *PROBED_SIGNALS])
    watched: dict[int, int | None] = {}  # pgid -> pidfd of its leader (None: not opened)
    buf = b""
    while True:
        try:
            chunk = os.read(0, 4096)
        except InterruptedError:
            continue
        if not chunk:
            break
        buf += chunk
        *lines, buf = buf.split(b"\n")
        for line in lines:
            cmd, _, arg = line.decode("ascii", "replace").partition(" ")
            if cmd == "close":
                return 0
            try:
                pgid = int(arg)
            except ValueError:
                continue
            if cmd == "watch" and pgid > 1 and pgid not in watched:
                watched[pgid] = _pidfd(pgid)
            elif cmd == "forget" and pgid in watched:
                fd = watched.pop(pgid)
                if fd is not None:
                    os.close(fd)
    # EOF without "close": the agent died. Kill twice, in case something forked meanwhile.
    died = _boot_ticks()
    for _ in range(2):
        _kill_groups(watched, died)
    return 0


def _tell_agent(signum: int, frame) -> None:
    try:  # one line, far below PIPE_BUF: written whole
        os.write(1, b"%d %.6f\n" % (signum, time.monotonic()))
    except OSError:  # the agent is gone or not reading: nothing to tell
        pass


def _kill_groups(watched: dict[int, int | None], died: int) -> None:
    """SIGKILL the members of the groups ``watched`` (pgid -> leader's pidfd) and every
    descendant of theirs, each through a pidfd checked to name the process found in /proc.
    ``died``: when the agent's death was seen, in clock ticks since boot."""
    if not watched:
        return
    for fd in watched.values():  # the leaders themselves: their pidfds are surely theirs
        if fd is not None:
            _quiet(signal.pidfd_send_signal, fd, signal.SIGKILL)
    procs = _scan()
    # A group is surely the worker's while its leader is unreaped: checked after the scan.
    held = {pgid for pgid, fd in watched.items() if fd is not None and _reaches(fd)}
    children: dict[int, list[int]] = {}
    for pid, (ppid, _, _, _) in procs.items():
        children.setdefault(ppid, []).append(pid)
    targets = [
        pid
        for pid, (_, pgid, _, start) in procs.items()
        if pgid in watched and (pgid in held or start <= died)
    ]
    seen: set[int] = set()
    while targets:
        pid = targets.pop()
        if pid in seen:
            continue
        seen.add(pid)
        targets.extend(children.get(pid, ()))
    me = os.getpid()
    for pid in seen - {me, 1}:
        _kill_if_same(pid, procs[pid][3])


def _kill_if_same(pid: int, start: int) -> None:
    """SIGKILL ``pid`` if it still is the process that started at ``start`` (clock ticks):
    through a pidfd opened before the check, so the signal reaches the process checked."""
    try:
        fd = os.pidfd_open(pid)
    except ProcessLookupError:
        return
    except (AttributeError, OSError):  # no pidfds (Linux < 5.3): check, then kill by pid
        now = _stat(pid)
        if now is not None and now[3] == start:
            _quiet(os.kill, pid, signal.SIGKILL)
        return
    try:
        now = _stat(pid)
        if now is not None and now[3] == start:  # still the process we found
            _quiet(signal.pidfd_send_signal, fd, signal.SIGKILL)
    finally:
        os.close(fd)


def _pidfd(pid: int) -> int | None:
    try:
        return os.pidfd_open(pid)
    except (AttributeError, OSError):  # gone, or pidfds unsupported (Linux < 5.3)
        return None


def _reaches(fd: int) -> bool:
    """Whether the process behind pidfd ``fd`` is unreaped (alive or a zombie)."""
    try:
        signal.pidfd_send_signal(fd, 0)
        return True
    except OSError:
        return False


def _boot_ticks() -> int:
    """Now, in the unit of /proc/PID/stat's start time: clock ticks since boot."""
    return int(time.clock_gettime(time.CLOCK_BOOTTIME) * os.sysconf("SC_CLK_TCK"))


def scan_processes() -> dict[int, tuple[int, int, str]]:
    """Every process on the machine from ``/proc``: ``{pid: (ppid, pgid, state)}``, where state
    is the one-letter code of ``/proc/PID/stat`` ("Z" for a zombie). Stdlib only, so the reaper
    process can use it without importing psutil."""
    return {pid: entry[:3] for pid, entry in _scan().items()}


def _scan() -> dict[int, tuple[int, int, str, int]]:
    """``{pid: (ppid, pgid, state, start time in clock ticks since boot)}`` from /proc."""
    out: dict[int, tuple[int, int, str, int]] = {}
    try:
        names = os.listdir("/proc")
    except OSError:
        return out
    for name in names:
        if name.isdigit() and (entry := _stat(int(name))) is not None:
            out[int(name)] = entry
    return out


def _stat(pid: int) -> tuple[int, int, str, int] | None:
    """``(ppid, pgid, state, start time)`` of ``pid`` from /proc/PID/stat, or None if gone."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read()
    except OSError:
        return None
    # Fields after the command name (which may contain spaces and parentheses).
    fields = stat[stat.rfind(b")") + 2 :].split()
    try:
        return int(fields[1]), int(fields[2]), fields[0].decode(), int(fields[19])
    except (IndexError, ValueError):
        return None


def _quiet(fn, *args) -> None:
    try:
        fn(*args)
    except OSError:
        pass


if __name__ == "__main__":
    sys.exit(_main())
