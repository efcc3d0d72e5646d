"""Data that was never sharded gets one warning line: batches identical on every rank of a
data-parallel group at each of the first forwards (no DistributedSampler), under meshrun's
ddp and fully_shard and torch's own DistributedDataParallel and fully_shard, positional or
keyword; a shuffling DistributedSampler without set_epoch. Correct scripts get none: sharded
data, a constant warm-up forward before sharded data, a DistributedSampler over one sample
(its padding gives every rank that sample). MESHRUN_DATA_CHECK=0 switches the checks off, and
the check changes nothing the model computes. Real runs: 2 ranks, gloo, under meshrun."""

from __future__ import annotations

import os
import re

import pytest
from harness import launch

from meshrun.parallel.data_check import COMPARED_FORWARDS, SAME_INPUT_WARNING

SAME = SAME_INPUT_WARNING
EPOCH = "call sampler.set_epoch(epoch)"
WRAPS = ("ddp", "fsdp", "torch-ddp", "torch-fsdp")


def _run(mode: str, wrap: str) -> str:
    output = launch("data_checks.py", 2, (mode, wrap), timeout=100).output
    assert len(re.findall(r"rank \d done", output)) == 2, output
    return output


def _sums(output: str) -> list[str]:
    return sorted(re.findall(r"rank \d done sum \S+", output))


@pytest.mark.timeout(120)
@pytest.mark.parametrize("mode, wrap, warning", [
    *[("same", wrap, SAME) for wrap in WRAPS],
    *[("keyword", wrap, SAME) for wrap in WRAPS],
    ("no-set-epoch", "ddp", EPOCH),
])
def test_unsharded_data_warns_once(mode, wrap, warning):
    """Identical batches at every one of the first forwards: one line (rank 0 of the group)."""
    output = _run(mode, wrap)
    for text in (SAME, EPOCH):
        expected = 1 if text == warning else 0
        assert output.count(text) == expected, (mode, wrap, text, output)
    if warning == SAME:
        assert f"(2 ranks) {SAME} {COMPARED_FORWARDS} forwards" in output, output


@pytest.mark.timeout(120)
@pytest.mark.parametrize("mode", ["sharded", "warmup", "one-sample"])
@pytest.mark.parametrize("wrap", ["ddp", "torch-ddp", "torch-fsdp"])
def test_correct_data_stays_silent(mode, wrap):
    """Sharded data; a constant warm-up forward, then sharded data (the first forward alone
    is identical everywhere); a DistributedSampler over a one-sample dataset (every rank
    correctly gets sample 0 at every forward)."""
    output = _run(mode, wrap)
    assert SAME not in output and EPOCH not in output, output


@pytest.mark.timeout(200)
@pytest.mark.parametrize("wrap", ["torch-ddp", "torch-fsdp"])
def test_the_checks_can_be_switched_off_and_change_nothing(monkeypatch, wrap):
    """MESHRUN_DATA_CHECK=0: no line; and the trained parameters are the same bit for bit
    (printed to 6 decimals) with the check on and off."""
    checked = _run("same", wrap)
    assert checked.count(SAME) == 1, checked
    monkeypatch.setenv("MESHRUN_DATA_CHECK", "0")
    unchecked = _run("same", wrap)
    assert SAME not in unchecked, unchecked
    assert os.environ["MESHRUN_DATA_CHECK"] == "0"
    assert _sums(checked) == _sums(unchecked) and len(_sums(checked)) == 2, (checked, unchecked)
