"""Starting the agent's children so that a scheduler's warning cannot kill them at birth.

A SIGUSR1 or SIGUSR2 ("save soon": SLURM ``--signal``, ``scancel -s USR1``) may reach every
process of the job, or the agent's process group, at any moment, also while the agent is
starting a child. Two windows killed the new child there:

- **vfork.** CPython (3.10 on) starts children with ``vfork`` where it can. The child then
  shares the agent's memory, so before anything else it resets every signal the agent handles
  to its default action, and it unblocks signals *before* it calls ``setsid()``. A warning
  sent to the agent's process group (proctrack/pgid, ``kill -USR1 -PGID``) in that moment
  kills the child: a worker reported dead of SIGUSR1 although its script handles it, or the
  reaper dead at start. With ``fork`` the child keeps the agent's handler (which only sets a
  flag) until ``exec``, and ``exec`` comes after ``setsid``: the warning is caught in the
  child, or never reaches it. So the agent starts its children with ``fork``
  (``subprocess._USE_VFORK``, CPython's documented switch, off in the agent's process;
  CPython 3.14 dropped the switch, and there the window of microseconds per spawn remains).
  The price: ``fork`` copies the agent's page tables, about 2 ms per child before the agent
  imported torch (the first round) and 15 ms after (later rounds), against 0.2 ms with
  ``vfork`` (this machine, /bin/true started from a process of the agent's modules).
- **A helper's own start.** The reaper is a Python process that needs about 20 ms to put its
  handlers in place; a warning sent to every process (proctrack/cgroup, linuxproc) in that
  time killed it. A child can be started with signals *blocked* (``blocked``): it inherits
  the mask across ``exec`` and unblocks them once its handlers are in place, when any that
  came meanwhile are delivered to them (py-spy, which has no handler, keeps them blocked for
  its life). Only for meshrun's own helpers: a worker must start with the mask a script
  expects.

A user's script is on its own from its ``exec`` until its handler is in place, as under
torchrun.
"""

from __future__ import annotations

import signal
import subprocess
from collections.abc import Sequence

__all__ = ["popen"]


def popen(argv: Sequence[str], *, blocked: Sequence[signal.Signals] = (),
          **kwargs) -> subprocess.Popen:
    """`subprocess.Popen` (``argv`` and ``kwargs`` as there) by ``fork``, not ``vfork``; with
    ``blocked``, the child starts with those signals blocked (the calling thread blocks them
    for the moment of the spawn, and the child inherits the mask).

    Raises:
        OSError: as `subprocess.Popen`.
    """
    subprocess._USE_VFORK = False  # the agent's process only (see the module docstring)
    if not blocked:
        return subprocess.Popen(list(argv), **kwargs)
    old = signal.pthread_sigmask(signal.SIG_BLOCK, blocked)
    try:
        return subprocess.Popen(list(argv), **kwargs)
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, old)
