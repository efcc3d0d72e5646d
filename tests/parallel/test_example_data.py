"""The example's data rule: every step trains on the next G windows of an epoch-ordered stream,
split over any number of data-parallel ranks and microbatches, none twice and none skipped.

Pure functions of examples/char_lm/data.py, in this process (no group).
"""

import sys

import pytest
import torch

from tests.parallel.harness import REPO

sys.path.insert(0, str(REPO / "examples"))
import char_lm as lm  # noqa: E402 - the example's package, beside its script

pytestmark = pytest.mark.timeout(60)


@pytest.mark.parametrize(("global_batch", "dp", "batch_size"),
                         [(16, 2, 8), (16, 1, 8), (64, 3, 16), (10, 4, 2), (7, 7, 1)])
def test_a_step_splits_into_exactly_its_windows(global_batch, dp, batch_size):
    n_micro = lm.accumulation_steps(global_batch, dp, batch_size)
    ids = lm.window_ids(123, global_batch, 1000, seed=5)
    parts = [lm.microbatches(ids, r, dp, n_micro) for r in range(dp)]
    assert all(len(p) == n_micro for p in parts)  # the same count on every rank
    sizes = [len(m) for p in parts for m in p]
    assert 0 < min(sizes) and max(sizes) <= batch_size
    assert torch.equal(torch.cat([m for p in parts for m in p]), ids)  # each once, in order


def test_the_stream_visits_every_window_once_per_epoch():
    n, g = 50, 8
    seen = torch.cat([lm.window_ids(step * g, g, n, seed=1) for step in range(25)])  # 4 epochs
    for epoch in range(4):
        assert sorted(seen[epoch * n:(epoch + 1) * n].tolist()) == list(range(n))
    assert not torch.equal(seen[:n], seen[n:2 * n])  # each epoch has its own order
    # a resumed run asks for the same positions and gets the same windows
    assert torch.equal(lm.window_ids(3 * g, g, n, seed=1), seen[3 * g:4 * g])


def test_too_small_a_global_batch_is_refused():
    with pytest.raises(SystemExit, match="smaller than the data-parallel size"):
        lm.accumulation_steps(3, 4, 8)
