"""DDP communication hooks (meshrun.parallel.comm_hooks) on a real 2-process gloo group.

One launch runs every check in workers/comm_hook_checks.py; each test here reports one check.
References: the single-process exact average and torch's DDP with torch's own hooks.
"""

import pytest
from harness import launch

CHECKS = ["check_compress_hooks", "check_powersgd_rank1_exact", "check_powersgd_matches_torch",
          "check_powersgd_checkpoint",
          "check_powersgd_counts_steps_at_an_uncompressed_last_bucket", "check_hook_contract"]


@pytest.fixture(scope="module")
def results():
    return launch("comm_hook_checks.py", nproc=2, timeout=150).results


@pytest.mark.timeout(180)
@pytest.mark.parametrize("check", CHECKS)
def test_comm_hooks(results, check):
    for rank, result in enumerate(results):
        assert result.get(check) == "ok", f"rank {rank}: {result.get(check, 'no report')}"


@pytest.mark.timeout(180)
def test_every_check_reported(results):
    assert sorted(results[0]) == sorted(CHECKS)
