"""meshrun.parallel.pipelining on real gloo groups: parity with the unsplit model.

One launch of 2 ranks runs every check in workers/pp_checks.py (each reported as its own test
here); one launch of 4 ranks runs pipeline x data parallel (workers/pp_dp.py: 1F1B,
ZB-H1 and ZB-V under ddp, ZB-H1 under fully_shard applied before the schedule); two short
launches show that a shape mismatch between stages is an error naming the stage, not a hang.
"""

import time

import pytest
from harness import launch

CHECKS = ["check_gpipe", "check_1f1b", "check_1f1b_many_microbatches", "check_interleaved",
          "check_interleaved_eight_stages", "check_zbh1", "check_zbv", "check_custom_order",
          "check_eval",
          "check_tuple_and_int_tensors", "check_scale_grads_false",
          "check_eval_shapes_differ_from_training", "check_refusals"]
DP_CHECKS = ["check_pp_dp_parity", "check_sync_once_per_step", "check_zbh1_dp_parity",
             "check_zbh1_sync_after_last_w", "check_zbv_dp_parity",
             "check_zbv_sync_after_last_w", "check_zbh1_fsdp_built_before_schedule"]


@pytest.fixture(scope="module")
def results():
    return launch("pp_checks.py", nproc=2, timeout=150).results


@pytest.mark.timeout(180)
@pytest.mark.parametrize("check", CHECKS)
def test_pp(results, check):
    for rank, result in enumerate(results):
        assert result.get(check) == "ok", f"rank {rank}: {result.get(check, 'no report')}"


@pytest.mark.timeout(180)
def test_every_check_reported(results):
    assert sorted(results[0]) == sorted(CHECKS)


@pytest.fixture(scope="module")
def dp_results():
    return launch("pp_dp.py", nproc=4, timeout=150).results


@pytest.mark.timeout(180)
@pytest.mark.parametrize("check", DP_CHECKS)
def test_pp_with_data_parallel(dp_results, check):
    for rank, result in enumerate(dp_results):
        assert result.get(check) == "ok", f"rank {rank}: {result.get(check, 'no report')}"


@pytest.mark.timeout(150)
@pytest.mark.parametrize("mode, message", [
    ("declared", "pipeline stage 1 (pipeline rank 1): stage 0 sent [(2, 16) float32], but "
                 "stage 1 was declared (input_args) to take [(2, 12) float32]"),
    ("undeclared", "pipeline stage 1 (pipeline rank 1): forward of microbatch 0 failed on "
                   "inputs [(2, 16) float32] from stage 0"),
    ("changed", "this step's batch microbatches are [(1, 6) float32], but the first step "
                "had [(2, 6) float32]; the shapes between stages are fixed by the first "
                "step and the first eval"),
])
def test_shape_mismatch_names_the_stage(mode, message):
    start = time.monotonic()
    result = launch("pp_mismatch.py", nproc=2, args=(mode,), timeout=120, check=False)
    assert result.returncode != 0, result.output
    assert message in result.output, result.output
    # not a hang: the failing rank raises at once and the launcher stops the other one,
    # well before the workers' 60 s gloo timeout
    assert time.monotonic() - start < 60, result.output
