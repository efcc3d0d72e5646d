"""examples/train_char_lm.py with --pp: the pipeline run trains exactly the unsplit model.

The data depend only on the step and the global batch; with ``--pp 2`` on 2 ranks there is one
data-parallel rank, so a plain one-process run sees the same batches. Microbatching with a
mean-reduced loss must not change the loss the script prints.
"""

import os
import re
import subprocess
import sys

import pytest
from harness import REPO, launch

EXAMPLE = REPO / "examples" / "train_char_lm.py"
ARGS = ("--steps", "5", "--batch-size", "8", "--log-every", "5")


def final_loss(output):
    losses = re.findall(r"step 5 \| loss ([0-9.]+)", output)
    assert len(losses) == 1, output
    return float(losses[0])


@pytest.fixture(scope="module")
def unsplit_loss():
    env = {k: v for k, v in os.environ.items()
           if k not in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")}
    env.update(OMP_NUM_THREADS="1", PYTHONPATH=str(REPO))
    done = subprocess.run([sys.executable, str(EXAMPLE), *ARGS], env=env, cwd=REPO,
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stdout + done.stderr
    return final_loss(done.stdout)


@pytest.mark.timeout(200)
@pytest.mark.parametrize("flags", [("--pp", "2"),
                                   ("--parallel", "pp", "--pp-schedule", "interleaved1f1b")])
def test_pipeline_matches_unsplit_run(unsplit_loss, flags):
    output = launch(EXAMPLE, 2, (*ARGS, *flags), timeout=120).output
    assert "| pp 2 (" in output, output
    assert final_loss(output) == pytest.approx(unsplit_loss, abs=1e-4)
