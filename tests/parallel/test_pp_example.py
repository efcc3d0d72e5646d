"""examples/train_char_lm.py with --pp: the pipeline run trains exactly the unsplit model.

The data depend only on the step and the global batch; with ``--pp 2`` on 2 ranks there is one
data-parallel rank, so a plain one-process run sees the same batches. Microbatching with a
mean-reduced loss must not change the loss the script prints.
"""

import re

import pytest
from harness import REPO, launch, run_one_process

EXAMPLE = REPO / "examples" / "train_char_lm.py"
ARGS = ("--steps", "5", "--batch-size", "8", "--log-every", "5")


def final_loss(output):
    losses = re.findall(r"step 5 \| loss ([0-9.]+)", output)
    assert len(losses) == 1, output
    return float(losses[0])


@pytest.fixture(scope="module")
def unsplit_loss():
    return final_loss(run_one_process(EXAMPLE, ARGS).stdout)


@pytest.mark.timeout(200)
@pytest.mark.parametrize("flags", [("--pp", "2"),
                                   ("--parallel", "pp", "--pp-schedule", "interleaved1f1b")])
def test_pipeline_matches_unsplit_run(unsplit_loss, flags):
    output = launch(EXAMPLE, 2, (*ARGS, *flags), timeout=120).output
    assert "| pp 2 (" in output, output
    assert final_loss(output) == pytest.approx(unsplit_loss, abs=1e-4)
