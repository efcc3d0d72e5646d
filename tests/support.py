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
