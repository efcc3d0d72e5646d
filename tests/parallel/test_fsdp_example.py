"""examples/train_char_lm.py --dp-mode fsdp under the launcher: same losses as --dp-mode ddp.

Both runs see the same data (they depend only on the step) from the same initial weights, and
FSDP averages the same gradients (reduce-scatter instead of all-reduce: only the order of the
additions differs), so after 20 AdamW steps the logged losses agree to float rounding.
"""

import re

import pytest
from harness import REPO, launch

EXAMPLE = REPO / "examples" / "train_char_lm.py"
ARGS = ("--steps", "20", "--batch-size", "4", "--log-every", "5")


def losses(output):
    found = [float(x) for x in re.findall(r"step \d+ \| loss ([0-9.]+)", output)]
    assert len(found) == 5, output  # steps 1, 5, 10, 15, 20
    return found


@pytest.mark.timeout(200)
def test_fsdp_matches_ddp():
    ddp_out = launch(EXAMPLE, 2, (*ARGS, "--dp-mode", "ddp"), timeout=90).output
    fsdp_out = launch(EXAMPLE, 2, (*ARGS, "--parallel", "fsdp"), timeout=90).output
    assert "dp-mode fsdp" in fsdp_out, fsdp_out
    assert losses(fsdp_out) == pytest.approx(losses(ddp_out), abs=2e-4)
