"""The fault matrix, rows not covered elsewhere (docs/faults.md lists every row and its test).

Real faults on real processes: a worker that dies of SIGSEGV; a worker failure while another
worker ignores SIGTERM and has forked a tree (one grace period, then the whole tree is
SIGKILLed); a rendezvous port already held by another listener (static: the port is in use;
c10d: the endpoint answers TCP but is not a TCPStore). Bounds are liveness limits, generous
for a loaded 2-core machine: the agent imports torch for a multi-node store (~1 s when quiet,
far more under load).
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import time
from pathlib import Path

import pytest
from support import alive, read_pid

SCRIPTS = Path(__file__).resolve().parent / "scripts"
FAULT_WORKER = str(SCRIPTS / "fault_worker.py")
SAY = str(Path(__file__).resolve().parents[1] / "agent" / "e2e_scripts" / "say_rank.py")


@pytest.fixture
def held_listener():
    """A plain TCP socket listening on 127.0.0.1 (not a TCPStore): it accepts connections
    (the kernel completes the handshake) and never answers. Yields its port."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen(64)
        yield s.getsockname()[1]


@pytest.mark.timeout(90)
def test_worker_sigsegv_spends_a_restart_then_exits_139(launch):
    """Rank 1 dies of SIGSEGV on every attempt, --max-restarts 1: the group restarts once
    (both ranks ran twice), then meshrun exits 139 (128+11) with one report naming SIGSEGV
    and rank 1's stderr tail."""
    out = launch.cwd / "out"
    out.mkdir()
    res = launch.run(
        ["--nproc-per-node", "2", "--max-restarts", "1", "--shutdown-timeout", "3",
         FAULT_WORKER, str(out), "segv"], timeout=80,
    )  # fmt: skip
    assert res.returncode == 139, res.stderr
    # both attempts ran (rank 1 segfaults at once on each; rank 0 of the second attempt may be
    # stopped before its interpreter gets as far as writing its marker)
    assert {p.name for p in out.iterdir()} >= {"run_0_0", "run_1_0", "run_1_1"}
    assert res.stderr.count("Root cause") == 1, res.stderr
    report = res.stderr[res.stderr.index("Root cause") :]
    assert "rank       : 1 (local rank 1)" in report
    assert "SIGSEGV" in report
    assert "about to segfault" in report


@pytest.mark.timeout(90)
def test_failure_stops_a_sigterm_ignoring_tree_after_one_grace(launch):
    """Rank 1 exits 3 while rank 0 ignores SIGTERM and has forked a child and a setsid()
    grandchild (both ignoring SIGTERM). With --shutdown-timeout 2 and no restarts: meshrun
    exits 3 no sooner than the grace after the fault (it was honoured) and within a bound
    (then SIGKILL, once), and rank 0's whole tree is gone when meshrun has exited."""
    out = launch.cwd / "out"
    out.mkdir()
    proc = launch.start(
        ["--nproc-per-node", "2", "--shutdown-timeout", "2", FAULT_WORKER, str(out),
         "stubborn-tree"],
    )  # fmt: skip
    names = ("pid_0_worker", "pid_0_child", "pid_0_grandchild")
    pids = {
        n: launch.wait_for(lambda n=n: read_pid(out / n), 60, what=f"pid file {n}") for n in names
    }
    launch.extra_pids.update(pids.values())
    _, err = proc.communicate(timeout=60)
    ended = time.time()
    fault = float(launch.wait_for(lambda: (out / "fault_t").read_text(), 5, what="fault_t"))
    assert proc.returncode == 3, err
    assert ended - fault >= 2.0, f"exited {ended - fault:.2f} s after the fault: grace not honoured"
    assert ended - fault < 20, ended - fault  # ~2.5 s expected; generous for a loaded machine
    left = {n: p for n, p in pids.items() if alive(p)}
    assert not left, f"still alive after meshrun exited: {left}"
    assert "exit code 3" in err[err.index("Root cause") :]


@pytest.mark.timeout(90)
def test_static_master_port_in_use_exits_3_with_one_line(launch, held_listener):
    """Node 0 of a 2-node static job whose --master-port is held by another listener: exit 3
    with one line naming the address and "in use", no worker started, no hang."""
    port = held_listener
    t0 = time.monotonic()
    res = launch.run(
        ["--rdzv-backend", "static", "--nnodes", "2", "--node-rank", "0",
         "--master-addr", "127.0.0.1", "--master-port", str(port),
         "--rdzv-conf", "read_timeout=3", "--nproc-per-node", "1", SAY], timeout=80,
    )  # fmt: skip
    elapsed = time.monotonic() - t0
    assert res.returncode == 3, res.stderr
    errors = [line for line in res.stderr.splitlines() if "error" in line.lower()]
    assert len(errors) == 1, res.stderr
    assert f"127.0.0.1:{port}" in errors[0] and "in use" in errors[0], errors
    assert "out-line" not in res.stdout  # nothing was started
    assert elapsed < 60, elapsed  # ~2 s when the machine is quiet (the torch import)


@pytest.mark.timeout(90)
def test_c10d_endpoint_held_by_a_foreign_listener_exits_3_within_read_timeout(
    launch, held_listener
):
    """--rdzv-endpoint 127.0.0.1:P where P is held by a plain listener (not a TCPStore): the
    agent tries to host (the endpoint is local), the bind fails, it connects as a client to
    the foreign listener; it must exit 3 with one clear line within about read_timeout (3 s;
    the bound adds the agent's torch import on a loaded machine), never hang."""
    port, read_timeout = held_listener, 3
    proc = launch.start(
        ["--rdzv-backend", "c10d", "--nnodes", "2", "--rdzv-endpoint", f"127.0.0.1:{port}",
         "--rdzv-id", "foreign", "--rdzv-conf", f"read_timeout={read_timeout},join_timeout=30",
         "--nproc-per-node", "1", SAY],
    )  # fmt: skip
    bound = read_timeout + 20
    try:
        out, err = proc.communicate(timeout=bound)
    except subprocess.TimeoutExpired:
        os.kill(proc.pid, signal.SIGKILL)
        out, err = proc.communicate(timeout=10)
        raise AssertionError(
            f"meshrun still running {bound} s after start (read_timeout {read_timeout}):\n{err}"
        ) from None
    assert proc.returncode == 3, err
    errors = [line for line in err.splitlines() if "error" in line.lower()]
    assert len(errors) == 1 and f"127.0.0.1:{port}" in errors[0], err
    assert "out-line" not in out
