"""The per-node elastic agent: worker processes, their output, failures, and the run loop.

Public API: `Agent` (run one node's share of a job), `WorkerGroup`/`WorkerSpec` (the node's
worker processes), `WorkerFailure` and `format_report` (the failure report), `Reaper`.
"""

from meshrun.agent.agent import Agent, worker_env
from meshrun.agent.errors import WorkerFailure, format_report, root_cause
from meshrun.agent.reaper import Reaper
from meshrun.agent.workers import GroupResult, WorkerGroup, WorkerSpec, WorkerState
from meshrun.exits import ConfigError

__all__ = [
    "Agent",
    "ConfigError",
    "GroupResult",
    "Reaper",
    "WorkerFailure",
    "WorkerGroup",
    "WorkerSpec",
    "WorkerState",
    "format_report",
    "root_cause",
    "worker_env",
]
