"""End to end: signals and kill -9 with real processes. A killed agent leaves no worker,
no forked child and no setsid()'d grandchild behind (the reaper's promise); SIGTERM is
forwarded with one grace period, then SIGKILL; the launcher exits 128+N."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import time
from pathlib import Path

import psutil
import pytest
from support import alive, read_pid

SCRIPTS = Path(__file__).resolve().parent / "e2e_scripts"
PROC_TREE = str(SCRIPTS / "proc_tree.py")


def wait_pids(launch, out: Path, names: list[str], timeout: float = 40) -> dict[str, int]:
    """Wait for the workers' pid files ``pid_<name>``; register the pids for cleanup."""
    pids = {}
    for name in names:
        pids[name] = launch.wait_for(
            lambda n=name: read_pid(out / f"pid_{n}"), timeout, what=f"pid file pid_{name}"
        )
        launch.extra_pids.add(pids[name])
    return pids


def start_tree(launch, mode: str, *extra: str, script_args: tuple[str, ...] = ()):
    """Start 2 workers of proc_tree.py in ``mode``; ``extra`` are meshrun's own flags."""
    out = launch.cwd / "out"
    out.mkdir()
    proc = launch.start(["--nproc-per-node", "2", *extra, PROC_TREE, str(out), mode, *script_args])
    return proc, out


@pytest.mark.timeout(60)
def test_agent_kill9_leaves_no_orphans(launch):
    """kill -9 of the agent: within ~5 s its workers, the child each worker forked and the
    grandchild that called os.setsid() are all gone (the reaper kills the groups and their
    descendants), and so is the reaper itself."""
    proc, out = start_tree(launch, "tree", script_args=("--wait-store",))
    pids = wait_pids(
        launch, out, [f"{r}_{role}" for r in (0, 1) for role in ("worker", "child", "grandchild")]
    )
    for r in (0, 1):  # the grandchild really left the worker's session and process group
        worker, grandchild = pids[f"{r}_worker"], pids[f"{r}_grandchild"]
        assert os.getsid(grandchild) == grandchild != os.getsid(worker)
        assert os.getpgid(pids[f"{r}_child"]) == os.getpgid(worker) == worker
    reapers = [
        p.pid
        for p in psutil.Process(proc.pid).children()
        if any("reaper.py" in a for a in p.cmdline())
    ]
    assert len(reapers) == 1, "expected one reaper process, a child of the agent"
    launch.extra_pids.update(reapers)
    # Killed as soon as the whole tree exists: the agent registers each worker with the reaper
    # before anything else (its torch import starts only after), so there is no unsafe window.
    time.sleep(0.2)
    os.kill(proc.pid, signal.SIGKILL)
    proc.communicate(timeout=10)
    assert proc.returncode == -signal.SIGKILL
    everything = [*pids.values(), *reapers]
    deadline = time.monotonic() + 10  # ~5 s promised; generous on a loaded 2-core machine
    while time.monotonic() < deadline and any(alive(p) for p in everything):
        time.sleep(0.05)
    left = {n: p for n, p in {**pids, "reaper": reapers[0]}.items() if alive(p)}
    assert not left, f"still alive after the agent's kill -9: {left}"


@pytest.mark.timeout(60)
def test_sigterm_forwarded_with_grace(launch):
    """SIGTERM to the agent: every worker sees SIGTERM, gets to finish its 1 s handler (the
    --shutdown-timeout 5 grace is honoured), and meshrun exits 143 without a failure report."""
    proc, out = start_tree(launch, "term", "--shutdown-timeout", "5")
    pids = wait_pids(launch, out, ["0_worker", "1_worker"])
    t0 = time.monotonic()
    os.kill(proc.pid, signal.SIGTERM)
    _, err = proc.communicate(timeout=30)
    elapsed = time.monotonic() - t0
    assert proc.returncode == 143, err
    for r in (0, 1):
        assert (out / f"term_{r}").read_text() == "got\ndone\n", f"rank {r} was cut short"
        assert not alive(pids[f"{r}_worker"])
    assert 1.0 <= elapsed < 10, elapsed  # waited for the handlers, not for the whole grace
    assert "SIGTERM" in err
    assert "job failed" not in err


@pytest.mark.timeout(60)
def test_sigterm_ignored_then_sigkill_after_grace(launch):
    """Workers that ignore SIGTERM are SIGKILLed once --shutdown-timeout 2 has passed:
    meshrun exits 143 after 2 s and within ~5 s, and no worker is left."""
    proc, out = start_tree(launch, "ignore", "--shutdown-timeout", "2")
    pids = wait_pids(launch, out, ["0_worker", "1_worker"])
    t0 = time.monotonic()
    os.kill(proc.pid, signal.SIGTERM)
    _, err = proc.communicate(timeout=30)
    elapsed = time.monotonic() - t0
    assert proc.returncode == 143, err
    assert 2.0 <= elapsed <= 8.0, elapsed  # ~5 s expected; generous for a loaded machine
    assert not any(alive(p) for p in pids.values())


