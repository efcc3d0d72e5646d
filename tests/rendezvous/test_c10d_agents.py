"""Real multi-agent jobs on 127.0.0.1 with the c10d backend: each node is a `meshrun` process.

Workers (scripts/elastic_worker.py) join a gloo group, all_reduce, append a record of their
rank, world size and round to a file, and wait for a stop file. Timeouts are seconds, not
minutes; bounds on waits are liveness limits, set generously for a loaded 2-core machine.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest
from support import free_port

from meshrun.rendezvous.c10d import TCPStoreBackend

pytestmark = pytest.mark.timeout(120)

WORKER = Path(__file__).parent / "scripts" / "elastic_worker.py"
REPO = Path(__file__).resolve().parents[2]


class Job:
    """One job's shared files and endpoint; `node()` starts one meshrun agent of it."""

    def __init__(
        self,
        tmp: Path,
        nnodes: str,
        conf: str = "",
        host: str = "127.0.0.1",
        backend: str = "c10d",
        endpoint: str | None = None,
        run_id: str = "test",
    ):
        self.tmp = tmp
        self.host = host
        self.backend = backend
        self.run_id = run_id
        self._endpoint = endpoint  # default: host:port, the c10d store this job's agent hosts
        self.records = tmp / "records.jsonl"
        self.stop_file = tmp / "stop"
        self.port = free_port()
        self.nnodes = nnodes
        settings = {"last_call_timeout": "0.5", "join_timeout": "30"}
        settings.update(item.split("=", 1) for item in conf.split(",") if item)
        self.conf = ",".join(f"{k}={v}" for k, v in settings.items())
        self.nodes: list[subprocess.Popen] = []

    def node(
        self, *extra: str, nproc: int = 1, name: str | None = None, env: dict | None = None
    ) -> subprocess.Popen:
        name = name or f"node{len(self.nodes)}"
        cmd = [
            sys.executable, "-m", "meshrun", "--nnodes", self.nnodes,
            "--nproc-per-node", str(nproc), "--rdzv-backend", self.backend,
            "--rdzv-endpoint", self.endpoint, "--rdzv-id", self.run_id,
            "--rdzv-conf", self.conf, "--monitor-interval", "0.1", "--shutdown-timeout", "3",
            *extra, str(WORKER), str(self.records), str(self.stop_file),
        ]  # fmt: skip
        env = {**os.environ, "PYTHONPATH": str(REPO), **(env or {})}
        proc = subprocess.Popen(
            cmd, env=env, cwd=self.tmp, start_new_session=True,
            stdout=open(self.tmp / f"{name}.out", "w"), stderr=open(self.tmp / f"{name}.err", "w"),
        )  # fmt: skip
        proc.name = name
        self.nodes.append(proc)
        return proc

    @property
    def endpoint(self) -> str:
        return self._endpoint or f"{self.endpoint_host}:{self.port}"

    @property
    def endpoint_host(self) -> str:
        return f"[{self.host}]" if ":" in self.host else self.host

    def wait_for_store(self, timeout: float = 30) -> None:
        """Until the first agent hosts the rendezvous store (its port accepts connections)."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            try:
                socket.create_connection((self.host, self.port), timeout=0.5).close()
                return
            except OSError:
                time.sleep(0.05)
        raise AssertionError("the store never came up")

    def read_records(self) -> list[dict]:
        if not self.records.exists():
            return []
        return [json.loads(line) for line in self.records.read_text().splitlines() if line]

    def wait_records(self, predicate, timeout: float = 60) -> list[dict]:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            records = self.read_records()
            if predicate(records):
                return records
            time.sleep(0.1)
        raise AssertionError(f"records never matched: {self.read_records()}\n{self.logs()}")

    def wait_joined(self, proc: subprocess.Popen, round_: int, joined, timeout: float = 60):
        """Until ``joined(round_)`` (the count of the round's joiners) is at least 1: ``proc``
        has joined (a liveness bound, not a timing)."""
        deadline = time.monotonic() + timeout
        while joined(round_) < 1:
            assert time.monotonic() < deadline and proc.poll() is None, self.logs()
            time.sleep(0.1)

    def finish(self, timeout: float = 60) -> list[int]:
        self.stop_file.touch()
        return [p.wait(timeout) for p in self.nodes]

    def logs(self) -> str:
        return "\n".join(
            f"--- {p.name} ---\n" + (self.tmp / f"{p.name}.err").read_text() for p in self.nodes
        )

    def cleanup(self) -> None:
        for p in self.nodes:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
                p.wait(10)


@pytest.fixture
def job_factory(tmp_path):
    jobs = []

    def make(nnodes: str, conf: str = "", host: str = "127.0.0.1") -> Job:
        job = Job(tmp_path / f"job{len(jobs)}", nnodes, conf, host)
        job.tmp.mkdir()
        jobs.append(job)
        return job

    yield make
    for job in jobs:
        job.cleanup()


def in_round(round_: int, world: int):
    """A predicate: every rank of ``round_`` recorded, with world size ``world``."""
    return lambda rs: len([r for r in rs if r["meshrun_round"] == round_ and r["world_size"] == world]) == world


def full_round(world: int, after: int = -1):
    """A predicate: some round later than ``after`` recorded all ``world`` ranks."""
    def check(rs):
        rounds = {r["meshrun_round"] for r in rs if r["meshrun_round"] > after}
        return any(in_round(n, world)(rs) for n in rounds)

    return check


def last_round(records: list[dict]) -> int:
    return max(r["meshrun_round"] for r in records)


def test_two_nodes_two_procs_ranks_exactly_once(job_factory):
    job = job_factory("2")
    job.node(nproc=2)
    job.wait_for_store()
    job.node(nproc=2)
    records = job.wait_records(in_round(0, 4))
    assert sorted(r["rank"] for r in records) == [0, 1, 2, 3]
    assert {r["sum"] for r in records} == {4}
    assert {(r["group_rank"], r["local_rank"]) for r in records} == {(0, 0), (0, 1), (1, 0), (1, 1)}
    assert job.finish() == [0, 0], job.logs()


def test_heterogeneous_nproc_and_node_rank_honoured(job_factory):
    job = job_factory("2")
    job.node("--node-rank", "1", nproc=2)
    job.wait_for_store()
    job.node("--node-rank", "0", nproc=1)
    records = job.wait_records(in_round(0, 3))
    by_rank = {r["rank"]: r for r in records}
    assert sorted(by_rank) == [0, 1, 2]
    assert by_rank[0]["group_rank"] == 0 and by_rank[0]["local_rank"] == 0  # the 1-proc node
    assert {by_rank[1]["group_rank"], by_rank[2]["group_rank"]} == {1}
    assert job.finish() == [0, 0], job.logs()


def test_scale_up_one_to_two_mid_run(job_factory):
    job = job_factory("1:2")
    first = job.node()
    job.wait_records(in_round(0, 1))
    job.node()
    records = job.wait_records(in_round(1, 2))
    round1 = [r for r in records if r["meshrun_round"] == 1]
    assert sorted(r["rank"] for r in round1) == [0, 1]
    assert {r["torchelastic_restart_count"] for r in round1} == {0}  # scale-up spends nothing
    assert job.finish() == [0, 0], job.logs()
    assert "waiting to join" in (job.tmp / f"{first.name}.err").read_text()


def test_kill_nonhost_agent_survivor_finishes_alone(job_factory):
    job = job_factory("1:2")
    host = job.node()
    job.wait_for_store()
    other = job.node()
    before = last_round(job.wait_records(full_round(2)))
    worker_pids = [c.pid for c in psutil.Process(other.pid).children(recursive=True)]
    killed_at = time.monotonic()
    os.kill(other.pid, signal.SIGKILL)
    other.wait(10)
    records = job.wait_records(full_round(1, after=before), timeout=30)
    detected = time.monotonic() - killed_at
    after = [r for r in records if r["meshrun_round"] > before]
    assert [r["torchelastic_restart_count"] for r in after] == [0]  # a lost node spends nothing
    job.stop_file.touch()
    assert host.wait(60) == 0, job.logs()
    assert "lost" in (job.tmp / f"{host.name}.err").read_text()
    assert detected < 20, detected  # detection (<= 3 s) + a new round + a worker start
    for pid in worker_pids:  # the killed agent's workers did not outlive it
        assert not psutil.pid_exists(pid) or psutil.Process(pid).status() == psutil.STATUS_ZOMBIE


def test_kill_store_host_other_node_exits_3(job_factory):
    job = job_factory("1:2", conf="read_timeout=5")
    host = job.node()
    job.wait_for_store()
    other = job.node()
    job.wait_records(full_round(2))
    os.kill(host.pid, signal.SIGKILL)
    assert other.wait(30) == 3, job.logs()
    err = (job.tmp / f"{other.name}.err").read_text()
    assert "rendezvous store" in err and "lost" in err, err


def test_spare_node_beyond_max_exits_0_when_job_finishes(job_factory):
    job = job_factory("1:2")
    job.node()
    job.wait_for_store()
    job.node()
    before = last_round(job.wait_records(full_round(2)))
    spare = job.node()
    client = TCPStoreBackend("127.0.0.1", job.port, is_host=False, timeout=10)
    job.wait_joined(spare, before + 1, lambda r: client.count(f"/meshrun/test/r{r}/node/"))
    time.sleep(1)  # the full round is not restarted for it
    assert last_round(job.read_records()) == before
    assert job.finish() == [0, 0, 0], job.logs()


def test_join_timeout_exits_3(job_factory):
    job = job_factory("2", conf="join_timeout=2")
    lonely = job.node()
    assert lonely.wait(30) == 3
    err = (job.tmp / f"{lonely.name}.err").read_text()
    assert "join timeout" in err and "fewer than the minimum 2" in err, err


def test_root_cause_from_another_node_reported_on_every_node(job_factory):
    """A worker on node rank 1 exits 7 with no restarts left: both agents print the same
    root cause, with rank and exit code, and both exit 7."""
    job = job_factory("2")
    job.node(env={"FAIL_RANK": "1"})
    job.wait_for_store()
    job.node(env={"FAIL_RANK": "1"})
    codes = [p.wait(60) for p in job.nodes]
    assert codes == [7, 7], job.logs()
    for p in job.nodes:
        err = (job.tmp / f"{p.name}.err").read_text()
        root = err[err.index("Root cause"):]
        assert "rank       : 1" in root and "exit code 7" in root, err
        assert "deliberate failure of rank 1" in root, err


def _ipv6_loopback() -> bool:
    try:
        with socket.socket(socket.AF_INET6) as s:
            s.bind(("::1", 0))
        return True
    except OSError:
        return False


@pytest.mark.skipif(not _ipv6_loopback(), reason="this machine has no IPv6 loopback (::1)")
def test_ipv6_endpoint_in_brackets(job_factory):
    job = job_factory("2", host="::1")
    job.node()
    job.wait_for_store()
    job.node()
    records = job.wait_records(in_round(0, 2))
    assert sorted(r["rank"] for r in records) == [0, 1]
    assert job.finish() == [0, 0], job.logs()


def test_timeline_of_a_failure_a_restart_and_a_node_loss(job_factory):
    """Two agents: rank 1 fails once (a restart spent), then one node is killed (lost, a new
    round alone). ``meshrun timeline`` over the log dir holds those events in that order, and
    its picture is well-formed SVG with a band per round."""
    import xml.etree.ElementTree as ET

    job = job_factory("1:2")
    logs = job.tmp / "logs"
    extra = ("--max-restarts", "1", "--log-dir", str(logs))
    env = {"FAIL_RANK": "1", "FAIL_ATTEMPT": "0"}
    host = job.node(*extra, env=env)
    job.wait_for_store()
    other = job.node(*extra, env=env)
    job.wait_records(lambda rs: any(r["torchelastic_restart_count"] == 1 for r in rs)
                     and full_round(2)(rs))  # fmt: skip
    before = last_round(job.read_records())
    os.kill(other.pid, signal.SIGKILL)
    other.wait(10)
    job.wait_records(full_round(1, after=before), timeout=30)
    job.stop_file.touch()
    assert host.wait(60) == 0, job.logs()
    picture, trace = job.tmp / "timeline.html", job.tmp / "trace.json"
    out = subprocess.run(
        [sys.executable, "-m", "meshrun", "timeline", str(logs), "-o", str(picture),
         "--trace", str(trace)], capture_output=True, text=True, timeout=60,
        env={**os.environ, "PYTHONPATH": str(REPO)},
    )  # fmt: skip
    assert out.returncode == 0, out.stderr
    events = [e for e in json.loads(trace.read_text())["traceEvents"] if e.get("ph") == "i"]
    names = [e["name"] for e in sorted(events, key=lambda e: e["ts"])]
    failure = next(i for i, n in enumerate(names) if n.startswith("failure"))
    restart = next(i for i, n in enumerate(names) if n.startswith("restart") and i > failure)
    lost = next(i for i, n in enumerate(names) if n.startswith("node_lost"))
    assert failure < restart < lost, names
    svg = picture.read_text()
    root = ET.fromstring(svg[svg.index("<svg") : svg.index("</svg>") + len("</svg>")])
    bands = [g for g in root.iter("{http://www.w3.org/2000/svg}g") if g.get("class") == "band"]
    assert len(bands) >= 3, [g.attrib for g in bands]  # rounds 0, 1 and the one after the loss


def test_workers_store_on_a_declared_port_every_round(job_factory):
    """``--rdzv-conf workers_port=P`` (a pod's declared port): the workers' store listens on P
    in every round, a fresh store each time (round 1 after a failure meets there too)."""
    declared = free_port()
    job = job_factory("2", conf=f"workers_port={declared}")
    env = {"FAIL_RANK": "1", "FAIL_ATTEMPT": "0"}
    job.node("--max-restarts", "1", env=env)
    job.wait_for_store()
    job.node("--max-restarts", "1", env=env)
    records = job.wait_records(lambda rs: any(r["meshrun_round"] == 1 for r in rs)
                               and in_round(1, 2)(rs))  # fmt: skip
    assert job.finish() == [0, 0], job.logs()
    assert {r["master_port"] for r in records} == {declared}, records
    assert {r["meshrun_round"] for r in records} == {0, 1}


@pytest.mark.timeout(60)
def test_declared_workers_port_held_by_another_process_is_one_line(tmp_path):
    """A ``workers_port`` another process listens on (a second job on the host with the same
    port) is one line naming the port, exit 3 (it was a traceback, exit 1)."""
    holder = socket.socket()
    holder.bind(("0.0.0.0", 0))
    holder.listen()
    port = holder.getsockname()[1]
    script = tmp_path / "never.py"
    script.write_text("raise SystemExit('a worker ran')\n")
    try:
        out = subprocess.run(
            [sys.executable, "-m", "meshrun", "--nproc-per-node", "1", "--rdzv-conf",
             f"workers_port={port}", str(script)],
            capture_output=True, text=True, timeout=50,
        )  # fmt: skip
    finally:
        holder.close()
    assert out.returncode == 3, out.stderr
    assert "Traceback" not in out.stderr, out.stderr
    assert f"port {port}" in out.stderr and "workers_port" in out.stderr, out.stderr
