"""What meshrun does to a worker's signals: one handler for its stacks, and nothing else.

A script launched by meshrun must meet the signals it would meet under torchrun. Two things
meshrun puts into every Python worker touch them, and this module is where both are done:

- **Threads.** meshrun starts threads inside workers (the collective record's
  ``meshrun-collective-record``, ``meshrun.parallel``'s ``busy()`` beat, the background
  checkpoint save, the elastic offer watch). A process-directed signal (``kill``, ``scancel``,
  a scheduler's warning) goes to any one thread that does not block it; a thread started with
  the default mask takes a signal the script blocked in its own threads (the documented
  ``pthread_sigmask`` + ``sigwait``/``sigtimedwait`` pattern, a blocked SIGTERM) and the default
  action kills the worker (SIGUSR1: exit 138), where under torchrun the script reads it.
  `start_thread` starts a thread with every signal blocked (a new thread inherits its
  creator's mask: block all, start, restore), so a signal always waits for the script's own
  threads. Python runs signal handlers in the main thread whichever thread the kernel picked,
  so blocking costs a handler nothing.
- **Stacks.** `arm_stack_dump` registers ``faulthandler`` on meshrun's stack signal
  (``MESHRUN_STACK_SIGNAL``, SIGRTMIN+6, set by the agent with ``MESHRUN_STACK_FILE``), so the
  agent gets every thread's Python stack without ptrace rights (py-spy needs them: refused in a
  container without CAP_SYS_PTRACE or under Yama's ptrace_scope). Done by meshrun's worker site
  for every Python worker, and by ``meshrun.parallel.init()`` (a no-op when already armed).

Where it lives: at the top of the package, standard library only and importing nothing of
meshrun, because three kinds of callers need it: the worker site (``sitecustomize``) and the
collective record, which load files by path without importing the ``meshrun`` package (the
worker's interpreter need not have it), and ``meshrun.parallel``, which may not import
``meshrun.agent`` (docs/design.md §1). Loaded twice in one process (by path as
``_meshrun_worker_signals``, and as ``meshrun.worker_signals``), it keeps its one piece of
state (the armed stack file) on the first copy (`_OWNER_KEY`), as `meshrun.exit_guard` does.
"""

from __future__ import annotations

import faulthandler
import os
import signal
import sys
import threading

STACK_FILE_ENV = "MESHRUN_STACK_FILE"
STACK_SIGNAL_ENV = "MESHRUN_STACK_SIGNAL"
_OWNER_KEY = "_meshrun_worker_signals_owner"


def start_thread(thread: threading.Thread) -> threading.Thread:
    """Start ``thread`` (not yet started) with every signal blocked in it; returns it.

    The calling thread blocks all of `signal.valid_signals` (``pthread_sigmask(SIG_BLOCK)``),
    starts the thread, which inherits that mask from its creator (POSIX ``pthread_create``),
    and puts its own mask back, also when ``start`` raises. The kernel never delivers a signal
    to a thread that blocks it (SIGKILL and SIGSTOP cannot be blocked, and need not be), so
    every process-directed signal goes to the script's threads, as it would without meshrun.

    Raises:
        RuntimeError: ``thread`` was started already (from `threading.Thread.start`).
    """
    old = signal.pthread_sigmask(signal.SIG_BLOCK, signal.valid_signals())
    try:
        thread.start()
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, old)
    return thread


def arm_stack_dump(environ=None) -> bool:
    """Register ``faulthandler`` on the agent's stack signal, writing every thread's Python
    stack to the agent's stack file; idempotent per process. True when armed (now or before).

    Reads ``MESHRUN_STACK_FILE`` and ``MESHRUN_STACK_SIGNAL`` (set by meshrun's agent; absent
    under torchrun: then False). The file is opened for appending, so a Python process the
    script starts with the same environment (it runs the worker site too) adds to it instead
    of emptying it; the agent reads what a dump appended (`meshrun.agent.stacks`). A script
    that installs its own handler for the signal later replaces this one and gets the signal
    (the agent sends it to any process that has a handler for it; no dump then comes, and the
    report says so). ``chain`` is set only when a handler was there before: faulthandler
    chains by re-raising the signal under the previous disposition, and SIG_DFL of a
    real-time signal ends the process.
    """
    env = os.environ if environ is None else environ
    owner = sys.modules.setdefault(_OWNER_KEY, sys.modules[__name__])
    if getattr(owner, "stack_file", None) is not None:
        return True
    path, signum = env.get(STACK_FILE_ENV), env.get(STACK_SIGNAL_ENV)
    if not path or not signum:
        return False
    try:
        number = int(signum)
        previous = signal.getsignal(number)
        chain = previous not in (signal.SIG_DFL, signal.SIG_IGN, None)
        # 0600 like every file in the log directory (stacks show a script's paths and frames);
        # stays open: faulthandler writes to its fd
        fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)
        stack_file = os.fdopen(fd, "a")
        try:
            faulthandler.register(number, file=stack_file, all_threads=True, chain=chain)
        except BaseException:
            stack_file.close()
            raise
    except (OSError, ValueError, RuntimeError):
        return False
    owner.stack_file = stack_file
    return True
