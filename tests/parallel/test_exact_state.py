"""Saving changes nothing, and load + train equals training on (workers/exact_state.py):
ddp and fully_shard, AdamW and SGD with momentum, a frozen and an unused parameter."""

import pytest

from tests.parallel.harness import launch


@pytest.mark.timeout(150)
@pytest.mark.parametrize("seed", [11])
def test_save_changes_nothing_and_resume_is_exact(seed):
    result = launch("exact_state.py", 2, ("--seed", str(seed)), timeout=140)
    for rank, checks in enumerate(result.results):
        assert checks, f"rank {rank} reported nothing:\n{result.output}"
        for name, outcome in checks.items():
            assert outcome == "ok", f"rank {rank} {name}:\n{outcome}"
