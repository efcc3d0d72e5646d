"""Saving changes nothing, and load + train equals training on (workers/exact_state.py):
ddp and fully_shard, AdamW and SGD with momentum, a frozen and an unused parameter."""

import pytest

from tests.parallel.harness import assert_all_ok, launch


@pytest.mark.timeout(150)
@pytest.mark.parametrize("seed", [11])
def test_save_changes_nothing_and_resume_is_exact(seed):
    result = launch("exact_state.py", 2, ("--seed", str(seed)), timeout=140)
    assert_all_ok(result)
