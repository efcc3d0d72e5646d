"""Interleavings of faults in multi-node jobs, with real agents (``python -m meshrun``) on
127.0.0.1 and the c10d store hosted by node 0: a signal while the agent waits to tell a lost
peer from a failure, and nodes that finish, linger or die around the exit barrier.

Workers are e2e_scripts/chaos_worker.py. Bounds on waits are liveness limits for a loaded
2-core machine; the moments that matter are reached through real events (a kill -9 of a
peer agent, a line in an agent's log), never through sleeps that guess them.
"""

from __future__ import annotations

import ipaddress
import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
from support import alive, free_port

SCRIPTS = Path(__file__).resolve().parent / "e2e_scripts"
WORKER = SCRIPTS / "chaos_worker.py"
REPO = Path(__file__).resolve().parents[2]


class Job:
    """One c10d job on 127.0.0.1: `node()` starts one agent (its own session, logs in tmp)."""

    def __init__(
        self, tmp: Path, nnodes: str, conf: str = "", max_restarts: int = 0,
        endpoint_host: str = "127.0.0.1",
    ):  # fmt: skip
        self.tmp = tmp
        self.endpoint_host = endpoint_host
        self.nnodes = nnodes
        self.port = free_port()
        self.max_restarts = max_restarts
        settings = {"last_call_timeout": "0.5", "join_timeout": "30"}
        settings.update(item.split("=", 1) for item in conf.split(",") if item)
        self.conf = ",".join(f"{k}={v}" for k, v in settings.items())
        self.records = tmp / "records.jsonl"
        self.stop_file = tmp / "stop"
        self.nodes: list[subprocess.Popen] = []

    def node(self, *extra: str, env: dict | None = None) -> subprocess.Popen:
        name = f"node{len(self.nodes)}"
        cmd = [
            sys.executable, "-m", "meshrun", "--nnodes", self.nnodes, "--nproc-per-node", "1",
            "--rdzv-backend", "c10d", "--rdzv-endpoint", f"{self.endpoint_host}:{self.port}",
            "--rdzv-id", "chaos", "--rdzv-conf", self.conf, "--monitor-interval", "0.1",
            "--max-restarts", str(self.max_restarts), *extra,
            str(WORKER), str(self.records), str(self.stop_file),
        ]  # fmt: skip
        proc = subprocess.Popen(
            cmd, cwd=self.tmp, start_new_session=True, stdin=subprocess.DEVNULL,
            env={**os.environ, "PYTHONPATH": str(REPO), **(env or {})},
            stdout=open(self.tmp / f"{name}.out", "w"), stderr=open(self.tmp / f"{name}.err", "w"),
        )  # fmt: skip
        proc.name = name
        self.nodes.append(proc)
        return proc

    def err(self, proc: subprocess.Popen) -> str:
        return (self.tmp / f"{proc.name}.err").read_text()

    def logs(self) -> str:
        return "\n".join(f"--- {p.name} ---\n{self.err(p)}" for p in self.nodes)

    def records_(self) -> list[dict]:
        if not self.records.exists():
            return []
        return [json.loads(line) for line in self.records.read_text().splitlines() if line]

    def wait_until(self, predicate, timeout: float, what: str):
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            value = predicate()
            if value:
                return value
            time.sleep(0.05)
        raise AssertionError(f"timed out waiting for {what}\n{self.logs()}")

    def cleanup(self) -> None:
        for p in self.nodes:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
                p.wait(10)


@pytest.fixture
def job_factory(tmp_path):
    jobs: list[Job] = []

    def make(nnodes: str, conf: str = "", max_restarts: int = 0, **kw) -> Job:
        job = Job(tmp_path / f"job{len(jobs)}", nnodes, conf, max_restarts, **kw)
        job.tmp.mkdir()
        jobs.append(job)
        return job

    yield make
    for job in jobs:
        job.cleanup()


