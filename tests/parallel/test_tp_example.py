"""examples/train_char_lm.py with --tp 2 (with and without --sequence-parallel) under the
launcher prints the same losses as the unsharded model trained by one process."""

import re

import pytest
from harness import REPO, launch

EXAMPLE = REPO / "examples" / "train_char_lm.py"
ARGS = ("--steps", "3", "--batch-size", "4", "--log-every", "1")


def losses(output):
    found = [float(x) for x in re.findall(r"step \d+ \| loss ([0-9.]+)", output)]
    assert len(found) == 3, output
    return found


@pytest.fixture(scope="module")
def one_process():
    return losses(launch(EXAMPLE, 1, ARGS, timeout=120).output)


@pytest.mark.timeout(150)
@pytest.mark.parametrize("flags", [("--tp", "2"), ("--parallel", "tp", "--sequence-parallel")])
def test_tp_example_matches_one_process(one_process, flags):
    output = launch(EXAMPLE, 2, (*ARGS, *flags), timeout=120).output
    assert "| tp 2" in output, output
    assert losses(output) == pytest.approx(one_process, abs=2e-4)
