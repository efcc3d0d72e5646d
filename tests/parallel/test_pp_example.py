"""examples/train_char_lm.py with --pp: the pipeline run trains exactly the unsplit model.

The data depend only on the step and the global batch; with ``--pp 2`` on 2 ranks there is one
data-parallel rank, so a plain one-process run sees the same batches. Microbatching with a
mean-reduced loss must not change the loss or the global gradient norm the script logs at each
step; SGD with momentum and no clipping, so a wrong gradient scale (say, not dividing by the
number of microbatches) shows. Activation checkpointing inside the stages changes nothing.
"""

import os
import subprocess
import sys

import pytest
from harness import REPO, launch, run_one_process, training_log

EXAMPLE = REPO / "examples" / "train_char_lm.py"
ARGS = ("--steps", "4", "--batch-size", "8", "--log-every", "1", "--optimizer", "sgd",
        "--lr", "0.3", "--grad-clip", "0")


def logged(output):
    log = training_log(output)
    assert sorted(log) == [1, 2, 3, 4], output
    return log


@pytest.fixture(scope="module")
def unsplit():
    return logged(run_one_process(EXAMPLE, ARGS).stdout)


@pytest.mark.timeout(200)
@pytest.mark.parametrize("flags", [("--pp", "2"),
                                   ("--parallel", "pp", "--pp-schedule", "interleaved1f1b"),
                                   ("--pp", "2", "--pp-schedule", "zbv"),
                                   ("--pp", "2", "--activation-checkpointing", "full")])
def test_pipeline_matches_unsplit_run(unsplit, flags):
    output = launch(EXAMPLE, 2, (*ARGS, *flags), timeout=120).output
    assert "| pp 2 (" in output, output
    for step, (loss, norm) in logged(output).items():
        assert loss == pytest.approx(unsplit[step][0], abs=1e-4), (step, output)
        assert norm == pytest.approx(unsplit[step][1], rel=1e-3), (step, output)


@pytest.mark.timeout(60)
def test_pp_schedule_without_pp_is_one_line_and_exit_2():
    """--pp-schedule zbh1 with no pipeline was silently ignored (a 1-process run trained
    without it); now one error line naming the fix, exit 2, no traceback."""
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE")}
    run = subprocess.run([sys.executable, str(EXAMPLE), "--pp-schedule", "zbh1", "--steps", "1"],
                         env={**env, "PYTHONPATH": str(REPO)}, cwd=REPO, capture_output=True,
                         text=True, timeout=50)
    assert run.returncode == 2, run.stdout + run.stderr
    assert run.stderr.strip() == ("train_char_lm.py: error: --pp-schedule zbh1 schedules a "
                                  "pipeline, but there is none (--pp 1): add --pp N (N > 1 "
                                  "pipeline ranks), or drop --pp-schedule"), run.stderr


@pytest.mark.timeout(60)
@pytest.mark.parametrize("flags, world, message", [
    (("--pp", "2", "--pp-schedule", "zbv", "--activation-checkpointing", "selective"), "2",
     "--pp-schedule zbv with --activation-checkpointing selective is not supported"),
    (("--pp", "2", "--dp", "2", "--dp-mode", "fsdp", "--pp-schedule", "zbh1",
      "--activation-checkpointing", "full"), "4",
     "--pp-schedule zbh1 with --dp-mode fsdp and --activation-checkpointing is not supported"),
])
def test_zero_bubble_with_checkpointing_it_cannot_run_is_one_line_and_exit_2(flags, world,
                                                                             message):
    """Both crashed in the first W: torch's selective checkpoint allows one backward per
    region (ZB runs B, then W); under fully_shard W's recompute read the resharded (local)
    parameters ("weight of shape [64] ... normalized_shape = [128]"). Refused at parse time
    (the world size comes from WORLD_SIZE, so no processes are launched)."""
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE")}
    run = subprocess.run([sys.executable, str(EXAMPLE), *flags, "--steps", "1"],
                         env={**env, "WORLD_SIZE": world, "PYTHONPATH": str(REPO)}, cwd=REPO,
                         capture_output=True, text=True, timeout=50)
    assert run.returncode == 2, run.stdout + run.stderr
    assert run.stderr.strip().startswith(f"train_char_lm.py: error: {message}"), run.stderr
