"""Small helpers the end-to-end tests share: process liveness, pid files, free ports, the
environment of a meshrun subprocess.

Importable as ``support`` from any test (pytest puts ``tests/`` on ``sys.path`` for its
``conftest.py``).
"""

from __future__ import annotations

import os
import socket
from pathlib import Path

import psutil


def alive(pid: int) -> bool:
    """True if ``pid`` exists and is not a zombie."""
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def read_pid(path: Path) -> int | None:
    """The pid a worker wrote to ``path``, or None while it is not (completely) there."""
    try:
        return int(path.read_text())
    except (FileNotFoundError, ValueError):
        return None


def free_port() -> int:
    """A TCP port that was free a moment ago on 127.0.0.1."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


REPO = Path(__file__).resolve().parents[1]

# Variables the launcher reads or sets that must not leak from the test runner's environment.
_CLEAN_PREFIXES = ("PET_", "TORCHELASTIC_", "TORCH_ELASTIC_", "MESHRUN_")
_CLEAN_NAMES = {
    "MASTER_ADDR",
    "MASTER_PORT",
    "RANK",
    "LOCAL_RANK",
    "WORLD_SIZE",
    "LOCAL_WORLD_SIZE",
    "GROUP_RANK",
    "GROUP_WORLD_SIZE",
    "ROLE_NAME",
    "ROLE_RANK",
    "ROLE_WORLD_SIZE",
    "OMP_NUM_THREADS",
    "TORCH_NCCL_ASYNC_ERROR_HANDLING",
    "PYTHON_EXEC",
}


def meshrun_env(**extra: str) -> dict[str, str]:
    """The environment for a meshrun subprocess: ours, cleaned, with the repo on PYTHONPATH."""
    env = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith(_CLEAN_PREFIXES) and k not in _CLEAN_NAMES
    }
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO), extra.pop("PYTHONPATH", "")) if p)
    env["PYTHONDONTWRITEBYTECODE"] = "1"
    env["CUDA_VISIBLE_DEVICES"] = ""
    env.update(extra)
    return env


def two_c10d_agents(cwd: Path, rdzv_id: str, args: list[str], *, nproc: int = 1,
                    timeout: float = 100) -> list[tuple[int, str, str]]:  # fmt: skip
    """Run two meshrun agents of one job on 127.0.0.1 (c10d, node rank 0 first: it hosts the
    store) to their end; ``args`` follow the rendezvous options (the rest of the command line,
    script included). Returns each agent's (exit code, stdout, stderr); both are killed if
    one outlives ``timeout`` seconds."""
    import subprocess
    import sys
    import time

    port = free_port()
    common = [sys.executable, "-m", "meshrun", "--nnodes", "2", "--nproc-per-node", str(nproc),
              "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{port}",
              "--rdzv-id", rdzv_id, "--rdzv-conf", "last_call_timeout=0.5,join_timeout=30"]  # fmt: skip
    procs = []
    try:
        for n in range(2):
            procs.append(subprocess.Popen(
                [*common, *args], env=meshrun_env(), cwd=cwd, stdin=subprocess.DEVNULL,
                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
            ))  # fmt: skip
            if n == 0:
                time.sleep(1.0)  # node rank 0 hosts the store
        outs = [p.communicate(timeout=timeout) for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.communicate()
    return [(p.returncode, out, err) for p, (out, err) in zip(procs, outs, strict=True)]
