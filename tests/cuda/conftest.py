"""tests/cuda: the strategies and the example on CUDA with nccl (run them with tests/cuda/run.sh
on a machine with GPUs). Without CUDA every test here is skipped, with the reason; a test
marked ``@pytest.mark.gpus(n)`` is skipped on a machine with fewer than n GPUs.

Not a Python package on purpose: pytest would import it as a top-level ``cuda`` package and
shadow NVIDIA's ``cuda`` (cuda-python / cuda-bindings) that CUDA builds of torch may import.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]
if str(REPO) not in sys.path:  # `tests.parallel.harness`, as the workers import it
    sys.path.insert(0, str(REPO))


def gpu_count() -> int:
    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def _unavailable() -> str | None:
    if not torch.cuda.is_available():
        build = f"CUDA {torch.version.cuda}" if torch.version.cuda else "a CPU-only build"
        return (f"tests/cuda needs a CUDA GPU: torch.cuda.is_available() is False "
                f"(torch {torch.__version__}, {build})")
    return None


def pytest_configure(config):
    config.addinivalue_line("markers", "gpus(n): needs at least n CUDA GPUs (else skipped)")


def pytest_collection_modifyitems(config, items):
    reason = _unavailable()
    for item in items:
        if HERE not in Path(str(item.path)).resolve().parents:
            continue  # this hook sees the whole session's items
        if reason:
            item.add_marker(pytest.mark.skip(reason=reason))
            continue
        marker = item.get_closest_marker("gpus")
        if marker and gpu_count() < marker.args[0]:
            item.add_marker(pytest.mark.skip(
                reason=f"needs {marker.args[0]} CUDA GPUs, this machine has {gpu_count()}"))
