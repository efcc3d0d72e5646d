"""The launch configuration: one frozen value that the agent runs from.

The agent owns this type (it is the agent's input); the launcher builds it, so every import
runs from launcher to agent, none back. `LaunchConfig` is what the CLI produces after merging, in order (later wins), a TOML config
file (``--config``), ``PET_*`` environment variables, and command-line options. Everything in
it is already validated: the agent never re-checks user input. Field names follow torchrun's
option names (``torch.distributed.run``), so a reader who knows torchrun knows this file.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field


class Std(enum.IntFlag):
    """Which of a worker's streams a ``-r/--redirects`` or ``-t/--tee`` value selects.

    Mirrors ``torch.distributed.elastic.multiprocessing.Std``: 0 none, 1 stdout, 2 stderr,
    3 both.
    """

    NONE = 0
    OUT = 1
    ERR = 2
    ALL = 3


@dataclass(frozen=True)
class StdSpec:
    """A ``-r``/``-t`` value: one `Std` for every local rank, or per-rank overrides.

    ``"3"`` -> ``StdSpec(Std.ALL)``; ``"0:1,1:2"`` -> ``StdSpec(Std.NONE, ((0, OUT), (1, ERR)))``
    (ranks not listed get ``default``), as torchrun parses it.
    """

    default: Std = Std.NONE
    per_rank: tuple[tuple[int, Std], ...] = ()

    def for_rank(self, local_rank: int) -> Std:
        """The streams selected for ``local_rank``."""
        for rank, std in self.per_rank:
            if rank == local_rank:
                return std
        return self.default


@dataclass(frozen=True)
class LaunchConfig:
    """Everything one agent needs to run its node's share of a job.

    Times are in seconds. ``entrypoint`` is the worker command before the script arguments:
    ``(python, "-u", script)``, ``(python, "-u", "-m", module)``, ``(script,)`` with
    ``--no-python``; ``args`` are the script's arguments, passed through untouched except that
    ``${local_rank}`` is substituted per worker by the agent.
    """

    # -- the job ---------------------------------------------------------------------------
    entrypoint: tuple[str, ...]
    args: tuple[str, ...] = ()
    run_path: bool = False
    role: str = "default"

    # -- size -------------------------------------------------------------------------------
    min_nodes: int = 1
    max_nodes: int = 1
    nproc_per_node: int = 1
    node_rank: int | None = None  # None: not given by the user

    # -- rendezvous ------------------------------------------------------------------------
    standalone: bool = False
    rdzv_backend: str = "static"  # "static" | "c10d" | "etcd"
    rdzv_endpoint: str = ""
    rdzv_id: str = "none"
    rdzv_conf: dict[str, str] = field(default_factory=dict)
    master_addr: str = "127.0.0.1"
    master_port: int | None = None  # None: OS-assigned where that is possible
    local_addr: str | None = None

    # -- restarts and supervision ------------------------------------------------------------
    max_restarts: int = 0
    monitor_interval: float = 0.1
    shutdown_timeout: float = 30.0
    signals_to_handle: tuple[int, ...] = ()  # signal numbers

    # -- output ----------------------------------------------------------------------------
    log_dir: str | None = None  # None: a temporary directory, kept only if the job failed
    redirects: StdSpec = StdSpec()
    tee: StdSpec = StdSpec()
    local_ranks_filter: frozenset[int] | None = None  # None: every local rank on the console
    duplicate_stdout_filters: tuple[str, ...] = ()
    duplicate_stderr_filters: tuple[str, ...] = ()
    log_line_prefix_template: str | None = None
    log_max_bytes: int | None = None  # meshrun's own; None: log files are never rotated

    # -- accepted for torchrun compatibility; see README "Options that do not apply" --------
    start_method: str = "spawn"
    event_log_handler: str = "null"
    logs_specs: str | None = None
    numa_binding: str | None = None
    virtual_local_rank: bool = False
    raw_console: bool = False

    # -- meshrun's own ---------------------------------------------------------------------
    hang_timeout: float | None = None
    desync_check: bool = False  # the agent compares the ranks' records (meshrun.agent.desync)
