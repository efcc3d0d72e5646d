"""fully_shard(..., offload_policy=CPUOffloadPolicy()) on a real 2-process gloo group.

One launch runs every check in workers/offload_checks.py: the copies host -> device before
each all-gather and device -> host after each reduce-scatter are counted, the parameters,
gradients and optimizer state stay on the host shard, and training is bit-equal to no offload.
"""

import pytest
from harness import launch

CHECKS = ["check_offload_bit_equal", "check_offload_bad_policy"]


@pytest.fixture(scope="module")
def results():
    return launch("offload_checks.py", nproc=2, timeout=120).results


@pytest.mark.timeout(150)
@pytest.mark.parametrize("check", CHECKS)
def test_offload(results, check):
    for rank, result in enumerate(results):
        assert result.get(check) == "ok", f"rank {rank}: {result.get(check, 'no report')}"


@pytest.mark.timeout(150)
def test_every_check_reported(results):
    assert sorted(results[0]) == sorted(CHECKS)
