"""Starting meshrun's helper processes so that a scheduler's warning cannot kill them at birth.

A SIGUSR1 or SIGUSR2 ("save soon": SLURM ``--signal``, ``scancel -s USR1``), or a stop
signal, may reach every process of the job (proctrack/cgroup, linuxproc) or the agent's
process group (proctrack/pgid, ``kill -USR1 -PGID``) at any moment, also while the agent
starts a child. A helper of meshrun's (the reaper, py-spy) has no handler in place at first:
the reaper is a Python process that needs about 20 ms to install its own, py-spy never does.
A signal in that time killed it, and the agent stopped with a traceback.

So a helper is started with those signals *blocked* (`popen`'s ``blocked``): the calling
thread blocks them for the moment of the spawn, and the child inherits the mask, through
CPython's vfork too (its child restores the caller's mask before ``exec``) and across
``exec``. The reaper unblocks them once its handlers are in place, when any that came
meanwhile are delivered to them; py-spy keeps them blocked for its life.

Workers are not started so: a script must start with the mask it expects. A worker is
started with vfork (CPython's default), whose child, for some microseconds before its
``setsid()``, has the default action for every signal and is still in the agent's process
group: a warning sent to that group in exactly that moment kills it (a failure the agent
reports as such). Starting workers with fork instead closes that window but widens another:
fork copies the agent's page tables (1.9 ms per child before the agent imported torch, 14.5 ms
after, against 0.2 ms for vfork, measured here), and a worker spawned but not yet watched by
the reaper is orphaned if the agent is killed with SIGKILL in that time.
"""

from __future__ import annotations

import signal
import subprocess
from collections.abc import Sequence

__all__ = ["popen"]


def popen(argv: Sequence[str], *, blocked: Sequence[int] = (), **kwargs) -> subprocess.Popen:
    """`subprocess.Popen` (``argv`` and ``kwargs`` as there), the child started with the
    signals ``blocked`` blocked (it unblocks them when it is ready for them).

    Raises:
        OSError: as `subprocess.Popen`.
    """
    old = signal.pthread_sigmask(signal.SIG_BLOCK, blocked)
    try:
        return subprocess.Popen(list(argv), **kwargs)
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, old)
