"""N-D composition on one mesh: examples/train_char_lm.py's `parallelize_lm` trains exactly
the unsplit model, for (pp, tp, dp) = (2,1,1), (1,2,1), (1,1,2) fsdp and ddp on 2 ranks, and
(2,2,1), (2,1,2) fsdp (also interleaved), (1,2,2) fsdp on 4 ranks, and the zero-bubble
schedules: (2,1,2) ddp with ZB-H1 and fsdp with ZB-H1 and ZB-V, pp 2 x cp 2 with ZB-H1
(ring + ddp, Ulysses + fsdp), (2,2,1) with ZB-H1 (sequence parallel) and ZB-V; the global gradient clip
(`clip_grad_norm_(..., mesh=)`) returns the unsplit model's norm (2 and inf); FSDP under
pipeline microbatching reduce-scatters once per step; a mesh that does not fit the world is
refused in one line.

One launch per world size runs every check in workers/compose_checks.py (each reported as its
own test here).
"""

import pytest
from harness import launch

CHECKS_2 = ["check_pp2", "check_tp2", "check_dp2_fsdp", "check_dp2_ddp", "check_refusals"]
CHECKS_4 = ["check_pp2_tp2", "check_pp2_dp2_fsdp", "check_pp2_dp2_fsdp_interleaved",
            "check_tp2_dp2_fsdp", "check_pp2_dp2_ddp_zbh1", "check_pp2_dp2_fsdp_zbh1",
            "check_pp2_dp2_fsdp_zbv", "check_pp2_cp2_zbh1", "check_pp2_tp2_zbh1_sp",
            "check_pp2_tp2_zbv"]


@pytest.fixture(scope="module")
def results_2():
    return launch("compose_checks.py", nproc=2, args=("2",), timeout=100).results


@pytest.fixture(scope="module")
def results_4():
    return launch("compose_checks.py", nproc=4, args=("4",), timeout=100).results


@pytest.mark.timeout(120)
@pytest.mark.parametrize("check", CHECKS_2)
def test_compose_2_ranks(results_2, check):
    for rank, result in enumerate(results_2):
        assert result.get(check) == "ok", f"rank {rank}: {result.get(check, 'no report')}"


@pytest.mark.timeout(120)
@pytest.mark.parametrize("check", CHECKS_4)
def test_compose_4_ranks(results_4, check):
    for rank, result in enumerate(results_4):
        assert result.get(check) == "ok", f"rank {rank}: {result.get(check, 'no report')}"


@pytest.mark.timeout(120)
def test_every_check_reported(results_2, results_4):
    assert sorted(results_2[0]) == sorted(CHECKS_2)
    assert sorted(results_4[0]) == sorted(CHECKS_4)
