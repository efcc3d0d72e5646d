"""argv + environment (+ a TOML file) -> one validated `LaunchConfig`.

The merge, per option, later wins: the option's default (torchrun's), the ``--config`` file,
environment variables (``PET_<NAME>`` as torchrun's ``env``/``check_env`` actions, plus
``TORCH_ELASTIC_SHUTDOWN_TIMEOUT`` and ``TORCHELASTIC_LOG_LINE_PREFIX_TEMPLATE``), then the
command line. An empty environment variable counts as unset. Each value is then parsed by
`meshrun.launcher.values`, and the cross-option rules of ``torch.distributed.run`` applied:

- standalone: ``--standalone``, or a one-node static job with no ``--rdzv-endpoint`` and no
  ``--master-port`` (torchrun does the same since 2.4, so two jobs on one host never collide),
  gives ``standalone=True``, backend ``c10d``, endpoint ``localhost:0`` and a random run id;
  the agent then hosts an in-process store on an OS-assigned port.
- SLURM: under ``srun`` with one meshrun per node and no ``--rdzv-endpoint``, the node count,
  node rank and c10d endpoint (the first node, a port of the job's own; node 0 hosts) come
  from the SLURM environment (`meshrun.launcher.slurm`).
- static: a fixed node count; ``--nnodes MIN:MAX`` with MIN < MAX needs an elastic backend
  (torchrun's static rendezvous would wait for MAX nodes, meshrun says so instead).
- entrypoint: ``(python, "-u", script)``, ``(python, "-u", "-m", module)`` or ``(script,)``
  with ``--no-python``; ``python`` is ``$PYTHON_EXEC`` if set (as torchrun), else
  ``sys.executable``. ``--run-path`` keeps ``(python, "-u", script)`` and sets
  ``run_path=True``: meshrun always runs workers in a fresh interpreter, which is what
  ``runpy.run_path`` in torchrun's own worker process amounts to.

Nothing here imports torch, starts a process other than ``nvidia-smi`` (for ``gpu``/``auto``
without ``CUDA_VISIBLE_DEVICES``), or writes a file.
"""

from __future__ import annotations

import os
import shutil
import sys
import uuid
from collections.abc import Callable, Mapping, Sequence
from typing import TypeVar

import click
from click.core import ParameterSource

from meshrun.agent.config import LaunchConfig
from meshrun.launcher import values as v
from meshrun.launcher.configfile import RawValue, load_config_file
from meshrun.launcher.errors import ConfigError, ValueProblem
from meshrun.launcher.options import BY_NAME, NUMA_MODES, OPTIONS, START_METHODS, make_command
from meshrun.launcher.slurm import SlurmDefaults, slurm_defaults

T = TypeVar("T")

USAGE_HINT = "usage: meshrun [OPTIONS] SCRIPT [ARGS]... (see meshrun --help)"


def build_config(argv: Sequence[str], env: Mapping[str, str]) -> LaunchConfig:
    """Parse ``argv`` (without the program name) and ``env`` into a validated `LaunchConfig`.

    Notes about values read under another name (``--rdzv-conf timeout=``) are printed on
    stderr, one line each, once everything is valid.

    Raises `ConfigError` (one line: where, value, problem, fix) on any bad input, and lets
    ``click.exceptions.Exit`` through after printing ``--help`` or ``--version``.
    """
    config, notes = build_config_and_notes(argv, env)
    for note in notes:
        click.echo(note, err=True)
    return config


