"""The ``meshrun`` command's first lines, before anything else of meshrun is imported.

A scheduler's "save soon" warning (SIGUSR1 or SIGUSR2: SLURM ``--signal=USR1@N``, ``scancel
-s USR1``) kills a process that has no handler for it. The launcher imports click and its own
modules before it can install one (about 0.2 s, more on a loaded machine), so a warning that
landed then killed the job before any worker started. Here a do-nothing handler comes first,
then the launcher is imported; the agent later replaces the handler with its own, which passes
the warning on to the workers. What is left is the interpreter's own start, before any code of
meshrun's can run. A warning caught here is kept (`take_early`) and acted on by the agent once
its own handlers are in place: listed in ``--signals-to-handle``, it stops the job before any
worker starts; otherwise it is said as any warning that comes while no worker runs.

Not ``SIG_IGN``: an ignored signal stays ignored across ``exec``, so the workers would inherit
it and a script's own "save soon" handling would never see the warning.
"""

from __future__ import annotations

import signal

WARNINGS = (signal.SIGUSR1, signal.SIGUSR2)

_early: list[int] = []  # warnings caught before the agent's handler was in place


def _survive(signum, frame) -> None:
    """A warning before the agent's handler is in place: kept for the agent (`take_early`)."""
    _early.append(signum)


def take_early() -> list[int]:
    """The warnings caught here so far, in order, each once (the agent replays them)."""
    taken = _early[:]
    del _early[:len(taken)]
    return taken


def console_main() -> None:
    """The ``meshrun`` console script and ``python -m meshrun``: the warnings' handler, then
    `meshrun.launcher.cli.console_main`; never returns."""
    for warning in WARNINGS:
        signal.signal(warning, _survive)
    from meshrun.launcher.cli import console_main as launch

    launch()
