"""A worker's process tree: the processes beyond the worker that a stop must reach.

A worker leads its own session and process group, but its tree may leave it: a descendant
that called setsid or setpgid, or a double-forked daemon re-parented to the agent (a child
subreaper, `become_subreaper`). `meshrun.agent.workers.WorkerGroup.stop` finds them here
(psutil), signals them quietly (a process that is gone or not ours is skipped; psutil checks
that a pid was not reused), and reaps the ones that became the agent's children.
"""

from __future__ import annotations

import ctypes
import os
import time

import psutil

from meshrun.agent.reaper import scan_processes

#: Poll interval while waiting for processes that are not our children (descendants, group
#: members left after the leader exited): they give no event to wait on.
POLL_S = 0.02

# prctl(2) option: orphaned descendants are re-parented to this process instead of init.
_PR_SET_CHILD_SUBREAPER = 36


def become_subreaper(on: bool = True) -> bool:
    """Make this process a child subreaper (``prctl(PR_SET_CHILD_SUBREAPER, 1)``, Linux 3.4+):
    a descendant whose parent exits (a double-forked daemon) is re-parented to this process
    rather than to init, so the whole tree of a worker stays findable. systemd and tini do the
    same. ``on=False`` turns it off again. Returns False where it is unavailable (not Linux,
    or the call failed); never raises.
    """
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        return libc.prctl(_PR_SET_CHILD_SUBREAPER, int(on), 0, 0, 0) == 0
    except (OSError, AttributeError):
        return False


def descendants(pids: list[int]) -> list[psutil.Process]:
    """The live descendants of the processes ``pids``, wherever their process group is."""
    found: list[psutil.Process] = []
    for pid in pids:
        try:
            found.extend(psutil.Process(pid).children(recursive=True))
        except psutil.Error:
            continue
    return found


def orphans(known: set[int]) -> list[psutil.Process]:
    """This process's children other than ``known`` (the workers and the reaper: what is left
    are descendants that a worker's tree double-forked away), and their descendants."""
    found: list[psutil.Process] = []
    try:
        children = psutil.Process().children()
    except psutil.Error:
        return found
    for child in children:
        if child.pid in known:
            continue
        found.append(child)
        try:
            found.extend(child.children(recursive=True))
        except psutil.Error:
            pass
    return found


def anything_left(pgids: set[int], escaped: list[psutil.Process]) -> bool:
    """Whether a process other than a zombie is left in one of the process groups ``pgids``
    (their leaders have exited) or among ``escaped``. Zombies do not count: an init that does
    not reap (PID 1 in many containers) would otherwise hold a stop for its whole grace."""
    if any(pg in pgids and st != "Z" for _, pg, st in scan_processes().values()):
        return True
    for p in escaped:
        try:
            if p.is_running() and p.status() != psutil.STATUS_ZOMBIE:
                return True
        except psutil.Error:
            pass
    return False


def reap_orphans(procs: list[psutil.Process], timeout: float = 5.0) -> None:
    """Reap those of ``procs`` that are this process's children (SIGKILLed orphans), waiting
    up to ``timeout`` seconds in all; only these pids are waited for, never any child."""
    me = os.getpid()
    deadline = time.monotonic() + timeout
    for p in procs:
        try:
            if p.ppid() != me:
                continue
        except psutil.Error:
            continue
        while True:
            try:
                pid, _ = os.waitpid(p.pid, os.WNOHANG)
            except ChildProcessError:
                break
            if pid or time.monotonic() > deadline:
                break
            time.sleep(POLL_S)


def quiet_killpg(pgid: int, signum: int) -> None:
    """``killpg``, or nothing when the group is gone or not ours."""
    try:
        os.killpg(pgid, signum)
    except OSError:  # gone (ESRCH) or not ours (EPERM)
        pass


def quiet_signal(proc: psutil.Process, signum: int) -> None:
    """Signal ``proc``, or nothing when it is gone (or its pid was reused: psutil checks)."""
    try:
        proc.send_signal(signum)  # checks the pid was not reused
    except psutil.Error:
        pass
