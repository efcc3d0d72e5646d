"""meshrun.parallel.ddp on a real 2-process gloo group: parity with a single-process reference.

One launch runs every check in workers/ddp_checks.py (a launch costs seconds); each test here
reports one check.
"""

import pytest
from harness import launch

CHECKS = ["check_wrap", "check_default", "check_tiny_buckets", "check_rebuild_order",
          "check_overlap", "check_no_sync", "check_unused", "check_unused_error",
          "check_two_forwards", "check_batchnorm_buffers", "check_uneven", "check_compression",
          "check_mesh_group", "check_direct"]


@pytest.fixture(scope="module")
def results():
    return launch("ddp_checks.py", nproc=2, timeout=150).results


@pytest.mark.timeout(180)
@pytest.mark.parametrize("check", CHECKS)
def test_ddp(results, check):
    for rank, result in enumerate(results):
        assert result.get(check) == "ok", f"rank {rank}: {result.get(check, 'no report')}"


@pytest.mark.timeout(180)
def test_every_check_reported(results):
    assert sorted(results[0]) == sorted(CHECKS)
