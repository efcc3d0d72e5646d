"""A clean exit for torch.distributed scripts: wait for torch's native threads before finalizing.

Why: under torch 2.13 + gloo a script that finished its work sometimes dies at interpreter exit
with "terminate called without an active exception" (SIGABRT), and a job that trained correctly
is reported failed (here, 8 of 20 runs of a three-``all_reduce`` script, no CPU load). A core
dump shows the sequence:

1. the main thread's ``all_reduce`` returns as soon as gloo marks the work complete;
2. the gloo worker thread (``ProcessGroupGloo::runLoop``) then destroys the finished work, and
   dropping its tensors drops a reference to their Python objects, which needs the GIL;
3. meanwhile the main thread, holding the GIL, runs the script's last lines and reaches
   ``Py_FinalizeEx``; once finalizing, CPython 3.11 ends any other thread that takes the GIL
   with ``pthread_exit``, whose forced unwind meets the worker's ``noexcept`` destructor, and
   C++ calls ``std::terminate``.

So the abort needs a native thread that still has Python work to do when finalization starts.
`wait_for_native_threads`, run as the last ``atexit`` handler (after the script's own handlers,
before ``Py_FinalizeEx`` flushes stdio and collects garbage), sleeps in steps of 2 ms, releasing
the GIL so a waiting thread takes it, until no other thread of the process is running or
runnable (``R`` in ``/proc/self/task/*/stat``) in three samples in a row, for at most 0.5 s.
Nothing is skipped: every ``atexit`` handler, ``__del__`` and buffered write runs as it would.

Workers that meshrun starts get the guard through a ``sitecustomize`` on ``PYTHONPATH``
(``meshrun/agent/worker_site``; a script's own ``sitecustomize`` still runs after it);
``meshrun.parallel.init()`` installs it too, for runs under torchrun. ``MESHRUN_EXIT_GUARD=0``
turns it off. This module imports only the standard library: the worker's interpreter loads it
by path, before anything else, and it must not cost an ``import torch``.
"""

from __future__ import annotations

import atexit
import os
import sys
import threading
import time

OFF_ENV = "MESHRUN_EXIT_GUARD"  # "0": no guard
_STEP_S = 0.002
_QUIET_SAMPLES = 3
_MAX_WAIT_S = 0.5
# One guard per process, whichever copy of this module installs it (the sitecustomize loads
# this file by path under its own name; `meshrun.parallel` imports it as meshrun.exit_guard).
_OWNER_KEY = "_meshrun_exit_guard_owner"


def others_running() -> bool:
    """Whether a thread of this process other than the caller is running or runnable.

    Reads each thread's state from ``/proc/self/task/<tid>/stat`` (the field after the command
    name, which may itself hold spaces or parentheses). False where /proc cannot be read.
    """
    me = threading.get_native_id()
    try:
        tids = os.listdir("/proc/self/task")
    except OSError:
        return False
    for tid in tids:
        if tid == str(me):
            continue
        try:
            with open(f"/proc/self/task/{tid}/stat", "rb") as f:
                stat = f.read()
        except OSError:  # the thread ended meanwhile
            continue
        if stat[stat.rfind(b")") + 2:][:1] == b"R":
            return True
    return False


def wait_for_native_threads(max_wait_s: float = _MAX_WAIT_S) -> bool:
    """Let the process's native threads finish what needs the GIL; True once they are quiet.

    Does nothing (returns True) unless ``torch.distributed`` was imported. Otherwise sleeps
    ``_STEP_S`` at a time (each sleep releases the GIL) until `others_running` is False three
    samples in a row, or ``max_wait_s`` seconds have passed (then False: a thread that is busy
    for good, such as a spinning daemon thread, costs at most that at exit).
    """
    if "torch.distributed" not in sys.modules:
        return True
    deadline = time.monotonic() + max_wait_s
    quiet = 0
    while time.monotonic() < deadline:
        time.sleep(_STEP_S)
        quiet = 0 if others_running() else quiet + 1
        if quiet >= _QUIET_SAMPLES:
            return True
    return False


def install() -> bool:
    """Register `wait_for_native_threads` with ``atexit`` once per process; True if this call
    registered it. Call it early: ``atexit`` runs handlers last-registered first, so the guard
    runs after every handler registered later (the script's, ``destroy_process_group``)."""
    if os.environ.get(OFF_ENV) == "0":
        return False
    owner = sys.modules.setdefault(_OWNER_KEY, sys.modules[__name__])
    if getattr(owner, "installed", False):
        return False
    owner.installed = True
    atexit.register(owner.wait_for_native_threads)
    return True