def build_config_and_notes(
    argv: Sequence[str], env: Mapping[str, str]
) -> tuple[LaunchConfig, list[str]]:
    """`build_config` without printing: returns the config and the note lines to print."""
    ctx = _parse_command_line(argv)
    script, script_args = ctx.params["script"], tuple(ctx.params["args"])
    if script is None:
        raise ConfigError(f"missing SCRIPT, the training script to run; {USAGE_HINT}")

    raw = _merge(ctx, env)
    notes: list[str] = []

    def get(name: str, parse: Callable[[str], T]) -> T:
        item = raw[name]
        try:
            return parse(item.value)  # type: ignore[arg-type]
        except ValueProblem as problem:
            raise problem.at(item.where) from None

    def given(name: str) -> bool:
        return raw[name].value is not None

    def flag(name: str) -> bool:
        return bool(raw[name].value)

    # -- size ---------------------------------------------------------------------------
    min_nodes, max_nodes = get("nnodes", v.parse_nnodes)
    nproc_per_node = get("nproc_per_node", lambda s: v.parse_nproc_per_node(s, env))
    node_rank = get("node_rank", lambda s: v.parse_int(s, 0)) if given("node_rank") else None
    if node_rank is not None and node_rank >= max_nodes:
        raise ConfigError(
            f"{raw['node_rank'].where}: node rank must be below the number of nodes "
            f"(got node rank {node_rank}, {max_nodes} node(s)); give 0..{max_nodes - 1}, "
            "or more nodes with --nnodes"
        )

    # -- rendezvous ---------------------------------------------------------------------
    rdzv_backend = get("rdzv_backend", v.parse_rdzv_backend)
    if note := v.backend_note(str(raw["rdzv_backend"].value)):
        notes.append(note)
    master_port = (
        get("master_port", lambda s: v.parse_int(s, 0, 65535)) if given("master_port") else None
    )
    rdzv_endpoint = str(raw["rdzv_endpoint"].value).strip()
    rdzv_id = get("rdzv_id", v.parse_rdzv_id)

    slurm = None if rdzv_endpoint or flag("standalone") else _slurm(env)
    if slurm is not None and slurm.num_nodes > 1:
        if raw["nnodes"].where.endswith("(default)"):
            min_nodes = max_nodes = slurm.num_nodes
        if node_rank is None:
            node_rank = slurm.node_rank
        if rdzv_backend == "static":
            rdzv_backend = "c10d"
        rdzv_endpoint = f"{slurm.first_host}:{slurm.port}"
        if rdzv_id == "none":
            rdzv_id = f"slurm-{slurm.job_id}"
        notes.append(slurm.note())

    standalone = flag("standalone") or (
        rdzv_backend == "static" and not rdzv_endpoint and master_port is None and max_nodes == 1
    )
    if standalone:
        if max_nodes > 1:
            raise ConfigError(
                f"{raw['standalone'].where} with {raw['nnodes'].where}: a standalone job "
                "runs on one node; drop --standalone, or use --nnodes 1"
            )
        rdzv_backend, rdzv_endpoint, rdzv_id = "c10d", "localhost:0", str(uuid.uuid4())
        master_port = None
    # read as torch's backend of that name would (timeout=); etcd-v2 is etcd here, not there
    given_backend = str(raw["rdzv_backend"].value).strip().lower()
    torch_backend = "etcd-v2" if rdzv_backend == "etcd" and given_backend == "etcd-v2" else rdzv_backend
    rdzv_conf, conf_notes = get("rdzv_conf", lambda s: v.parse_rdzv_conf(s, torch_backend))
    notes += conf_notes
    if slurm is not None and slurm.num_nodes > 1:
        # node 0 of the step hosts; a port taken by another job is an error there, not a store
        # to join (the tasks of a job array share nodes: `meshrun.launcher.slurm`)
        rdzv_conf.setdefault("is_host", "true" if slurm.node_rank == 0 else "false")
    if max_nodes > 1 and rdzv_backend in ("c10d", "etcd") and _port(rdzv_endpoint) == "0":
        raise ConfigError(
            f"{raw['rdzv_endpoint'].where}: port 0 for a job of up to {max_nodes} nodes; the "
            "other nodes could not find an OS-chosen port: give the port they will use, e.g. "
            "HOST:29400"
        )
    if rdzv_backend == "static" and min_nodes != max_nodes:
        # torchrun's static rendezvous waits for MAX nodes; an elastic range there is a mistake
        raise ConfigError(
            f"{raw['nnodes'].where}: the static rendezvous has a fixed node count (got MIN="
            f"{min_nodes}, MAX={max_nodes}); give --nnodes N, or add --rdzv-backend c10d "
            "--rdzv-endpoint HOST:PORT (or etcd) for an elastic range"
        )

    # -- the worker command -------------------------------------------------------------
    module, no_python, run_path = flag("module"), flag("no_python"), flag("run_path")
    entrypoint = _entrypoint(script, module, no_python, run_path, raw, env)

    # -- supervision and output ---------------------------------------------------------
    shutdown_timeout = (
        get("shutdown_timeout", lambda s: v.parse_seconds(s, allow_zero=True))
        if given("shutdown_timeout")
        else 30.0
    )
    hang_timeout = get("hang_timeout", v.parse_seconds) if given("hang_timeout") else None
    log_dir = str(raw["log_dir"].value) if given("log_dir") and raw["log_dir"].value else None
    if log_dir is not None and os.path.exists(log_dir) and not os.path.isdir(log_dir):
        raise ConfigError(
            f"{raw['log_dir'].where}: names a file, not a directory; give a directory (it is "
            "created if missing)"
        )
    local_ranks_filter = get("local_ranks_filter", v.parse_local_ranks_filter)
    if local_ranks_filter is not None and min(local_ranks_filter) >= nproc_per_node:
        raise ConfigError(
            f"{raw['local_ranks_filter'].where}: names no local rank of this node (local ranks "
            f"are 0..{nproc_per_node - 1}); give some of them, or leave the option out"
        )
    prefix = raw["log_line_prefix_template"].value

    config = LaunchConfig(
        entrypoint=entrypoint,
        args=script_args,
        run_path=run_path,
        role=str(raw["role"].value),
        min_nodes=min_nodes,
        max_nodes=max_nodes,
        nproc_per_node=nproc_per_node,
        node_rank=node_rank,
        standalone=standalone,
        rdzv_backend=rdzv_backend,
        rdzv_endpoint=rdzv_endpoint,
        rdzv_id=rdzv_id,
        rdzv_conf=rdzv_conf,
        master_addr=str(raw["master_addr"].value),
        master_port=master_port,
        local_addr=str(raw["local_addr"].value) if given("local_addr") else None,
        max_restarts=get("max_restarts", lambda s: v.parse_int(s, 0)),
        monitor_interval=get(
            "monitor_interval", lambda s: v.parse_seconds(s, minimum=v.MIN_MONITOR_INTERVAL)
        ),
        shutdown_timeout=shutdown_timeout,
        signals_to_handle=get("signals_to_handle", v.parse_signals),
        log_dir=log_dir,
        redirects=get("redirects", v.parse_std_spec),
        tee=get("tee", v.parse_std_spec),
        local_ranks_filter=local_ranks_filter,
        duplicate_stdout_filters=get("duplicate_stdout_filters", v.parse_filters),
        duplicate_stderr_filters=get("duplicate_stderr_filters", v.parse_filters),
        log_line_prefix_template=str(prefix) if prefix else None,
        log_max_bytes=get("log_max_bytes", v.parse_bytes) if given("log_max_bytes") else None,
        start_method=get("start_method", lambda s: v.parse_choice(s, START_METHODS)),
        event_log_handler=str(raw["event_log_handler"].value),
        logs_specs=get("logs_specs", v.parse_logs_specs) if given("logs_specs") else None,
        numa_binding=(
            get("numa_binding", lambda s: v.parse_choice(s, NUMA_MODES))
            if given("numa_binding")
            else None
        ),
        virtual_local_rank=flag("virtual_local_rank"),
        raw_console=flag("raw_console"),
        desync_check=flag("desync_check"),
        hang_timeout=hang_timeout,
    )
    return config, notes


