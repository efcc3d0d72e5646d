"""examples/train_char_lm.py with --tp 2 (with and without --sequence-parallel) under the
launcher logs the same loss and global gradient norm at every step as the unsharded model
trained by one process: SGD with momentum and no clipping, so a wrong gradient scale shows
(AdamW normalises it away, and clipping caps it)."""

import pytest
from harness import REPO, launch, training_log

EXAMPLE = REPO / "examples" / "train_char_lm.py"
ARGS = ("--steps", "3", "--batch-size", "4", "--log-every", "1", "--optimizer", "sgd",
        "--lr", "0.3", "--grad-clip", "0")


def logged(output):
    log = training_log(output)
    assert sorted(log) == [1, 2, 3], output
    return log


@pytest.fixture(scope="module")
def one_process():
    return logged(launch(EXAMPLE, 1, ARGS, timeout=120).output)


@pytest.mark.timeout(150)
@pytest.mark.parametrize("flags", [("--tp", "2"), ("--parallel", "tp", "--sequence-parallel")])
def test_tp_example_matches_one_process(one_process, flags):
    output = launch(EXAMPLE, 2, (*ARGS, *flags), timeout=120).output
    assert "| tp 2" in output, output
    for step, (loss, norm) in logged(output).items():
        assert loss == pytest.approx(one_process[step][0], abs=2e-4), (step, output)
        assert norm == pytest.approx(one_process[step][1], rel=1e-3), (step, output)
