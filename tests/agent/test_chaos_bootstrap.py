"""The workers' bootstrap store when it cannot start: the failure is reported and the round
ends (workers are never left waiting in a backlog nobody accepts), and its listening
descriptor is closed on every path."""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest
from support import alive, read_pid

from meshrun.agent.bootstrap import BootstrapError, BootstrapStore

SCRIPTS = Path(__file__).resolve().parent / "e2e_scripts"


def _sockets() -> set[str]:
    """This process's open sockets ("socket:[inode]")."""
    out = set()
    for name in os.listdir("/proc/self/fd"):
        try:
            link = os.readlink(f"/proc/self/fd/{name}")
        except OSError:
            continue
        if link.startswith("socket:"):
            out.add(link)
    return out


@pytest.mark.timeout(60)
@pytest.mark.parametrize("timeout", [1800.0, 1e20])
def test_store_descriptor_closed_whether_it_started_or_not(timeout):
    """A store that starts (the default) and one that cannot (a timeout TCPStore refuses, after
    the socket was handed over): after close() no socket of ours is left open, and a failure
    is raised by check() with its cause."""
    store = BootstrapStore("127.0.0.1", timeout=timeout)
    for _ in range(2):  # two rounds
        before = _sockets()
        store.open()
        store.serve()
        store._thread.join(30)
        if timeout == 1800.0:
            store.check()
        else:
            with pytest.raises(BootstrapError, match="failed to start: OverflowError"):
                store.check()
        store.close()
        assert _sockets() - before == set(), "the listening socket was left open"


@pytest.mark.timeout(60)
def test_store_that_cannot_start_ends_the_round_with_exit_3(launch, tmp_path):
    """The agent's torch is broken (a torch package that fails to import shadows the real
    one), so the workers' store cannot start (a one-node job needs torch for nothing else):
    meshrun says so in one line and exits 3 within seconds, and its worker is stopped
    (before, the agent ran on with workers that could never meet)."""
    fake = tmp_path / "fake"
    (fake / "torch").mkdir(parents=True)
    (fake / "torch" / "__init__.py").write_text("raise ImportError('a broken torch install')\n")
    out = launch.cwd / "out"
    out.mkdir()
    t0 = time.monotonic()
    res = launch.run(
        ["--nproc-per-node", "1", "--shutdown-timeout", "2",
         str(SCRIPTS / "proc_tree.py"), str(out), "plain"],
        env={"PYTHONPATH": str(fake)}, timeout=40,
    )  # fmt: skip
    worker = read_pid(out / "pid_0_worker")
    if worker is not None:
        launch.extra_pids.add(worker)
    assert res.returncode == 3, res.stderr
    assert "workers' store" in res.stderr and "a broken torch install" in res.stderr, res.stderr
    assert time.monotonic() - t0 < 30
    assert worker is None or not alive(worker)
