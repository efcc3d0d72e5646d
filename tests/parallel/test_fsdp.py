"""meshrun.parallel.fully_shard on a real 2-process gloo group: parity with a single-process
reference (and meshrun ddp), collective counts, prefetch, memory, clipping, state dicts.

One launch runs every check in workers/fsdp_checks.py (a launch costs seconds); each test here
reports one check.
"""

import pytest
from harness import launch

CHECKS = ["check_parity_reshard", "check_parity_no_reshard", "check_accumulation", "check_tied",
          "check_shared_across_calls", "check_mixed_precision", "check_collective_counts",
          "check_prefetch", "check_memory", "check_clip_grad_norm", "check_sharded_state_dict",
          "check_full_state_dict", "check_two_forwards", "check_frozen", "check_mesh_group",
          "check_matches_torch_fsdp2"]


@pytest.fixture(scope="module")
def results():
    return launch("fsdp_checks.py", nproc=2, timeout=170).results


@pytest.mark.timeout(200)
@pytest.mark.parametrize("check", CHECKS)
def test_fsdp(results, check):
    for rank, result in enumerate(results):
        assert result.get(check) == "ok", f"rank {rank}: {result.get(check, 'no report')}"


@pytest.mark.timeout(200)
def test_every_check_reported(results):
    assert sorted(results[0]) == sorted(CHECKS)
