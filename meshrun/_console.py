"""The ``meshrun`` command's first lines, before anything else of meshrun is imported.

A scheduler's "save soon" warning (SIGUSR1 or SIGUSR2: SLURM ``--signal=USR1@N``, ``scancel
-s USR1``) kills a process that has no handler for it. The launcher imports click and its own
modules before it can install one (about 0.2 s, more on a loaded machine), so a warning that
landed then killed the job before any worker started. Here a do-nothing handler comes first,
then the launcher is imported; the agent later replaces the handler with its own, which passes
the warning on to the workers. What is left is the interpreter's own start, before any code of
meshrun's can run.

Not ``SIG_IGN``: an ignored signal stays ignored across ``exec``, so the workers would inherit
it and a script's own "save soon" handling would never see the warning.
"""

from __future__ import annotations

import signal

WARNINGS = (signal.SIGUSR1, signal.SIGUSR2)


def _survive(signum, frame) -> None:
    """A warning before the agent's handler is in place: nothing to pass on yet."""


def console_main() -> None:
    """The ``meshrun`` console script and ``python -m meshrun``: the warnings' handler, then
    `meshrun.launcher.cli.console_main`; never returns."""
    for warning in WARNINGS:
        signal.signal(warning, _survive)
    from meshrun.launcher.cli import console_main as launch

    launch()
