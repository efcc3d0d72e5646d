"""meshrun's exit codes (docs/design.md §3.4) and its configuration error, in one leaf module.

Every layer ends with one of these codes: the agent (a run's outcome), the launcher (bad
input), ``meshrun status`` and ``meshrun stacks``. The module imports nothing, so the launcher,
the agent and the rendezvous can all use it without an upward import, and without importing
the agent's package.

- 0 success; the root-cause worker's exit code when workers failed;
- 1 ``meshrun status`` / ``meshrun stacks``: no such job in the store;
- 2 usage or config error, nothing was started (`ConfigError`);
- 3 rendezvous or store failure (join timeout, fewer than MIN nodes, store lost, etcd auth or
  TLS refused);
- 124 the group was stopped as hung;
- 128+N the agent itself was stopped by signal N.

Which of them make a retry worth it (3, 124, 143 from SIGTERM) is in docs/slurm.md, and
acted on by ``configs/slurm_job.sh`` (it requeues the job only for those).
"""

EXIT_OK = 0
EXIT_NO_JOB = 1
EXIT_USAGE = 2
EXIT_RENDEZVOUS = 3
EXIT_HUNG = 124


class ConfigError(ValueError):
    """A configuration meshrun cannot run: exit 2, before anything was started.

    The launcher raises its subclass `meshrun.launcher.errors.ConfigError` for bad user input
    (one line, secrets hidden); the agent raises this for what only it can check.
    """


__all__ = ["EXIT_HUNG", "EXIT_NO_JOB", "EXIT_OK", "EXIT_RENDEZVOUS", "EXIT_USAGE", "ConfigError"]
