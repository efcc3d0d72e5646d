"""Small helpers the end-to-end tests share: process liveness, pid files, free ports.

Importable as ``support`` from any test (pytest puts ``tests/`` on ``sys.path`` for its
``conftest.py``).
"""

from __future__ import annotations

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
