"""In-place recovery under a hostile user or an unlucky cluster (issue 22's breaker): the
faults that `test_elastic_in_place.py` does not cover, each with the outcome it must have."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from support import free_port

from tests.faults.test_elastic_in_place import (
    EXAMPLE,
    IGNORER,
    KILL_AFTER,
    TRAIN,
    Node,
    _accepts,
    _two_nodes,
    _wait,
    _worker_pids,
)

SCRIPTS = Path(__file__).resolve().parent / "scripts"


def _pair(tmp: Path, script: list[str], args: tuple[str, ...] = (), nproc: int = 1,
          **env: str):
    """Two agents on c10d, the first (``nproc`` workers) hosts the store and survives, the
    second has one worker."""
    port = free_port()
    first = Node(tmp, "first", port, nproc, True, script,
                 launcher_args=("--node-rank", "0", *args), **env)
    _wait(lambda: _accepts(port), "the c10d store", 60, [first])
    second = Node(tmp, "second", port, 1, False, script,
                  launcher_args=("--node-rank", "1", *args), **env)
    return first, second


@pytest.mark.timeout(120)
def test_hang_timeout_does_not_fire_on_the_handover(tmp_path):
    # the handover (the node's death detected in 1 s, a last call of 1.5 s) takes longer
    # than --hang-timeout 2, and in the world of one that follows no strategy beats a
    # heartbeat (ddp is not applied): the survivor's worker must be watched as a fresh one
    # is, from its first heartbeat in the new round, not called hung for the agent's wait
    script = [str(EXAMPLE), "--elastic", "in-place", *TRAIN]
    first, second = _pair(tmp_path, script, ("--hang-timeout", "2"))
    nodes = [first, second]
    try:
        _wait(lambda: re.search(rf"step {KILL_AFTER} \| loss [0-9.]+ .*\| world 2",
                                first.text()), f"step {KILL_AFTER} at world 2", 90, nodes)
        before = _worker_pids(first)
        second.kill()
        assert first.proc.wait(60) == 0, first.text()
    finally:
        for n in nodes:
            if n.proc.poll() is None:
                n.kill()
    text = first.text()
    assert "every worker confirmed in place" in text, text
    assert not re.search(r"rank \d+ hung|hang: likely", text), text
    assert _worker_pids(first) == before, first.events()


@pytest.mark.timeout(90)
def test_an_offer_that_cannot_be_written_falls_back_to_a_restart(tmp_path):
    # the worker's channel cannot take the offer (a non-empty directory where the file goes,
    # as a full disk would refuse it): the agent must not crash; it restarts the group in
    # the new round, as for a worker that did not confirm
    first, second = _two_nodes(tmp_path, [str(IGNORER)], 1, IGNORER_BLOCK_OFFER="1")
    nodes = [first, second]
    try:
        _wait(lambda: re.search(r"round (\d+): node rank 0 of 2", first.text())
              and "opted in" in first.text(), "a two-node round whose worker opted in", 60,
              nodes)
        second.kill()
        assert first.proc.wait(60) == 0, first.text()
    finally:
        for n in nodes:
            if n.proc.poll() is None:
                n.kill()
    text = first.text()
    assert re.search(r"in-place handover failed \(the offer could not be written: ", text), text
    assert re.search(r"fresh \d+ round \d+", text), text