@pytest.mark.timeout(60)
def test_sigint_exits_130(launch):
    """SIGINT to the agent is forwarded; the workers stop and meshrun exits 130."""
    proc, out = start_tree(launch, "plain", "--shutdown-timeout", "5")
    pids = wait_pids(launch, out, ["0_worker", "1_worker"])
    os.kill(proc.pid, signal.SIGINT)
    _, err = proc.communicate(timeout=30)
    assert proc.returncode == 130, err
    assert not any(alive(p) for p in pids.values())


@pytest.mark.timeout(60)
def test_sigterm_reaches_each_worker_once(launch):
    """SIGTERM to the agent reaches each worker once: a worker whose handler raises
    SystemExit finishes its 1 s `finally` cleanup within the --shutdown-timeout 5 grace."""
    proc, out = start_tree(launch, "cleanup", "--shutdown-timeout", "5")
    wait_pids(launch, out, ["0_worker", "1_worker"])
    os.kill(proc.pid, signal.SIGTERM)
    _, err = proc.communicate(timeout=30)
    assert proc.returncode == 143, err
    seen = {r: (out / f"sig_{r}").read_text() for r in (0, 1)}
    assert seen == {0: "SIGTERM\ncleanup done\n", 1: "SIGTERM\ncleanup done\n"}


@pytest.mark.timeout(60)
def test_sigint_is_not_followed_by_sigterm_within_grace(launch):
    """SIGINT to the agent reaches each worker as SIGINT only: its KeyboardInterrupt cleanup
    (1 s) completes within the grace; meshrun exits 130."""
    proc, out = start_tree(launch, "cleanup", "--shutdown-timeout", "5")
    wait_pids(launch, out, ["0_worker", "1_worker"])
    os.kill(proc.pid, signal.SIGINT)
    _, err = proc.communicate(timeout=30)
    assert proc.returncode == 130, err
    seen = {r: (out / f"sig_{r}").read_text() for r in (0, 1)}
    assert seen == {0: "SIGINT\ncleanup done\n", 1: "SIGINT\ncleanup done\n"}


@pytest.mark.timeout(60)
def test_sigterm_while_waiting_for_nodes_exits_promptly(launch):
    """Node 0 of 2 waiting for a node that never comes: SIGTERM makes meshrun exit 143 within
    ~2 s, not after its store wait times out."""
    port = launch.free_port()
    proc = launch.start(
        [
            "--nproc-per-node",
            "1",
            "--rdzv-backend",
            "static",
            "--nnodes",
            "2",
            "--node-rank",
            "0",
            "--master-addr",
            "127.0.0.1",
            "--master-port",
            str(port),
            str(SCRIPTS / "say_rank.py"),
        ]
    )

    def listening() -> bool:  # node 0 hosts the store: it is in the rendezvous now
        assert proc.poll() is None, proc.communicate()
        with socket.socket() as s:
            return s.connect_ex(("127.0.0.1", port)) == 0

    launch.wait_for(listening, 40, what="the rendezvous store to listen")
    time.sleep(0.5)
    t0 = time.monotonic()
    os.kill(proc.pid, signal.SIGTERM)
    try:
        _, err = proc.communicate(timeout=2.5)
    except subprocess.TimeoutExpired:
        elapsed = time.monotonic() - t0
        proc.kill()  # nothing to leak: no worker was started
        _, err = proc.communicate(timeout=10)
        raise AssertionError(f"still running {elapsed:.1f} s after SIGTERM:\n{err}") from None
    assert proc.returncode == 143, err


@pytest.mark.timeout(60)
def test_sigterm_stops_descendants_that_left_the_group(launch):
    """SIGTERM to the agent: besides the workers and their forked children, the grandchild
    that called os.setsid() is gone once meshrun has exited 143 (WorkerGroup.stop promises
    SIGTERM, then SIGKILL, to descendants that left the worker's group)."""
    proc, out = start_tree(launch, "tree", "--shutdown-timeout", "2")
    pids = wait_pids(
        launch, out, [f"{r}_{role}" for r in (0, 1) for role in ("worker", "child", "grandchild")]
    )
    os.kill(proc.pid, signal.SIGTERM)
    _, err = proc.communicate(timeout=30)
    assert proc.returncode == 143, err
    deadline = time.monotonic() + 2  # stop() SIGKILLs before meshrun exits
    while time.monotonic() < deadline and any(alive(p) for p in pids.values()):
        time.sleep(0.05)
    left = {n: p for n, p in pids.items() if alive(p)}
    assert not left, f"still alive after meshrun exited: {left}"
