"""``meshrun``: the command line. Parse, validate, then hand the config to the agent.

``main`` is the console script (``meshrun``) and ``python -m meshrun``. It dispatches
``meshrun COMMAND ...`` to a registered subcommand (`meshrun.launcher.subcommands`) unless the
first argument names an existing file, which is always the script. Otherwise it builds the
`LaunchConfig` (`meshrun.launcher.build.build_config`) and runs ``Agent(config).run()``.

Bad input never reaches the agent: it is one line on stderr,
``meshrun: error: --nnodes 3:2: MIN must not exceed MAX (got MIN=3, MAX=2); ...``, and exit
code 2, with nothing started and no file written. torch is imported only by the agent, after
parsing, so ``meshrun --help`` and bad input answer at once.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Sequence

import click

from meshrun.exits import EXIT_USAGE, ConfigError  # the launcher's and the agent's
from meshrun.launcher.build import build_config
from meshrun.launcher.errors import redact_secrets
from meshrun.launcher.stdio import finish_console, route_to_console, survive_closed_console
from meshrun.launcher.subcommands import SUBCOMMANDS


def main(argv: Sequence[str] | None = None) -> None:
    """Run ``meshrun`` with ``argv`` (default ``sys.argv[1:]``); never returns.

    Exits with the agent's exit code (docs/design.md §3.4), 0 after ``--help``/``--version``, and
    2 after one ``meshrun: error: ...`` line on stderr for bad input.
    """
    args = list(sys.argv[1:] if argv is None else argv)
    if args and args[0].replace("_", "-").split("=")[0] == "--print-completion":
        shell = args[0].split("=", 1)[1] if "=" in args[0] else (args[1] if len(args) > 1 else "")
        sys.exit(print_completion(shell))
    if args and args[0] in SUBCOMMANDS and not os.path.exists(args[0]):
        sys.exit(run_subcommand(args[0], args[1:]))
    try:
        config = build_config(args, os.environ)
    except click.exceptions.Exit as e:  # after --help or --version
        sys.exit(e.exit_code)
    except ConfigError as e:
        fail(str(e))

    from meshrun.agent import Agent

    try:
        agent = Agent(config)  # checks what only the agent knows (rendezvous settings)
    except ConfigError as e:
        fail(str(e))
    route_to_console()  # the agent's Python output (warnings, logging) never blocks it
    sys.exit(agent.run())


def console_main() -> None:
    """The ``meshrun`` console script and ``python -m meshrun``: `main`, then a quick exit.

    Once the agent has returned, every worker is stopped, every log closed and the store
    released; what is left is the interpreter's teardown of torch (about 0.4 s here), which a
    user waiting on a stopped job should not pay. So stdio is flushed and the process leaves
    with ``os._exit``. A console that goes away (``meshrun ... | head``) is survived
    (`meshrun.launcher.stdio`): the job runs on, and the exit code stays the job's; one that
    blocks (a pipe nobody reads) never holds the agent: while it runs, its Python output goes
    through the console's queue (`route_to_console`), flushed at the exit with a bound. A
    scheduler's warning (SIGUSR1/2) during start-up is survived: `meshrun._console`, the
    console script's entry, put a handler in place before this module was imported.
    """
    survive_closed_console()
    try:
        main()
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
        if e.code is not None and not isinstance(e.code, int):
            print(e.code, file=sys.stderr)
    else:
        code = 0
    finish_console()  # what the agent's console still has queued, bounded
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def print_completion(shell: str) -> int:
    """``meshrun --print-completion SHELL`` (torchrun 2.14's option): click's completion script
    for meshrun on stdout, exit 0; one line and exit 2 for a shell click does not complete."""
    from click.shell_completion import get_completion_class

    from meshrun.launcher.options import make_command

    cls = get_completion_class(shell) if shell in ("bash", "zsh") else None
    if cls is None:
        click.echo(f"meshrun: error: --print-completion {shell or '(none)'}: meshrun completes "
                   "bash and zsh; give one of them", err=True)  # fmt: skip
        return EXIT_USAGE
    click.echo(cls(make_command(), {}, "meshrun", "_MESHRUN_COMPLETE").source())
    return 0


def run_subcommand(name: str, args: list[str]) -> int:
    """Run the registered subcommand ``name`` with ``args``; return its exit code.

    Its usage errors are reduced to one ``meshrun NAME: error: ...`` line and exit code 2,
    like the launcher's own.
    """
    command = SUBCOMMANDS[name]
    try:
        result = command.main(args=args, prog_name=f"meshrun {name}", standalone_mode=False)
    except click.exceptions.Exit as e:
        return e.exit_code
    except click.Abort:
        return 130
    except click.UsageError as e:
        click.echo(f"meshrun {name}: error: {' '.join(e.format_message().split())}", err=True)
        return EXIT_USAGE
    except ConfigError as e:
        click.echo(f"meshrun {name}: error: {e}", err=True)
        return EXIT_USAGE
    return result if isinstance(result, int) else 0


def fail(message: str) -> None:
    """Print ``meshrun: error: <message>`` as one line on stderr and exit with code 2."""
    click.echo(f"meshrun: error: {redact_secrets(' '.join(message.split()))}", err=True)
    sys.exit(EXIT_USAGE)
