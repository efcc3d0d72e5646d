"""examples/train_char_lm.py with --cp 2 (ring attention, fsdp over dp x cp) trains as the
model in one process does, and its checkpoint does not depend on CP.

One launch: --cp 2 on 2 ranks (the global batch is the same 4 windows, each sequence split in
the zigzag layout) logs the same step-20 loss as one process (--cp 1) within 2e-3, and saves
step 10 and 20; one process resumed from the CP run's step 10 reaches the same step-20 loss.
"""

import re
import shutil

import pytest
from harness import REPO, launch, run_one_process

EXAMPLE = REPO / "examples" / "train_char_lm.py"
ARGS = ("--steps", "20", "--batch-size", "4", "--log-every", "5")


def loss_at(output, step):
    losses = re.findall(rf"step {step} \| loss ([0-9.]+)", output)
    assert len(losses) == 1, output
    return float(losses[0])


@pytest.mark.timeout(150)
def test_cp2_matches_one_process_and_its_checkpoint_resumes_without_cp(tmp_path):
    one = run_one_process(EXAMPLE, ARGS).stdout
    cp = launch(EXAMPLE, 2, (*ARGS, "--cp", "2", "--dp-mode", "fsdp", "--checkpoint-dir",
                             str(tmp_path), "--checkpoint-every", "10"), timeout=120).output
    assert "cp 2 (ring attention, zigzag layout); fsdp over dp 1 x cp 2" in cp, cp
    assert loss_at(cp, 20) == pytest.approx(loss_at(one, 20), abs=2e-3)
    shutil.rmtree(tmp_path / "step_20")
    rest = run_one_process(EXAMPLE, (*ARGS, "--checkpoint-dir", str(tmp_path))).stdout
    assert "resumed from step 10" in rest, rest
    assert loss_at(rest, 20) == pytest.approx(loss_at(one, 20), abs=2e-3)
