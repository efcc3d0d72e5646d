"""The chaos soak (benchmarks/chaos.py), short: a 3-node elastic job on a 3-member etcd survives
a few seeded random faults with every invariant intact; and the checker catches runs broken on
purpose (trained from another seed than the uninterrupted reference; a process of the job
left behind), so a green soak means something."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "benchmarks"))
import chaos  # noqa: E402
from etcd_fixtures import ETCD, SKIP_REASON  # noqa: E402 - chaos.py put it on the path

pytestmark = [pytest.mark.skipif(ETCD is None, reason=SKIP_REASON)]
STEPS = 40


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    return chaos.reference_losses(tmp_path_factory.mktemp("reference"), STEPS)


@pytest.mark.timeout(400)
def test_a_short_soak_survives_its_faults(reference, tmp_path):
    run = chaos.soak(7, 4, STEPS, reference, tmp_path, deadline_s=300)
    assert sum(run.injected.values()) >= 2, (run.injected, run.notes)
    assert not run.broken, (run.broken, run.notes, dict(run.injected))


@pytest.mark.timeout(300)
def test_the_checker_catches_a_broken_run(reference, tmp_path):
    """One run broken twice on purpose: trained from another seed than the reference, and a
    process of the job left behind. Both invariants must break, and the soak cleans up."""
    run = chaos.soak(1, 0, STEPS, reference, tmp_path, deadline_s=240, script_seed=1,
                     stray=True)
    assert any("loss differs from the uninterrupted run" in b for b in run.broken), run.broken
    assert any("process(es) of the job left" in b for b in run.broken), run.broken
    assert not chaos.tagged(run.tag), "the soak did not clean up after itself"