# -- helpers ----------------------------------------------------------------------------


def _port(endpoint: str) -> str | None:
    """The port text of ``HOST:PORT`` (``[v6]:PORT``), or None when there is none."""
    if endpoint.startswith("["):
        rest = endpoint.partition("]")[2]
        return rest[1:] if rest.startswith(":") else None
    if endpoint.count(":") == 1:
        return endpoint.partition(":")[2].strip()
    return None


def _slurm(env: Mapping[str, str]) -> SlurmDefaults | None:
    try:
        return slurm_defaults(env)
    except ValueError as e:
        raise ConfigError(f"{e}; give --rdzv-endpoint HOST:PORT to skip SLURM detection") from None


def _parse_command_line(argv: Sequence[str]) -> click.Context:
    """Run click over ``argv``; its usage errors become one-line `ConfigError`s."""
    command = make_command()
    try:
        return command.make_context("meshrun", list(argv))
    except click.exceptions.NoSuchOption as e:
        hint = f"did you mean {e.possibilities[0]}?" if e.possibilities else "see meshrun --help"
        raise ConfigError(
            f"{e.option_name}: no such option (options for meshrun go before SCRIPT); {hint}"
        ) from None
    except click.exceptions.BadOptionUsage as e:  # "--nnodes" without a value, "--standalone=1"
        problem = _first_line(e.format_message()).replace(f"Option '{e.option_name}' ", "")
        raise ConfigError(f"{e.option_name}: {problem}; {USAGE_HINT}") from None
    except click.UsageError as e:
        raise ConfigError(f"{_first_line(e.format_message())}; {USAGE_HINT}") from None


