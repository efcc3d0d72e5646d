"""Scripts written for torchrun with Lightning Fabric or Accelerate run unchanged under
meshrun: both see the torchrun environment (TorchElasticEnvironment; Accelerate's env:// init),
form one world, and average gradients (every rank ends with the same parameters)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

SCRIPTS = Path(__file__).parent / "scripts"


@pytest.mark.timeout(180)
@pytest.mark.parametrize("framework", ["fabric", "accelerate"])
def test_framework_script_runs_unchanged(launch, framework):
    pytest.importorskip("lightning" if framework == "fabric" else "accelerate")
    result = launch.run(["--nproc-per-node", "2", str(SCRIPTS / f"{framework}_train.py")],
                        timeout=170)  # fmt: skip
    assert result.returncode == 0, result.stderr
    found = re.findall(rf"{framework} rank (\d) of 2: checksum (-?[\d.]+)", result.stdout)
    assert sorted(r for r, _ in found) == ["0", "1"], result.stdout
    assert len({c for _, c in found}) == 1, found  # gradients averaged: equal parameters
