"""The per-node elastic agent: worker processes, their output, failures, and the run loop.

Public API: `Agent` (run one node's share of a job), `LaunchConfig` (its input, which the
launcher builds), `WorkerGroup`/`WorkerSpec` (the node's worker processes), `WorkerFailure`
and `format_report` (the failure report), `Reaper`.

Names are imported on first use (PEP 562), so the launcher can build a `LaunchConfig` from
``meshrun.agent.config`` without loading the agent's run loop for ``--help`` or bad input.
"""

from importlib import import_module

_WHERE = {
    "Agent": "agent", "worker_env": "worker_env",
    "LaunchConfig": "config", "Std": "config", "StdSpec": "config",
    "WorkerFailure": "errors", "format_report": "errors", "root_cause": "errors",
    "Reaper": "reaper",
    "GroupResult": "workers", "WorkerGroup": "workers", "WorkerSpec": "workers",
    "WorkerState": "workers",
}  # fmt: skip
__all__ = sorted([*_WHERE, "ConfigError"])


def __getattr__(name: str):
    if name == "ConfigError":
        from meshrun.exits import ConfigError

        return ConfigError
    if name not in _WHERE:
        raise AttributeError(f"module 'meshrun.agent' has no attribute {name!r}")
    return getattr(import_module(f"meshrun.agent.{_WHERE[name]}"), name)


def __dir__() -> list[str]:
    return __all__
