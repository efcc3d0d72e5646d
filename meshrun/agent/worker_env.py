"""The environment of each worker, and the spec the agent starts it from.

The environment is the agent's own plus torchrun's contract (docs/design.md §3.1), with the
same names and meanings as torch's ``LocalElasticAgent._start_workers``, so a script written
for torchrun runs unchanged: ``torch.distributed.is_torchelastic_launched()`` is true and
``init_process_group("env://")`` connects to the round's workers' store as a client. What it
leaves out: the variables meshrun reads secrets from (`is_secret_env`), and what the agent
set for itself only (`meshrun.rendezvous.c10d.AGENT_ONLY_ENV`). What it adds: meshrun's
worker site first on PYTHONPATH (`WORKER_SITE`: the exit guard and the collective record), the
progress, record and in-place channel variables, and `MESHRUN_ROUND`.
"""

from __future__ import annotations

import os
import re
import signal
from pathlib import Path

from meshrun import exit_guard, in_place
from meshrun.agent.collectives import RECORD_ENV, record_env
from meshrun.agent.config import LaunchConfig, Std
from meshrun.agent.hang import progress_env
from meshrun.agent.workers import WorkerSpec
from meshrun.rendezvous import RendezvousInfo
from meshrun.rendezvous.c10d import AGENT_ONLY_ENV

# Variables meshrun reads secrets from (an etcd password= in PET_RDZV_CONF; meshrun's own
# *SECRET*/*PASSWORD*/*TOKEN* variables): never copied into a worker's environment. A torchrun
# script needs none of them (docs/design.md §3.1); the user's own variables pass through
# untouched.
SECRET_ENV = frozenset({"PET_RDZV_CONF"})
_SECRET_ENV_PATTERN = re.compile(r"MESHRUN_\w*(?:SECRET|PASSWORD|TOKEN)\w*")


def worker_spec(
    config: LaunchConfig, info: RendezvousInfo, local_rank: int, attempt_dir: Path, host: str
) -> WorkerSpec:
    """What the agent starts local rank ``local_rank`` of round ``info`` from: its argv
    (``${local_rank}`` substituted), environment (`worker_env` plus the channels' variables),
    log directory ``attempt_dir/<local_rank>``, which of its streams reach the console, and
    its console prefix (``[host:rank]: `` when several ranks share a console, or
    ``--log-line-prefix-template``)."""
    c = config
    rank = info.rank_offset + local_rank
    log_dir = attempt_dir / str(local_rank)
    env = worker_env(c, info, local_rank, error_file=log_dir / "error.json")
    env.update(progress_env(log_dir))
    env.update(record_env(log_dir))
    env.update(in_place.channel_env(log_dir))
    args = tuple(a.replace("${local_rank}", str(local_rank)) for a in c.args)
    shown = c.local_ranks_filter is None or local_rank in c.local_ranks_filter
    redirect, tee = c.redirects.for_rank(local_rank), c.tee.for_rank(local_rank)
    prefix = ""
    shared = (c.nproc_per_node > 1 or c.max_nodes > 1) and not c.raw_console
    if tee or shared:
        if c.log_line_prefix_template:
            prefix = _template_prefix(c.log_line_prefix_template, c.role, rank, local_rank)
        else:
            prefix = f"[{host}:{rank}]: "
    return WorkerSpec(
        local_rank=local_rank,
        global_rank=rank,
        argv=(*c.entrypoint, *args),
        env=env,
        log_dir=log_dir,
        console_out=shown and (not (redirect & Std.OUT) or bool(tee & Std.OUT)),
        console_err=shown and (not (redirect & Std.ERR) or bool(tee & Std.ERR)),
        prefix=prefix,
        host=host,
        node_rank=info.node_rank,
        log_max_bytes=c.log_max_bytes,
    )


def is_secret_env(name: str) -> bool:
    """Whether meshrun reads a secret from the environment variable ``name`` (`SECRET_ENV`,
    or a ``MESHRUN_*`` name with SECRET, PASSWORD or TOKEN in it); such a variable is kept out
    of the workers' environment."""
    return name in SECRET_ENV or _SECRET_ENV_PATTERN.fullmatch(name) is not None


