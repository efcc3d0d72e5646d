"""A 2-agent c10d job with a shared secret, attacked by a rogue client without it (§3.7).

The rogue is a plain torch TCPStore client of the job's rendezvous port. It knows meshrun's
key layout and the c10d backend's value format (``<version>|<writer>|<payload>`` and the
change markers), so only the HMAC tells its values apart. While the first agent waits for the
second, it tries to join round 0 (a register entry, plain and with a made-up MAC), to publish
the membership and the workers' master address, to mark the job failed, and to end the exit
barrier (its counter moved past the number of nodes, ``alldone`` written). The job must run
with exactly the two real nodes, the workers must reach the real master, and both agents must
exit 0. The secret (a file for one agent, MESHRUN_RDZV_SECRET for the other) must appear in no
output, no log file, no worker's /proc/<pid>/environ, no agent's command line.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from datetime import timedelta
from pathlib import Path

import psutil
import pytest
from support import free_port

from meshrun.rendezvous.api import NodeDesc, encode_members

pytestmark = pytest.mark.timeout(120)

WORKER = Path(__file__).parent / "scripts" / "secret_worker.py"
REPO = Path(__file__).resolve().parents[2]
SECRET = "Zq9-rendezvous-secret-4f7c2b"
RUN_ID = "sealed"
P = f"/meshrun/{RUN_ID}/"


def _agent(tmp: Path, name: str, port: int, conf: str, env: dict) -> subprocess.Popen:
    cmd = [
        sys.executable, "-m", "meshrun", "--nnodes", "2", "--nproc-per-node", "1",
        "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{port}", "--rdzv-id", RUN_ID,
        "--rdzv-conf", f"join_timeout=40,last_call_timeout=0.5,{conf}".rstrip(","),
        "--monitor-interval", "0.1", "--shutdown-timeout", "3", "--log-dir", str(tmp / "logs"),
        "--tee", "3", str(WORKER), str(tmp / "out"),
    ]  # fmt: skip
    return subprocess.Popen(
        cmd, env={**os.environ, "PYTHONPATH": str(REPO), **env}, cwd=tmp,
        start_new_session=True, stdout=open(tmp / f"{name}.out", "w"),
        stderr=open(tmp / f"{name}.err", "w"),
    )  # fmt: skip


def _rogue_client(port: int):
    import torch.distributed as dist

    deadline = time.monotonic() + 30
    while True:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=0.5).close()
            break
        except OSError:
            assert time.monotonic() < deadline, "the store never came up"
            time.sleep(0.05)
    return dist.TCPStore("127.0.0.1", port, is_master=False, timeout=timedelta(seconds=10),
                         use_libuv=True)  # fmt: skip


def _forge(store, key: str, payload: bytes) -> None:
    """Write ``payload`` as the c10d backend would (version 1), and wake its waiters."""
    store.set(key, b"1|rogue|" + payload)
    store.set(f"{key}@1", b"1")


def _attack(store) -> None:
    rogue = {"node_id": "rogue:1:bad", "addr": "6.6.6.6", "nproc": 8,
             "node_rank_hint": None, "prev_rank": None}  # fmt: skip
    desc = json.dumps(rogue, sort_keys=True).encode()
    for name, value in (("rogue", desc), ("rogue2", b"M1" + b"A" * 43 + b"rogue2\0" + desc)):
        position = store.add(P + "r0/node/n", 1)  # join round 0
        store.multi_set([f"{P}r0/node/at/{position}", f"{P}r0/node/id/{name}"],
                        [value, str(position).encode()])  # fmt: skip
    _forge(store, P + "r0/closed", encode_members([NodeDesc(**rogue)]))  # the membership
    _forge(store, P + "r0/master", b"6.6.6.6:6666")  # the workers' master address
    failed = {"round": 0, "restarts": 0, "status": "failed", "reason": "forged"}
    _forge(store, P + "state", json.dumps(failed, sort_keys=True).encode())  # the outcome
    store.add(P + "r0/done/n", 5)  # the exit barrier's count, past the 2 nodes
    _forge(store, P + "r0/alldone", b"1")


def test_rogue_without_the_secret_changes_nothing(tmp_path):
    secret_file = tmp_path / "rdzv.secret"
    secret_file.write_text(SECRET + "\n")
    secret_file.chmod(0o600)
    (tmp_path / "out").mkdir()
    port = free_port()
    agents = []
    try:
        agents.append(_agent(tmp_path, "node0", port, f"secret_file={secret_file}", {}))
        rogue = _rogue_client(port)
        deadline = time.monotonic() + 30
        while rogue.add(P + "r0/node/n", 0) < 1:  # node0 joined: attack before node1 does
            assert time.monotonic() < deadline and agents[0].poll() is None
            time.sleep(0.05)
        _attack(rogue)
        agents.append(_agent(tmp_path, "node1", port, "", {"MESHRUN_RDZV_SECRET": SECRET}))
        for proc in agents:
            cmdline = " ".join(psutil.Process(proc.pid).cmdline())
            assert SECRET not in cmdline
        codes = [proc.wait(90) for proc in agents]
        logs = "\n".join((tmp_path / f"node{i}.err").read_text() for i in range(2))
        assert codes == [0, 0], logs
    finally:
        for proc in agents:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait(10)

    records = [json.loads(p.read_text()) for p in sorted((tmp_path / "out").glob("rank_*.json"))]
    assert sorted(r["RANK"] for r in records) == ["0", "1"], logs
    assert {(r["WORLD_SIZE"], r["MASTER_ADDR"], r["sum"]) for r in records} == {("2", "127.0.0.1", 2)}
    assert "not sealed with this job's secret" in logs  # the forgeries were seen and ignored

    outputs = [(tmp_path / f"node{i}.{s}").read_bytes() for i in range(2) for s in ("out", "err")]
    environs = sorted((tmp_path / "out").glob("environ_*"))
    logfiles = [p for p in (tmp_path / "logs").rglob("*") if p.is_file()]
    assert len(environs) == 2 and logfiles
    for blob in [*outputs, *(p.read_bytes() for p in environs + logfiles)]:
        assert SECRET.encode() not in blob
    for p in environs:
        assert b"MESHRUN_RDZV_SECRET" not in p.read_bytes()
