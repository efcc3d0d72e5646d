"""Shared fixtures for the launcher tests: a temp working directory with a script in it, and
a helper that runs ``python -m meshrun`` as a real subprocess."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
if str(REPO) not in sys.path:  # run from a checkout without `pip install -e .`
    sys.path.insert(0, str(REPO))


@pytest.fixture
def workdir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A fresh working directory holding an empty ``train.py``."""
    (tmp_path / "train.py").write_text("")
    monkeypatch.chdir(tmp_path)
    return tmp_path


@pytest.fixture
def meshrun_env():
    """``meshrun_env(**extra)`` -> the environment for a meshrun subprocess (see `_env`)."""
    return _env


@pytest.fixture
def run_meshrun():
    """``run_meshrun(args, cwd, **env)``: run ``python -m meshrun ARGS`` (see `_run`)."""
    return _run


def _env(**extra: str) -> dict[str, str]:
    """The environment for a meshrun subprocess: ours without PET_*/TORCH*, plus ``extra``."""
    env = {
        k: val
        for k, val in os.environ.items()
        if not k.startswith(("PET_", "TORCHELASTIC_", "TORCH_ELASTIC_"))
    }
    env["PYTHONPATH"] = str(REPO) + os.pathsep + env.get("PYTHONPATH", "")
    env["PYTHONDONTWRITEBYTECODE"] = "1"
    env.update(extra)
    return env


def _run(args: list[str], cwd: Path, **env: str) -> subprocess.CompletedProcess[str]:
    """Run ``python -m meshrun ARGS`` in ``cwd``; returns the finished process."""
    return subprocess.run(
        [sys.executable, "-m", "meshrun", *args],
        cwd=cwd,
        env=_env(**env),
        capture_output=True,
        text=True,
        timeout=60,
    )