def worker_env(
    config: LaunchConfig, info: RendezvousInfo, local_rank: int, *, error_file: Path
) -> dict[str, str]:
    """The environment of one worker: the agent's own, plus torchrun's contract (docs/design.md §3.1),
    less the variables meshrun reads secrets from (`is_secret_env`).

    Names and meanings are torchrun's (``LocalElasticAgent._start_workers``), so
    ``torch.distributed.is_torchelastic_launched()`` is true and ``init_process_group("env://")``
    connects to this round's bootstrap store as a client. ``TORCHELASTIC_RUN_ID`` is
    ``--rdzv-id`` as torchrun passes it (its handlers' ``get_run_id()``: ``none`` unless given,
    a fresh UUID for a standalone job), not the agent's own id of a one-node job (a random one
    for its log directory).
    """
    rank = info.rank_offset + local_rank
    env = {k: v for k, v in os.environ.items() if not is_secret_env(k)}
    for name, original in AGENT_ONLY_ENV.items():  # what the agent set for itself only
        if original is None:
            env.pop(name, None)
        else:
            env[name] = original
    env.update(
        RANK=str(rank),
        LOCAL_RANK=str(local_rank),
        WORLD_SIZE=str(info.world_size),
        LOCAL_WORLD_SIZE=str(info.local_world_size),
        GROUP_RANK=str(info.node_rank),
        GROUP_WORLD_SIZE=str(info.num_nodes),
        ROLE_NAME=config.role,
        ROLE_RANK=str(rank),
        ROLE_WORLD_SIZE=str(info.world_size),
        MASTER_ADDR=info.master_addr,
        MASTER_PORT=str(info.master_port),
        TORCHELASTIC_RESTART_COUNT=str(info.restart_count),
        TORCHELASTIC_MAX_RESTARTS=str(config.max_restarts),
        TORCHELASTIC_RUN_ID=config.rdzv_id,  # as torchrun: --rdzv-id as given
        TORCHELASTIC_USE_AGENT_STORE="True",
        # torchrun sets it in its own environment (launcher/api.py), so its workers inherit it;
        # torch's process contexts read it (SIGTERM,SIGINT,SIGHUP,SIGQUIT by default)
        TORCHELASTIC_SIGNALS_TO_HANDLE=",".join(
            signal.Signals(n).name for n in config.signals_to_handle
        ),
        TORCHELASTIC_ERROR_FILE=str(error_file),
        TORCH_NCCL_ASYNC_ERROR_HANDLING=os.environ.get("TORCH_NCCL_ASYNC_ERROR_HANDLING", "1"),
        MESHRUN_ROUND=str(info.round),
    )
    if "OMP_NUM_THREADS" not in os.environ and config.nproc_per_node > 1:
        env["OMP_NUM_THREADS"] = "1"
    # --desync-check is the agent's (meshrun.agent.desync): it reads the collective record
    # and sets nothing here (torch's DETAIL wrapper would hide the record's groups)
    # the exit guard (torch's teardown must not fail a finished script) and the collective
    # record start from the worker site
    if env.get(exit_guard.OFF_ENV) != "0" or env.get(RECORD_ENV) != "0":
        env["PYTHONPATH"] = os.pathsep.join([WORKER_SITE, *_path_entries(env.get("PYTHONPATH"))])
    if config.virtual_local_rank:
        visible = os.environ.get("CUDA_VISIBLE_DEVICES")
        devices = visible.split(",") if visible else [str(i) for i in range(config.nproc_per_node)]
        env["LOCAL_RANK"] = "0"
        env["CUDA_VISIBLE_DEVICES"] = devices[local_rank % len(devices)]
    return env


# Leads every worker's PYTHONPATH: its sitecustomize installs `meshrun.exit_guard` and starts
# the collective record (`meshrun.agent.collectives`), then runs the script's own
# sitecustomize, if any.
WORKER_SITE = str(Path(__file__).resolve().parent / "worker_site")


def _path_entries(pythonpath: str | None) -> list[str]:
    """The entries of a PYTHONPATH value, less the worker site (a nested meshrun's agent); an
    empty entry (the current directory) is kept."""
    if not pythonpath:
        return []
    return [p for p in pythonpath.split(os.pathsep) if p != WORKER_SITE]


def _template_prefix(template: str, role: str, rank: int, local_rank: int) -> str:
    from string import Template

    return Template(template).safe_substitute(role_name=role, rank=rank, local_rank=local_rank)