def _start_pair(job: Job, env0: dict | None = None, env1: dict | None = None, extra=()):
    """Node 0 (hosts the store), then node 1; wait until a round ran with both."""
    host = job.node(*extra, env=env0)
    job.wait_until(lambda: _listening(job.port), 30, "node 0 to host the store")
    other = job.node(*extra, env=env1)
    job.wait_until(lambda: _full_round(job.records_()), 60, "a round with both ranks")
    return host, other


def _listening(port: int) -> bool:
    with socket.socket() as s:
        return s.connect_ex(("127.0.0.1", port)) == 0


def _full_round(records: list[dict]) -> bool:
    """Some round recorded both ranks (node 1 may have joined in round 1)."""
    return any(sum(r["round"] == n for r in records) == 2 for n in {r["round"] for r in records})


@pytest.mark.timeout(90)
def test_sigterm_while_settling_a_lost_peer_exits_143_and_spends_nothing(job_factory):
    """--max-restarts 0: node 1's agent is killed (kill -9), node 0's worker fails with a
    closed connection, node 0 waits for the rendezvous to tell a lost node from a failure
    (_settle, made long by keep_alive_max_attempt=10); a SIGTERM then ends node 0 with 143,
    as a signal, not as a worker failure (no restart spent, no job failure, no report)."""
    job = job_factory("1:2", conf="keep_alive_max_attempt=10")
    host, other = _start_pair(job)
    os.kill(other.pid, signal.SIGKILL)
    other.wait(10)
    job.wait_until(lambda: "a peer's connection closed" in job.err(host), 40, "node 0 to settle")
    os.kill(host.pid, signal.SIGTERM)
    assert host.wait(30) == 143, job.logs()
    err = job.err(host)
    assert "received SIGTERM" in err, err
    assert "job failed" not in err and "no restarts left" not in err, err


@pytest.mark.timeout(60)
def test_sigterm_while_stopping_a_failed_group_exits_143(launch):
    """--max-restarts 0: rank 1 exits 5 and the job is over, but rank 0 ignores SIGTERM, so
    the stop waits out --shutdown-timeout 4; a SIGTERM to the agent then wins over the
    failure: meshrun exits 143 (not 5), within the grace it was already waiting."""
    out = launch.cwd / "out"
    out.mkdir()
    err_path = launch.cwd / "agent.err"
    with open(err_path, "w") as err_file:
        proc = launch.start(
            ["--nproc-per-node", "2", "--max-restarts", "0", "--shutdown-timeout", "4",
             str(SCRIPTS / "fail_while_other_lingers.py"), str(out)],
            stderr=err_file,
        )  # fmt: skip
    launch.wait_for(lambda: all((out / f"ready_{r}").exists() for r in (0, 1)), 40, what="ranks")
    (out / "go").touch()
    launch.wait_for(lambda: "no restarts left" in err_path.read_text(), 20, what="the failure")
    time.sleep(0.5)  # inside the 4 s grace of the stop
    os.kill(proc.pid, signal.SIGTERM)
    proc.communicate(timeout=30)
    err = err_path.read_text()
    assert proc.returncode == 143, err
    assert "received SIGTERM" in err, err


def _resolves_to_loopback(name: str) -> bool:
    try:
        infos = socket.getaddrinfo(name, None)
    except OSError:
        return False
    return bool(infos) and all(ipaddress.ip_address(i[4][0]).is_loopback for i in infos)


@pytest.mark.timeout(90)
@pytest.mark.skipif(
    not _resolves_to_loopback(socket.gethostname()),
    reason="this host's name does not map to a loopback address here",
)
def test_host_name_on_loopback_is_never_the_master_addr(job_factory):
    """The endpoint is this machine's host name, which maps to a loopback address here (as
    Debian's /etc/hosts maps it to 127.0.1.1): the workers of the two-node round must get a
    MASTER_ADDR that another machine could reach, never a loopback one; the round runs."""
    wait = {"CHAOS_MODE": "wait"}
    job = job_factory("2", endpoint_host=socket.gethostname())
    host, other = _start_pair(job, env0=wait, env1=wait)
    addrs = {r["master_addr"] for r in job.records_()}
    assert not any(ipaddress.ip_address(a).is_loopback for a in addrs), (addrs, job.logs())
    job.stop_file.touch()
    assert [host.wait(30), other.wait(30)] == [0, 0], job.logs()


