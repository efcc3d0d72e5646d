"""Data that was never sharded gets one warning line: identical first batches on every rank of
a ddp or fully_shard group (no DistributedSampler), a shuffling DistributedSampler without set_epoch; sharded
data and set_epoch get none, and MESHRUN_DATA_CHECK=0 switches the checks off."""

from __future__ import annotations

import os

import pytest
from harness import launch

SAME = "got the same first batch"
EPOCH = "call sampler.set_epoch(epoch)"


@pytest.mark.timeout(120)
@pytest.mark.parametrize("mode, wrap, warning", [("same", "ddp", SAME), ("same", "fsdp", SAME),
                                                 ("sharded", "fsdp", None),
                                                 ("no-set-epoch", "ddp", EPOCH)])  # fmt: skip
def test_unsharded_data_warns_once(mode, wrap, warning):
    """ddp and fully_shard alike (the no-set-epoch run's ddp forwards sharded batches)."""
    output = launch("data_checks.py", 2, (mode, wrap), timeout=100).output
    assert output.count("done") == 2, output
    for text in (SAME, EPOCH):
        expected = 1 if text == warning else 0
        assert output.count(text) == expected, (mode, text, output)


@pytest.mark.timeout(120)
def test_the_checks_can_be_switched_off(monkeypatch):
    monkeypatch.setenv("MESHRUN_DATA_CHECK", "0")
    output = launch("data_checks.py", 2, ("same",), timeout=100).output
    assert output.count("done") == 2 and SAME not in output, output
    assert os.environ["MESHRUN_DATA_CHECK"] == "0"
