"""init() under plain python (world of one) and with a partial env; Mesh validation."""

import json
import os
import subprocess
import sys

import pytest
from harness import REPO, WORKERS

TORCHRUN_VARS = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR",
                 "MASTER_PORT", "GROUP_RANK", "TORCHELASTIC_RUN_ID")


def run_python(args, extra_env=None):
    env = {k: v for k, v in os.environ.items() if k not in TORCHRUN_VARS}
    env["PYTHONPATH"] = str(REPO)
    env.update(extra_env or {})
    return subprocess.run([sys.executable, *args], cwd=REPO, env=env, capture_output=True,
                          text=True, timeout=60)


@pytest.mark.timeout(90)
def test_world_of_one_and_mesh_errors():
    proc = run_python([str(WORKERS / "world_of_one.py")])
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert "world of one" in proc.stderr
    assert out["same"] and (out["rank"], out["world_size"], out["local_rank"]) == (0, 1, 0)
    assert (out["device"], out["backend"]) == ("cpu", "gloo")
    assert "dp=2 x tp=3" in out["mesh_error"] and "multiply to 6" in out["mesh_error"]
    assert "world size is 1" in out["mesh_error"]
    assert len(out["mesh_shape_errors"]) == 2
    assert out["mesh"] == [1, 0, 1]
    assert "'pp'" in out["axis_error"] and "dp, tp" in out["axis_error"]
    assert out["grad"] == [3.0, 3.0]


@pytest.mark.timeout(90)
def test_partial_env_names_missing_variables():
    code = "from meshrun.parallel import init; init()"
    proc = run_python(["-c", code], {"RANK": "0", "WORLD_SIZE": "2"})
    assert proc.returncode != 0
    last = proc.stderr.strip().splitlines()[-1]
    assert "missing LOCAL_RANK, MASTER_ADDR, MASTER_PORT" in last, proc.stderr
    assert "WORLD_SIZE," not in last.split("missing")[1].split("(")[0]


def test_import_meshrun_stays_light():
    code = "import sys, meshrun; assert 'torch' not in sys.modules, 'meshrun imported torch'"
    proc = run_python(["-c", code])
    assert proc.returncode == 0, proc.stderr