@pytest.mark.timeout(90)
def test_node_still_stopping_a_lingering_descendant_after_success_exits_0(job_factory):
    """Every worker succeeded, but node 1's worker left a descendant in its group that ignores
    SIGTERM, so node 1's stop takes its whole --shutdown-timeout 6, longer than the host's
    close_timeout=2: node 1 still exits 0 (it had said it read the outcome before stopping;
    before, it found the store gone afterwards and exited 3), and the descendant is gone."""
    job = job_factory("2", conf="close_timeout=2")
    extra = ("--shutdown-timeout", "6")
    host, other = _start_pair(
        job, env0={"CHAOS_MODE": "wait"},
        env1={"CHAOS_DONE_RANKS": "1", "CHAOS_LINGER": "1"}, extra=extra,
    )  # fmt: skip
    linger = job.wait_until(lambda: _read_int(job.tmp / "linger_1"), 30, "the lingering child")
    job.stop_file.touch()
    assert host.wait(30) == 0, job.logs()
    assert other.wait(30) == 0, job.logs()
    assert not alive(linger)


@pytest.mark.timeout(90)
def test_node_lost_after_its_workers_succeeded_does_not_restart_the_others(job_factory):
    """--nnodes 1:2: node 1's worker succeeds at once and node 1 waits in the exit barrier;
    then node 1's agent is killed (kill -9). Its part of the job is done, so node 0 must not
    re-run the script in a new round: its worker goes on, and when it succeeds the job is
    finished (exit 0), and no rank records a new round."""
    job = job_factory("1:2")
    host, other = _start_pair(job, env0={"CHAOS_MODE": "wait"}, env1={"CHAOS_DONE_RANKS": "1"})
    rank1 = next(r for r in job.records_() if r["rank"] == 1)
    job.wait_until(lambda: not alive(rank1["pid"]), 30, "rank 1 to exit 0")
    time.sleep(2.0)  # node 1's agent is in the exit barrier (it wakes on the exit itself)
    before = job.records_()
    os.kill(other.pid, signal.SIGKILL)
    other.wait(10)
    time.sleep(7)  # > 2 x dead_after: node 0 has seen node 1 lost by now
    assert job.records_() == before, f"the script ran again:\n{job.records_()}\n{job.logs()}"
    job.stop_file.touch()
    assert host.wait(30) == 0, job.logs()
    assert job.records_() == before, job.logs()


@pytest.mark.timeout(90)
def test_sigterm_in_the_exit_barrier_exits_143_and_the_others_finish(job_factory):
    """Node 1's worker succeeded and node 1 waits in the exit barrier for node 0: a SIGTERM
    there ends node 1 with 143 at once. Its part of the job was done, so node 0 goes on
    without a new round and exits 0 when its worker succeeds."""
    job = job_factory("1:2")
    host, other = _start_pair(job, env0={"CHAOS_MODE": "wait"}, env1={"CHAOS_DONE_RANKS": "1"})
    rank1 = next(r for r in job.records_() if r["rank"] == 1)
    job.wait_until(lambda: not alive(rank1["pid"]), 30, "rank 1 to exit 0")
    time.sleep(2.0)  # node 1's agent is in the exit barrier (it wakes on the exit itself)
    before = job.records_()
    t0 = time.monotonic()
    os.kill(other.pid, signal.SIGTERM)
    assert other.wait(10) == 143, job.logs()
    assert time.monotonic() - t0 < 5
    time.sleep(4)  # > dead_after + one interval: node 0 has seen node 1 lost by now
    job.stop_file.touch()
    assert host.wait(30) == 0, job.logs()
    assert job.records_() == before, job.logs()


def _read_int(path: Path) -> int | None:
    try:
        return int(path.read_text())
    except (FileNotFoundError, ValueError):
        return None
