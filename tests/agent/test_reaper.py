"""The reaper: workers never outlive a killed agent; a clean close kills nothing."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from support import alive

from meshrun.agent.reaper import Reaper

pytestmark = pytest.mark.timeout(30)

REPO = Path(__file__).resolve().parents[2]
SCRIPTS = Path(__file__).resolve().parent / "scripts"


def wait_gone(pids, timeout: float) -> list[int]:
    """Wait up to ``timeout`` s for all ``pids`` to be gone; return those still alive."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and any(alive(p) for p in pids):
        time.sleep(0.02)
    return [p for p in pids if alive(p)]


def parse_pids(text: str) -> dict[str, int]:
    """Parse "role pid" lines into {role: pid}, skipping a line still being written."""
    pairs = (line.split() for line in text.splitlines())
    return {p[0]: int(p[1]) for p in pairs if len(p) == 2 and p[1].isdigit()}


def read_pids(path: Path, roles: set[str], timeout: float = 15.0) -> dict[str, int]:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if path.exists():
            pids = parse_pids(path.read_text())
            if roles <= set(pids):
                return pids
        time.sleep(0.02)
    raise AssertionError(f"pid file has {path.read_text() if path.exists() else ''!r}")


def sleeper_in_own_session() -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-c", "import time; time.sleep(60)"], start_new_session=True
    )


def test_kill_9_of_the_agent_kills_workers_and_their_children(tmp_path):
    pidfile = tmp_path / "pids"
    driver = subprocess.Popen(
        [sys.executable, str(SCRIPTS / "reaper_driver.py"), str(pidfile), str(tmp_path / "logs")],
        env={**os.environ, "PYTHONPATH": str(REPO)},
        start_new_session=True,
    )
    pids: dict[str, int] = {}
    try:
        pids = read_pids(pidfile, {"driver", "reaper", "worker", "child", "grandchild"})
        workers = [pids["worker"], pids["child"], pids["grandchild"]]
        assert all(alive(p) for p in workers)
        driver.kill()
        driver.wait(5)
        # Workers ignore SIGTERM, and the grandchild left the worker's session with setsid:
        # only the reaper's SIGKILL of the group and of its descendants ends them.
        assert wait_gone(workers, 3.0) == []
        assert wait_gone([pids["reaper"]], 3.0) == [], "the reaper exits after its job"
    finally:
        driver.kill()
        driver.wait(5)
        for p in pids.values():
            try:
                os.kill(p, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass


def test_close_exits_without_killing():
    proc = sleeper_in_own_session()
    reaper = Reaper()
    try:
        t0 = time.monotonic()
        reaper.start()
        reaper.watch(proc.pid)
        reaper.close()
        assert time.monotonic() - t0 < 5
        assert not alive(reaper.pid)
        time.sleep(0.1)
        assert proc.poll() is None, "a clean close must not kill watched workers"
        reaper.close()  # idempotent
    finally:
        proc.kill()
        proc.wait(5)


def test_reaper_survives_terminal_signals_and_kills_on_eof():
    watched, forgotten = sleeper_in_own_session(), sleeper_in_own_session()
    reaper = Reaper()
    try:
        reaper.start()
        reaper.watch(watched.pid)
        reaper.watch(forgotten.pid)
        reaper.forget(forgotten.pid)
        for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
            os.kill(reaper.pid, sig)
        time.sleep(0.2)
        assert alive(reaper.pid)
        # Simulate the agent's death: close the write end without "close".
        os.close(reaper._wfd)
        reaper._wfd = None
        watched.wait(3)
        assert watched.returncode == -signal.SIGKILL
        assert forgotten.poll() is None, "forgotten groups are left alone"
        reaper._proc.wait(3)
    finally:
        for p in (watched, forgotten):
            p.kill()
            p.wait(5)
        reaper.close()


def test_watch_before_start_is_an_error():
    with pytest.raises(RuntimeError, match="start"):
        Reaper().watch(12345)
