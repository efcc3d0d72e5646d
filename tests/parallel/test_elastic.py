"""meshrun.parallel.elastic on a real 2-process gloo group (workers/elastic_checks.py, one
launch); the loop end to end, with agents and a node's death, is tests/faults/
test_elastic_in_place.py."""

import pytest
from harness import launch

CHECKS = ["check_agree_takes_the_most_steps", "check_agree_leaves_equal_steps_alone",
          "check_unwrap_then_ddp_again", "check_peer_lost_reads_the_message",
          "check_teardown_and_rejoin_a_new_world"]


@pytest.fixture(scope="module")
def results():
    return launch("elastic_checks.py", nproc=2, timeout=90).results


@pytest.mark.timeout(120)
@pytest.mark.parametrize("check", CHECKS)
def test_elastic(results, check):
    for rank, result in enumerate(results):
        assert result.get(check) == "ok", f"rank {rank}: {result.get(check, 'no report')}"
