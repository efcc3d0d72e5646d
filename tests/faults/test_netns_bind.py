"""Hosts as network namespaces: nothing a job listens on is reachable from outside its network.

Nodes A and B run a two-node c10d job over their private link (the endpoint is A's private
address 10.213.7.1); each host also has an outside address on a second network shared with
namespace C, which is not part of the job (fixture `netns_trio`). While the job's workers run
(they met through node rank 0's workers' store and hold a gloo group), C tries every TCP port
listening in A and B at their outside addresses: each connection is refused, because meshrun
binds its stores to the job's addresses (the endpoint's, the advertised MASTER_ADDR), never the
wildcard (docs/design.md §3.7). A control listener of the test's own on A's wildcard shows that C
does reach A. The job then finishes (exit 0 on both nodes).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
WORKER = REPO / "tests" / "agent" / "e2e_scripts" / "hold_env.py"
PORT = 29417  # inside namespace A only
CONTROL_PORT = 29418
pytestmark = pytest.mark.timeout(120)

_PROBE = """
import json, socket, sys
results = {}
for target in json.loads(sys.argv[1]):
    host, port = target.rsplit(":", 1)
    try:
        socket.create_connection((host, int(port)), timeout=3).close()
        results[target] = "connected"
    except OSError as e:
        results[target] = type(e).__name__
print(json.dumps(results))
"""


def _listening(host) -> set[tuple[str, int]]:
    """(address, port) of every TCP socket listening in ``host``'s namespace."""
    out = subprocess.run(host.cmd("ss", "-Hltn"), capture_output=True, text=True, check=True)
    found = set()
    for line in out.stdout.splitlines():
        local = line.split()[3]
        addr, _, port = local.rpartition(":")
        found.add((addr.strip("[]"), int(port)))
    return found


def test_an_outsider_cannot_reach_any_port_of_the_job(netns_trio, tmp_path):
    trio = netns_trio
    a, b, c = trio.a, trio.b, trio.c
    out = tmp_path / "out"
    out.mkdir()
    control = trio.popen(a, [sys.executable, "-c", (
        "import socket, time; s = socket.socket(); "
        f"s.bind(('0.0.0.0', {CONTROL_PORT})); s.listen(); time.sleep(120)"
    )])  # fmt: skip

    def agent(host, name):
        env = {
            k: v for k, v in os.environ.items()
            if not k.startswith(("PET_", "TORCHELASTIC_", "MASTER_", "MESHRUN_"))
        }  # fmt: skip
        env.update(
            PYTHONPATH=str(REPO), GLOO_SOCKET_IFNAME=host.ifname, CUDA_VISIBLE_DEVICES="",
            PYTHONDONTWRITEBYTECODE="1",
        )  # fmt: skip
        argv = [
            sys.executable, "-m", "meshrun", "--nnodes", "2", "--nproc-per-node", "1",
            "--rdzv-backend", "c10d", "--rdzv-endpoint", f"{a.addr}:{PORT}",
            "--rdzv-id", "bindjob", "--rdzv-conf", "last_call_timeout=0.5,join_timeout=60",
            "--monitor-interval", "0.1", str(WORKER), str(out), "--dist",
        ]  # fmt: skip
        return trio.popen(
            host, argv, env=env, cwd=tmp_path, stdin=subprocess.DEVNULL,
            stdout=open(tmp_path / f"{name}.out", "w"), stderr=open(tmp_path / f"{name}.err", "w"),
        )  # fmt: skip

    agents = [agent(a, "A"), agent(b, "B")]

    def logs() -> str:
        return "\n".join(
            f"--- {n}.err ---\n{(tmp_path / f'{n}.err').read_text()}" for n in ("A", "B")
        )

    deadline = time.monotonic() + 90
    while len(list(out.glob("pid_*"))) < 2:
        assert time.monotonic() < deadline, f"the workers did not start\n{logs()}"
        assert all(p.poll() is None for p in agents), logs()
        time.sleep(0.1)
    listening = {h.ns: _listening(h) - {("0.0.0.0", CONTROL_PORT)} for h in (a, b)}
    targets = [f"{trio.outside[h.ns]}:{port}" for h in (a, b) for _, port in listening[h.ns]]
    control_target = f"{trio.outside[a.ns]}:{CONTROL_PORT}"
    probe = subprocess.run(
        c.cmd(sys.executable, "-c", _PROBE, json.dumps([control_target, *targets])),
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    results = json.loads(probe.stdout)
    (out / "stop").touch()
    codes = [p.wait(60) for p in agents]
    control.kill()

    assert results.pop(control_target) == "connected", "C cannot reach A at all"
    reached = {t: r for t, r in results.items() if r == "connected"}
    assert not reached, (reached, listening)
    assert (a.addr, PORT) in listening[a.ns], listening  # the rendezvous store, bound
    assert codes == [0, 0], logs()
