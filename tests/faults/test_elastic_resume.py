"""Elastic training end to end: a node dies and the survivor carries on from the checkpoint.

Two `meshrun` agents (``--nnodes 1:2``, one worker each) on 127.0.0.1 train the char LM of
examples/train_char_lm.py with ``--checkpoint-dir``. Once a checkpoint exists, one node dies
(SIGKILL of its agent and its worker at once, as when a host goes away): under c10d the node
that does not host the store, under etcd the node of rank 0. The survivor must restart alone
(world size 1) without spending a restart (``--max-restarts`` stays 0: its worker's failure,
a closed connection, is told apart from a real one), load the newest checkpoint (saved at
world size 2), continue at the next step,
and keep the global batch: its losses for the steps that both runs trained equal the two-node
run's (the same data, the same math up to summation order), so the first loss after the
resume is no higher than the last one before the kill plus a small margin.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest
from support import free_port

from tests.rendezvous.etcd_fixtures import ETCD, SKIP_REASON, EtcdCluster

REPO = Path(__file__).resolve().parents[2]
EXAMPLE = REPO / "examples" / "train_char_lm.py"
STEPS, EVERY = 40, 5
STEP_LINE = re.compile(r"step (\d+) \| loss ([0-9.]+)")
RESUMED = re.compile(r"resumed from step (\d+)")

pytestmark = pytest.mark.timeout(240)


@pytest.fixture
def etcd_endpoint(tmp_path):
    if ETCD is None:
        pytest.skip(SKIP_REASON)
    (tmp_path / "etcd").mkdir()
    cluster = EtcdCluster(tmp_path / "etcd").start()
    try:
        yield cluster.endpoint
    finally:
        cluster.stop()


def start_agent(tmp: Path, name: str, backend: str, endpoint: str, ckpt: Path,
                is_host: bool) -> subprocess.Popen:
    conf = "last_call_timeout=0.5,join_timeout=60"
    if backend == "c10d":  # both agents are on 127.0.0.1: say which one hosts the store
        conf += f",is_host={int(is_host)}"
    cmd = [sys.executable, "-m", "meshrun", "--nnodes", "1:2", "--nproc-per-node", "1",
           "--rdzv-backend", backend, "--rdzv-endpoint", endpoint, "--rdzv-id", "elastic",
           "--rdzv-conf", conf, "--monitor-interval", "0.1", "--shutdown-timeout", "5",
           str(EXAMPLE), "--steps", str(STEPS), "--batch-size", "8",
           "--log-every", "1", "--checkpoint-dir", str(ckpt), "--checkpoint-every",
           str(EVERY)]
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
    out = open(tmp / f"{name}.out", "w")
    proc = subprocess.Popen(cmd, env=env, cwd=tmp, stdout=out, stderr=subprocess.STDOUT,
                            start_new_session=True)
    proc.out = tmp / f"{name}.out"
    return proc


def kill_node(proc: subprocess.Popen) -> None:
    """SIGKILL the agent and every process under it at once: the host is gone."""
    agent = psutil.Process(proc.pid)
    victims = [agent, *agent.children(recursive=True)]
    for p in victims:
        try:
            p.send_signal(signal.SIGKILL)
        except psutil.NoSuchProcess:
            pass
    proc.wait(10)


def wait_for(predicate, what: str, timeout: float, procs) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        logs = "\n".join(f"--- {p.out.name} ---\n{p.out.read_text()}" for p in procs)
        assert time.monotonic() < deadline, f"{what} did not happen in {timeout} s\n{logs}"
        time.sleep(0.05)


def losses(text: str) -> dict[int, float]:
    return {int(m.group(1)): float(m.group(2)) for m in STEP_LINE.finditer(text)}


@pytest.mark.parametrize("backend", ["c10d", "etcd"])
def test_node_loss_resumes_from_checkpoint_with_half_the_world(backend, tmp_path, request):
    ckpt = tmp_path / "ckpt"
    if backend == "c10d":
        endpoint = f"127.0.0.1:{free_port()}"
    else:
        endpoint = request.getfixturevalue("etcd_endpoint")
    first = start_agent(tmp_path, "first", backend, endpoint, ckpt, is_host=True)
    procs = [first]
    try:
        if backend == "c10d":  # the host's store first, so that it is the one that hosts
            host, port = endpoint.rsplit(":", 1)
            wait_for(lambda: _accepts(host, int(port)), "the c10d store", 60, procs)
        second = start_agent(tmp_path, "second", backend, endpoint, ckpt, is_host=False)
        procs.append(second)
        both = tmp_path / "first.out"
        wait_for(lambda: "world 2" in both.read_text() + second.out.read_text(),
                 "a two-node round", 90, procs)
        wait_for(lambda: (ckpt / f"step_{2 * EVERY}").is_dir(), "a second checkpoint", 90,
                 procs)
        # c10d: the node that does not host the store; etcd: any node, here rank 0's
        victim, survivor = (second, first) if backend == "c10d" else (first, second)
        kill_node(victim)
        before = losses(victim.out.read_text() + survivor.out.read_text())
        assert survivor.wait(120) == 0, survivor.out.read_text()
    finally:
        for p in procs:
            if p.poll() is None:
                kill_node(p)

    text = survivor.out.read_text()
    resumed = RESUMED.findall(text)
    assert resumed, f"the survivor never resumed from a checkpoint:\n{text}"
    start = int(resumed[-1])
    after_text = text[text.rindex(f"resumed from step {start}"):]
    assert "world 1" in after_text, after_text
    # the node loss is a membership change: no restart of the (default, empty) budget spent
    assert re.search(r"node \S+ lost", text), text
    rounds = re.findall(r"round \d+: .* of world size (\d+), restart count (\d+)", text)
    assert rounds[-1] == ("1", "0"), rounds
    after = losses(after_text)
    assert start >= 2 * EVERY and start % EVERY == 0, start
    assert min(after) == start + 1, f"steps after the resume: {sorted(after)}"
    assert max(after) == STEPS
    trained_before = [s for s in before if s <= max(before)]
    last_before = max(trained_before)
    assert start <= last_before
    # the first loss after the resume is no higher than the last before the kill + a margin
    assert after[start + 1] <= before[last_before] + 0.05, (after, before)
    # and the steps both runs trained have the same loss (same data, same global batch)
    for s in range(start + 1, last_before + 1):
        assert after[s] == pytest.approx(before[s], rel=2e-3, abs=2e-3), (s, after, before)


def _accepts(host: str, port: int) -> bool:
    import socket

    try:
        socket.create_connection((host, port), timeout=0.5).close()
        return True
    except OSError:
        return False