def _first_line(text: str) -> str:
    return " ".join(text.split()).rstrip(".")


def _merge(ctx: click.Context, env: Mapping[str, str]) -> dict[str, RawValue]:
    """Each option's winning raw value: default < config file < environment < command line."""
    file_values: dict[str, RawValue] = {}
    if ctx.params.get("config") is not None:
        file_values = load_config_file(ctx.params["config"])

    merged: dict[str, RawValue] = {}
    for spec in OPTIONS:
        item = RawValue(spec.default, f"{spec.label} (default)")  # type: ignore[arg-type]
        item = file_values.get(spec.name, item)
        for var in spec.env:
            text = env.get(var)
            if text:
                value: str | bool = text
                if spec.is_flag:
                    try:
                        value = v.parse_flag_env(text)
                    except ValueProblem as problem:
                        raise problem.at(f"{var}={text}") from None
                item = RawValue(value, f"{var}={text}")
        if ctx.get_parameter_source(spec.name) == ParameterSource.COMMANDLINE:
            value = ctx.params[spec.name]
            item = RawValue(value, spec.label if spec.is_flag else f"{spec.label} {value}")
        merged[spec.name] = item
    return merged


def _entrypoint(
    script: str,
    module: bool,
    no_python: bool,
    run_path: bool,
    raw: Mapping[str, RawValue],
    env: Mapping[str, str],
) -> tuple[str, ...]:
    """The worker command before the script arguments; checks that the script exists."""
    chosen = [n for n, on in (("module", module), ("no_python", no_python), ("run_path", run_path)) if on]
    if len(chosen) > 1:
        a, b = (BY_NAME[n].label for n in chosen[:2])
        raise ConfigError(f"{a} and {b} cannot be combined; give at most one of them")

    python = env.get("PYTHON_EXEC") or sys.executable
    if module:
        return (python, "-u", "-m", script)
    if no_python:
        has_dir = os.sep in script or (os.altsep and os.altsep in script)
        found = os.path.exists(script) if has_dir else (
            os.path.exists(script) or shutil.which(script, path=env.get("PATH", os.defpath))
        )
        if not found:
            raise ConfigError(
                f"{script}: no such file or command on PATH (with --no-python); give the "
                "path of the program to run, or a command on PATH"
            )
        return (script,)
    if not os.path.exists(script):
        raise ConfigError(
            f"{script}: no such file (working directory {os.getcwd()}); give the path of "
            "the training script, or -m MODULE to run a module"
        )
    return (python, "-u", script)
