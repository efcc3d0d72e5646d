"""Hosts as network namespaces: a 2-node c10d job across a veth link, then the link is cut.

Node A (namespace A, 10.213.7.1) hosts the c10d store and survives; node B (10.213.7.2) is
cut off (its veth end goes down). Expected (docs/design.md §3.2, docs/rendezvous.md):
A sees B lost within about keep-alive x attempts and continues alone in a new round, spending
no restart; B, whose store is gone, exits 3 with a line saying so, within about read_timeout.
The scenario runs once (module fixture `cut_job`); the tests judge its two sides. The
namespaces share one hostname, so nodes are told apart by the NS_NAME each agent's workers
record, never by hostname; gloo is pointed at each namespace's veth with GLOO_SOCKET_IFNAME.
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
WORKER = Path(__file__).resolve().parent / "scripts" / "ns_worker.py"
PORT = 29413  # inside namespace A only: nothing else can hold it there
CONF = "last_call_timeout=0.5,join_timeout=60,read_timeout=5"
ISOLATED_BOUND_S = 30  # read_timeout 5 s + stopping the group (grace 2 s), generously
pytestmark = pytest.mark.timeout(240)


def _records(path: Path) -> list[dict]:
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line]


def _wait(predicate, timeout: float, what: str, logs):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(0.1)
    raise AssertionError(f"timed out after {timeout} s waiting for {what}\n{logs()}")


@pytest.fixture(scope="module")
def cut_job(netns_pair, tmp_path_factory):
    """Run the scenario once; return what happened (records, exit codes, timings, logs)."""
    pair, tmp = netns_pair, tmp_path_factory.mktemp("netns")
    records, stop = tmp / "records.jsonl", tmp / "stop"

    def agent(host, name):
        env = {
            k: v for k, v in os.environ.items()
            if not k.startswith(("PET_", "TORCHELASTIC_", "MASTER_", "MESHRUN_"))
        }  # fmt: skip
        env.update(
            PYTHONPATH=str(REPO), GLOO_SOCKET_IFNAME=host.ifname, NS_NAME=name,
            CUDA_VISIBLE_DEVICES="", PYTHONDONTWRITEBYTECODE="1",
        )  # fmt: skip
        argv = [
            sys.executable, "-m", "meshrun", "--nnodes", "1:2", "--nproc-per-node", "1",
            "--rdzv-backend", "c10d", "--rdzv-endpoint", f"{pair.a.addr}:{PORT}",
            "--rdzv-id", "nsjob", "--rdzv-conf", CONF, "--monitor-interval", "0.1",
            "--shutdown-timeout", "2", str(WORKER), str(records), str(stop),
        ]  # fmt: skip
        return pair.popen(
            host, argv, env=env, cwd=tmp, stdin=subprocess.DEVNULL,
            stdout=open(tmp / f"{name}.out", "w"), stderr=open(tmp / f"{name}.err", "w"),
        )  # fmt: skip

    def logs() -> str:
        parts = [f"records: {_records(records)}"]
        for name in ("A", "B"):
            for ext in ("err", "out"):
                f = tmp / f"{name}.{ext}"
                parts.append(f"--- {name}.{ext} ---\n{f.read_text() if f.exists() else ''}")
        return "\n".join(parts)

    node_a = agent(pair.a, "A")
    _wait(lambda: any(r["ns"] == "A" for r in _records(records)), 90, "A's first round", logs)
    node_b = agent(pair.b, "B")
    _wait(lambda: len({r["ns"] for r in _records(records) if r["world_size"] == 2}) == 2, 120,
          "both nodes' workers in a 2-node round", logs)  # fmt: skip
    before = _records(records)
    pair.cut()
    cut_at = time.monotonic()
    round2 = max(r["round"] for r in before if r["world_size"] == 2)
    _wait(
        lambda: [r for r in _records(records) if r["round"] > round2 and r["world_size"] == 1],
        60, "A alone in a new round", logs,
    )  # fmt: skip
    survivor_back = time.monotonic() - cut_at
    try:
        code_b = node_b.wait(max(1.0, ISOLATED_BOUND_S - (time.monotonic() - cut_at)))
        isolated_done = time.monotonic() - cut_at
    except subprocess.TimeoutExpired:
        code_b, isolated_done = None, None  # left running: the fixture's teardown kills it
    stop.touch()
    try:
        code_a = node_a.wait(60)
    except subprocess.TimeoutExpired:
        code_a = None
    return {
        "before": before, "after": _records(records)[len(before):], "round2": round2,
        "survivor_back": survivor_back, "code_a": code_a, "code_b": code_b,
        "isolated_done": isolated_done, "err_a": (tmp / "A.err").read_text(),
        "err_b": (tmp / "B.err").read_text(), "logs": logs(), "a": pair.a,
    }  # fmt: skip


def test_survivor_hosting_the_store_continues_alone(cut_job):
    """A (store host) notices B lost, starts a new round alone without spending a restart, and
    finishes 0; every node learnt the store host's veth address (not 127.0.0.1), and node
    ranks were A=0, B=1 in the 2-node round."""
    j = cut_job
    both = [r for r in j["before"] if r["world_size"] == 2]
    assert {r["master_addr"] for r in both} == {j["a"].addr}, j["logs"]
    assert {r["ns"]: r["group_rank"] for r in both if r["round"] == j["round2"]} == {"A": 0, "B": 1}
    alone = [r for r in j["after"] if r["round"] > j["round2"]]
    assert [(r["ns"], r["world_size"], r["restarts"]) for r in alone][:1] == [("A", 1, 0)], j[
        "logs"
    ]
    assert j["code_a"] == 0, j["logs"]
    assert "lost" in j["err_a"], j["logs"]
    assert j["survivor_back"] < 45, j["survivor_back"]  # ~3 s detection + a round + a start


def test_isolated_node_exits_3_within_bound(cut_job):
    """B, cut off from the store's host, exits 3 with a line saying the store was lost, within
    ISOLATED_BOUND_S of the cut."""
    j = cut_job
    assert j["code_b"] == 3, (
        f"B exit {j['code_b']} (None: still running {ISOLATED_BOUND_S} s "
        f"after the cut)\n{j['logs']}"
    )
    assert "store" in j["err_b"] and "lost" in j["err_b"], j["logs"]
    assert j["isolated_done"] < ISOLATED_BOUND_S
