"""examples/train_char_lm.py --dp-mode ddp and fsdp on 2 ranks log the loss and global
gradient norm of one process trained on the same global batch (8 windows: 2 accumulated
microbatches of 4), at every logged step.

All see the same data (they depend only on the step and the global batch) from the same
initial weights. SGD with momentum and no clipping: a data-parallel mode that sums instead of
averaging, or scales accumulated microbatches wrongly, changes both numbers (AdamW with
clipping would hide it).
"""

import pytest
from harness import REPO, launch, run_one_process, training_log

EXAMPLE = REPO / "examples" / "train_char_lm.py"
ARGS = ("--steps", "10", "--batch-size", "4", "--log-every", "2", "--optimizer", "sgd",
        "--lr", "0.3", "--grad-clip", "0", "--global-batch-size", "8")


def logged(output):
    log = training_log(output)
    assert sorted(log) == [1, 2, 4, 6, 8, 10], output
    return log


@pytest.fixture(scope="module")
def one_process():
    output = run_one_process(EXAMPLE, ARGS).stdout
    assert "1 data-parallel rank x 2 microbatches (accumulated)" in output, output
    return logged(output)


@pytest.mark.timeout(200)
@pytest.mark.parametrize("mode", ["ddp", "fsdp"])
def test_data_parallel_matches_one_process(one_process, mode):
    output = launch(EXAMPLE, 2, (*ARGS, "--dp-mode", mode), timeout=90).output
    assert f"dp-mode {mode}" in output, output
    for step, (loss, norm) in logged(output).items():
        assert loss == pytest.approx(one_process[step][0], abs=2e-4), (step, output)
        assert norm == pytest.approx(one_process[step][1], rel=1e-3), (step, output)
