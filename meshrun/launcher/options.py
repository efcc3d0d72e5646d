"""The option table: every torchrun option (torch 2.13's ``get_args_parser()``) plus meshrun's.

One `OptionSpec` per option, as data: its spellings (dash and underscore, as torchrun), its
default as the string torchrun would parse, the ``PET_*`` and other environment variables
that stand in for it, and its help. `make_command` turns the table into the click command
that reads the command line; the same table drives the merge with the config file and the
environment (`meshrun.launcher.build`) and the ``--help`` page, so the three never disagree.

Option parsing stops at the first argument that is not an option: that is the script, and
everything after it belongs to the script, even ``--nnodes 5``.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import click

import meshrun
from meshrun.launcher.subcommands import SUBCOMMANDS


@dataclass(frozen=True)
class OptionSpec:
    """One command-line option.

    ``name`` is the field-like name (torchrun's argparse ``dest``); ``flags`` the spellings
    torchrun accepts, dash form first; ``default`` the value used when no source gives one
    (a string, as on the command line; a bool for flags; ``None`` for "not given").
    ``env`` are environment variables that stand in for the option, lowest priority first;
    every one of them beats the config file and loses to the command line.
    """

    name: str
    flags: tuple[str, ...]
    group: str
    help: str
    default: str | bool | None = None
    is_flag: bool = False
    env: tuple[str, ...] = ()
    metavar: str | None = None

    @property
    def label(self) -> str:
        """The spelling used in messages: the long dash form (``--nproc-per-node``)."""
        return next(f for f in self.flags if f.startswith("--"))


def _pet(name: str) -> tuple[str, ...]:
    return (f"PET_{name.upper()}",)


SIZE = "Job size"
RDZV = "Rendezvous"
COMMAND = "Worker command"
SUPERVISION = "Restarts and supervision"
OUTPUT = "Output and logs"
NO_EFFECT = "Accepted for torchrun compatibility, no effect in meshrun"
GENERAL = "General"


def _opt(name: str, *flags: str, group: str, help: str, pet: bool = True, **kw) -> OptionSpec:
    if not flags:
        dash = "--" + name.replace("_", "-")
        flags = (dash, "--" + name) if "_" in name else (dash,)
    env = kw.pop("env", ())
    return OptionSpec(name, flags, group, help, env=env + (_pet(name) if pet else ()), **kw)


OPTIONS: tuple[OptionSpec, ...] = (
    # -- size -------------------------------------------------------------------------------
    _opt("nnodes", group=SIZE, default="1:1", metavar="N|MIN:MAX",
         help="Number of nodes, or a MIN:MAX range for an elastic job."),
    _opt("nproc_per_node", group=SIZE, default="1", metavar="N|cpu|gpu|auto",
         help="Workers per node: a number, cpu (one per CPU), gpu (one per GPU) or auto "
              "(GPUs if any, else CPUs)."),
    _opt("node_rank", group=SIZE, metavar="RANK",
         help="This node's rank, for the static rendezvous. Default: decided by the "
              "rendezvous (0 on a single node)."),
    # -- rendezvous -------------------------------------------------------------------------
    _opt("standalone", group=RDZV, is_flag=True, default=False,
         help="Single-node job with its own rendezvous on a free port (c10d on localhost, a "
              "random id); --rdzv-backend/-endpoint/-id are ignored. Implied for a "
              "one-node job that gives no --rdzv-endpoint and no --master-port."),
    _opt("rdzv_backend", group=RDZV, default="static", metavar="NAME",
         help="static, c10d (a TCPStore hosted by one agent) or etcd (etcd v3; etcd-v3 "
              "is read as etcd)."),
    _opt("rdzv_endpoint", group=RDZV, default="", metavar="HOST[:PORT]",
         help="Where the rendezvous store is: the c10d host, or the etcd server."),
    _opt("rdzv_id", group=RDZV, default="none", metavar="ID",
         help="Job id: the nodes of one job give the same id."),
    _opt("rdzv_conf", group=RDZV, default="", metavar="K=V,...",
         help="Rendezvous settings, e.g. join_timeout=600,last_call_timeout=30. "
              "timeout= is read as torch's backend reads it (etcd, static: join_timeout; "
              "c10d: ignored), with a note. bind_all=true: the stores this node hosts listen "
              "on every interface (default: the endpoint's or advertised address only). "
              "secret_file=PATH: a shared secret sealing every rendezvous value. "
              "workers_port=N: the workers' store on a fixed port. All keys: docs/rendezvous.md."),
    _opt("master_addr", group=RDZV, default="127.0.0.1", metavar="HOST",
         help="Address of node rank 0, for the static rendezvous."),
    _opt("master_port", group=RDZV, metavar="PORT",
         help="Port on node rank 0, for the static rendezvous. Default: chosen by the OS "
              "where that is possible."),
    _opt("local_addr", group=RDZV, metavar="HOST",
         help="This node's address as the others should reach it. Default: looked up."),
    # -- worker command ---------------------------------------------------------------------
    _opt("module", "-m", "--module", group=COMMAND, is_flag=True, default=False,
         help="SCRIPT is a module name, run as python -m MODULE."),
    _opt("no_python", group=COMMAND, is_flag=True, default=False,
         help="SCRIPT is a program run as is, not a Python script."),
    _opt("run_path", group=COMMAND, is_flag=True, default=False,
         help="Run SCRIPT with runpy.run_path. meshrun runs every worker in a fresh "
              "interpreter either way, so the result is the same as without it."),
    _opt("role", group=COMMAND, default="default", metavar="NAME",
         help="Role name of the workers (ROLE_NAME)."),
    _opt("virtual_local_rank", group=COMMAND, is_flag=True, default=False,
         help="Give every worker LOCAL_RANK=0 and only its own GPU in CUDA_VISIBLE_DEVICES."),
    # -- supervision ------------------------------------------------------------------------
    _opt("max_restarts", group=SUPERVISION, default="0", metavar="N",
         help="Worker-group restarts after failures, for the whole job."),
    _opt("monitor_interval", group=SUPERVISION, default="0.1", metavar="SECONDS",
         help="How often the agent checks its workers."),
    _opt("shutdown_timeout", group=SUPERVISION, metavar="SECONDS",
         env=("TORCH_ELASTIC_SHUTDOWN_TIMEOUT",),
         help="Grace period between SIGTERM and SIGKILL when stopping workers. Default: "
              "TORCH_ELASTIC_SHUTDOWN_TIMEOUT, else 30."),
    _opt("signals_to_handle", group=SUPERVISION, default="SIGTERM,SIGINT,SIGHUP,SIGQUIT",
         metavar="SIG,...",
         help="Signals the agent forwards to its workers before exiting 128+N."),
    _opt("hang_timeout", group=SUPERVISION, pet=False, metavar="SECONDS",
         help="meshrun's own: stop the group as hung (exit 124) when no worker has made "
              "progress for this long. Default: off."),
    _opt("desync_check", group=SUPERVISION, pet=False, is_flag=True, default=False,
         env=("MESHRUN_DESYNC_CHECK",),
         help="meshrun's own: the agent compares the ranks' collective records (call "
              "number, op, shapes, dtypes), so a rank that calls another collective, or one "
              "of another shape, stops the job within seconds, naming both calls (exit 1), "
              "instead of hanging; a skipped or extra call is named by its offset at a hang "
              "or when a rank finishes. Adds nothing to the workers' collectives. Default: "
              "off."),
    # -- output -----------------------------------------------------------------------------
    _opt("log_dir", group=OUTPUT, metavar="DIR",
         help="Where per-rank logs go (<run id>/<host>_<agent pid>/attempt_<round>/<local rank>/). Default: a temporary "
              "directory, kept only if the job failed."),
    _opt("redirects", "-r", "--redirects", group=OUTPUT, default="0", metavar="STD",
         help="Send worker streams to the log files only: 0 none, 1 stdout, 2 stderr, "
              "3 both, or per local rank as 0:1,1:2."),
    _opt("tee", "-t", "--tee", group=OUTPUT, default="0", metavar="STD",
         help="Send worker streams to the log files and the console (same values as -r)."),
    _opt("local_ranks_filter", group=OUTPUT, default="", metavar="RANK,...",
         help="Show only these local ranks on the console, e.g. 0,2. Default: all."),
    _opt("duplicate_stdout_filters", group=OUTPUT, default="", metavar="TEXT,...",
         help="Also copy stdout lines containing any of these texts to a separate file "
              "(,, escapes a comma)."),
    _opt("duplicate_stderr_filters", group=OUTPUT, default="", metavar="TEXT,...",
         help="The same for stderr."),
    _opt("log_max_bytes", group=OUTPUT, metavar="BYTES",
         help="meshrun's own: rotate each rank's stdout.log and stderr.log before it passes "
              "this size (e.g. 100M; K, M, G are powers of 1024), keeping 3 older files "
              "(.1 the newest). Default: no rotation."),
    _opt("log_line_prefix_template", group=OUTPUT, pet=False, metavar="TEMPLATE",
         env=("PET_LOG_LINE_PREFIX_TEMPLATE", "TORCHELASTIC_LOG_LINE_PREFIX_TEMPLATE"),  # torch 2.14: PET_
         help="Prefix of console lines, e.g. '[${role_name}${rank}]:' (${role_name}, "
              "${rank}, ${local_rank}). Default: TORCHELASTIC_LOG_LINE_PREFIX_TEMPLATE, "
              "else [host:rank]."),
    _opt("raw_console", group=OUTPUT, is_flag=True, default=False,
         help="Console lines exactly as the workers wrote them (torchrun's default). "
              "Default: each line starts with [host:rank] when several ranks may share the "
              "console (more than one worker per node, or more than one node)."),
    _opt("event_log_handler", group=OUTPUT, default="null", metavar="null|console",
         help="Every agent writes its events (rounds, workers, failures, restarts, hangs, "
              "stragglers) to events.jsonl in its log directory, for 'meshrun timeline'; "
              "console also prints each on stderr."),
    # -- no effect --------------------------------------------------------------------------
    _opt("print_completion", group=OUTPUT, pet=False, metavar="bash|zsh",
         help="Print a shell completion script for meshrun to stdout and exit (bash, zsh; "
              "give it first: meshrun --print-completion zsh > ~/.zsh/completions/_meshrun)."),
    _opt("start_method", group=NO_EFFECT, default="spawn", metavar="spawn|fork|forkserver",
         help="Workers are always fresh processes."),
    _opt("logs_specs", group=NO_EFFECT, pet=False, metavar="NAME",
         help="torchrun's LogsSpecs plugin name."),
    _opt("numa_binding", group=NO_EFFECT, pet=False, metavar="MODE",
         help="node, socket, exclusive or core-complex; workers are not bound."),
)

BY_NAME: dict[str, OptionSpec] = {spec.name: spec for spec in OPTIONS}

START_METHODS = ("spawn", "fork", "forkserver")
NUMA_MODES = ("node", "socket", "exclusive", "core-complex")

HELP = """Start the workers of one node of a PyTorch job, as torchrun does.

\b
  meshrun --nproc-per-node 4 train.py --lr 3e-4
  meshrun --nnodes 2 --node-rank 0 --master-addr host0 --master-port 29500 train.py
  meshrun --nnodes 1:4 --rdzv-backend c10d --rdzv-endpoint host0:29400 --rdzv-id job1 train.py
  meshrun --config configs/elastic_c10d.toml train.py

Options go before SCRIPT; everything after SCRIPT is passed to it untouched (${local_rank}
is replaced by each worker's local rank). Every option also takes its underscore spelling
(--nproc_per_node) and an unambiguous prefix (--redirect=3), and a PET_<NAME> environment
variable (PET_NPROC_PER_NODE) stands in for it as in torchrun. Precedence: --config file < environment < command line.
"""


class _Command(click.Command):
    """A click command whose help lists the options by group, dash spellings only."""

    def collect_usage_pieces(self, ctx: click.Context) -> list[str]:
        return ["[OPTIONS]", "SCRIPT", "[ARGS]..."]

    def format_options(self, ctx: click.Context, formatter: click.HelpFormatter) -> None:
        groups: dict[str, list[tuple[str, str]]] = {}
        for spec in OPTIONS:
            groups.setdefault(spec.group, []).append(_help_record(spec))
        groups.setdefault(GENERAL, []).extend(
            [
                ("--config FILE.toml",
                 "Read options from a TOML file: keys are option names (nproc_per_node = 4)."),
                ("--version", "Print meshrun's version and exit."),
                ("-h, --help", "Print this help and exit."),
            ]
        )
        # One first-column width for every section, so the help reads as one table.
        width = min(_TERM_MAX, max(len(t) for rs in groups.values() for t, _ in rs))
        for group, records in groups.items():
            with formatter.section(group):
                formatter.write_dl([(t.ljust(width), h) for t, h in records], col_max=width)

    def format_epilog(self, ctx: click.Context, formatter: click.HelpFormatter) -> None:
        if SUBCOMMANDS:
            with formatter.section("Commands (meshrun COMMAND --help)"):
                formatter.write_dl(
                    [(n, (c.get_short_help_str() or "")) for n, c in SUBCOMMANDS.items()]
                )
        formatter.write_paragraph()
        formatter.write_text(
            "Exit codes: 0 success; the failed worker's exit code; 2 bad usage (nothing "
            "started); 3 rendezvous failure; 124 hung; 128+N stopped by signal N."
        )


_TERM_MAX = 30


def _help_record(spec: OptionSpec) -> tuple[str, str]:
    shown = ", ".join(f for f in spec.flags if not (f.startswith("--") and "_" in f))
    if not spec.is_flag:
        shown += f" {spec.metavar or 'VALUE'}"
    extras = []
    if spec.default not in (None, "", False):
        extras.append(f"default: {spec.default}")
    if spec.env:
        extras.append("env: " + ", ".join(reversed(spec.env)))
    text = spec.help + (f"  [{'; '.join(extras)}]" if extras else "")
    return shown, text


class AmbiguousOption(click.BadOptionUsage):
    """A long-option prefix that several options start with (``--master``); the message lists
    them, one spelling each (``could be --master-addr, --master-port``)."""


def prefix_resolver(
    params: list[click.Parameter], help_names: tuple[str, ...] = ()
) -> Callable[[str], str]:
    """click's ``token_normalize_func`` for ``params``: a long option's unambiguous prefix read
    as the option, as torchrun's argparse reads it (``allow_abbrev``): ``--redirect=3`` is
    ``--redirects 3``, ``--nproc-per 2`` is ``--nproc-per-node 2``.

    ``help_names`` are the help option's spellings (click adds that option to ``params`` only
    when it parses). click calls it with an option's name without its dashes, for the options
    it registers and
    for every option token of the command line (never the script's arguments: parsing stops at
    SCRIPT). An exact name is itself; a one-letter name too (``-m``, ``-r``: short options,
    never a prefix). A prefix that spellings of one option share (``--nproc``: ``--nproc-per-node``
    and ``--nproc_per_node``) is that option, where Python 3.11's argparse calls it ambiguous;
    a prefix of several options raises `AmbiguousOption` (exit 2, one line); anything else is
    left to click's "no such option".
    """
    owner: dict[str, str] = {}  # long name without dashes -> its option's dest
    first: dict[str, str] = {}  # dest -> its first long spelling, for messages
    spellings = [(p.name or "", opt) for p in params for opt in getattr(p, "opts", [])]
    spellings += [("help", opt) for opt in help_names]
    for dest, opt in spellings:
        if opt.startswith("--"):
            owner[opt[2:]] = dest or opt
            first.setdefault(dest or opt, opt)

    def resolve(name: str) -> str:
        if name in owner or len(name) < 2:
            return name
        matches = [n for n in owner if n.startswith(name)]
        options = list(dict.fromkeys(owner[n] for n in matches))
        if len(options) == 1:
            return matches[0]
        if len(options) > 1:
            raise AmbiguousOption(
                f"--{name}", f"ambiguous option: could be {', '.join(first[o] for o in options)}"
            )
        return name

    return resolve


def make_command() -> click.Command:
    """The click command for ``meshrun [OPTIONS] SCRIPT [ARGS]...``.

    Its callback returns ``ctx`` untouched, so a caller can use ``make_context`` and read
    ``ctx.params`` and ``ctx.get_parameter_source(name)``. Every option value stays a string
    (flags a bool): `meshrun.launcher.build` parses them, the same way for every source. A long
    option may be given by an unambiguous prefix, as torchrun's argparse allows
    (`prefix_resolver`).
    """
    params: list[click.Parameter] = []
    for spec in OPTIONS:
        params.append(
            click.Option(
                [*spec.flags, spec.name],
                is_flag=spec.is_flag,
                default=spec.default if spec.is_flag else None,
                type=None if spec.is_flag else click.UNPROCESSED,
                metavar=spec.metavar,
                help=spec.help,
            )
        )
    params += [
        click.Option(["--config", "config"], type=click.UNPROCESSED, metavar="FILE.toml"),
        click.Argument(["script"], required=False, type=click.UNPROCESSED),
        click.Argument(["args"], nargs=-1, type=click.UNPROCESSED),
    ]
    resolve: list[Callable[[str], str]] = []  # set below, once --version exists
    help_names = ("-h", "--help")
    command = _Command(
        "meshrun",
        params=params,
        help=HELP,
        context_settings={
            "allow_interspersed_args": False,
            "help_option_names": list(help_names),
            "max_content_width": 100,
            "token_normalize_func": lambda name: resolve[0](name),
        },
    )
    click.version_option(meshrun.__version__, "--version", prog_name="meshrun")(command)
    resolve.append(prefix_resolver(command.params, help_names))
    return command
