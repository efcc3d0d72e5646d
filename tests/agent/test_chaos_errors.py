"""Failure reports that do not fit: a worker's error file has no size limit, but what is
published to the rendezvous store for the job-wide report must fit in a store request."""

from __future__ import annotations

from pathlib import Path

import pytest

from meshrun.agent.errors import WorkerFailure, cut_middle
from tests.rendezvous.etcd_fixtures import etcd_server  # noqa: F401 - fixture

SCRIPTS = Path(__file__).resolve().parent / "e2e_scripts"


def test_cut_middle_keeps_head_and_tail_within_the_limit():
    text = "HEAD " + "é" * 100_000 + " TAIL"  # multi-byte characters are never split
    cut = cut_middle(text, 1000)
    assert len(cut.encode()) <= 1000
    assert cut.startswith("HEAD ") and cut.endswith(" TAIL") and "bytes cut by meshrun" in cut
    assert cut_middle("short", 1000) == "short"
    failure = WorkerFailure(0, 0, 1, 1, 0, message=text, traceback="T" * 50_000 + "Error: x")
    capped = failure.capped(4096)
    assert len(capped.message.encode()) + len(capped.traceback.encode()) <= 4096
    assert capped.traceback.endswith("Error: x")


@pytest.mark.timeout(120)
def test_eight_ranks_with_300kb_messages_are_reported_on_etcd(etcd_server, launch):  # noqa: F811
    """8 ranks fail at once, each with a 300 KB error message (2.4 MB in all, beyond etcd's
    1.5 MiB request limit): the job-wide report still comes, from the store, with every
    rank, each message's head and tail and a note that the middle was cut; exit 1."""
    sync = launch.cwd / "sync"
    sync.mkdir()
    res = launch.run(
        ["--nnodes", "1:2", "--nproc-per-node", "8", "--rdzv-backend", "etcd",
         "--rdzv-endpoint", etcd_server.endpoint, "--rdzv-id", "bigerr",
         "--rdzv-conf", "last_call_timeout=0.2,join_timeout=30",
         str(SCRIPTS / "big_error.py"), "300000", str(sync), "8"],
        timeout=100,
    )  # fmt: skip
    assert res.returncode == 1, res.stderr[-3000:]
    report = res.stderr[res.stderr.index("Root cause") :]
    # All 8 exit within milliseconds; one still running when the group is stopped is no
    # failure of its own, so allow for one on a loaded machine.
    assert "Other failures (7)" in report or "Other failures (6)" in report, report[-3000:]
    assert "bytes cut by meshrun" in report
    root = report.split("Other failures")[0]
    assert "HEAD-OF-RANK-" in root and "TAIL-OF-RANK-" in root, root[:2000]
    assert len(res.stderr) < 200_000, "the report carries whole 300 KB messages"
