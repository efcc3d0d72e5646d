"""The registry of ``meshrun COMMAND ...`` subcommands (``meshrun status``, ...).

``meshrun.launcher.cli.main`` dispatches to ``SUBCOMMANDS[argv[0]]`` when the first argument
is a registered name *and* does not name an existing file (a file is always the script, so a
script called ``status`` still runs). A subcommand is a `click.Command`; register it here:

    from meshrun.launcher.status import status   # a click.Command
    SUBCOMMANDS["status"] = status

Registered: ``status`` (`meshrun.launcher.status`), ``stacks`` (`meshrun.launcher.stacks`),
``timeline`` (`meshrun.launcher.timeline`).
"""

from __future__ import annotations

import click

from meshrun.launcher.stacks import stacks
from meshrun.launcher.status import status
from meshrun.launcher.timeline import timeline

SUBCOMMANDS: dict[str, click.Command] = {
    "stacks": stacks,
    "status": status,
    "timeline": timeline,
}
