"""Neighbour copies restore the optimizer state that was trained, bit for bit, however that
state changed shape during training (workers/fsdp_copies_state.py: a key added late, the
optimizer replaced, state reloaded in another dtype); a parameter in two optimizers is
refused with a message."""

import pytest
from harness import launch


@pytest.mark.timeout(180)
def test_a_restore_equals_the_trained_state_after_its_shape_changed():
    result = launch("fsdp_copies_state.py", nproc=4, timeout=150)
    assert len(result.results) == 4 and all(result.results), result.output
    for rank, res in enumerate(result.results):
        assert len(res["scenarios"]) == 6, res
        for name, differences in res["scenarios"].items():
            assert differences == [], (rank, name, differences)
        assert "is in optimizers" in res["two"], res["two"]
