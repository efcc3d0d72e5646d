"""Real multi-agent jobs with ``--rdzv-backend etcd`` against a real etcd on 127.0.0.1.

The same `Job` helper and worker as the c10d tests (test_c10d_agents.py). After every job the
run's key prefix in etcd must be empty: at once after a normal end (the last node out deletes
it), within the job lease's TTL after ``kill -9`` of every agent. Bounds on waits are liveness
limits, generous for a loaded 2-core machine; etcd timings are short.
"""

from __future__ import annotations

import json
import os
import signal
import time

import pytest
from etcd_fixtures import ETCD, SKIP_REASON, EtcdCluster, free_port, make_ca
from test_c10d_agents import Job, full_round, in_round, last_round

from meshrun.rendezvous.api import RendezvousError
from meshrun.rendezvous.etcd_gateway import EtcdOptions, Gateway

pytestmark = [pytest.mark.timeout(120), pytest.mark.skipif(ETCD is None, reason=SKIP_REASON)]

PREFIX = "/meshrun/test/"


@pytest.fixture
def etcd_job(tmp_path):
    """make(cluster, nnodes, conf="", endpoint=None) -> a `Job` on the etcd backend."""
    jobs = []

    def make(cluster: EtcdCluster, nnodes: str, conf: str = "", endpoint: str | None = None):
        job = Job(
            tmp_path / f"job{len(jobs)}", nnodes, conf, backend="etcd",
            endpoint=endpoint or cluster.endpoint,
        )  # fmt: skip
        job.tmp.mkdir()
        jobs.append(job)
        return job

    yield make
    for job in jobs:
        job.cleanup()


def wait_keys_gone(cluster: EtcdCluster, timeout: float, member: int = 0, **kw) -> float:
    start = time.monotonic()
    while cluster.keys(PREFIX, member=member, **kw):
        if time.monotonic() - start > timeout:
            raise AssertionError(f"keys left in etcd: {cluster.keys(PREFIX, member=member, **kw)}")
        time.sleep(0.2)
    return time.monotonic() - start


def first_joined_pid(cluster: EtcdCluster) -> int:
    """The pid of round 0's first joiner (its register entry created first)."""
    prefix = f"{PREFIX}r0/node/"
    end = prefix[:-1] + chr(ord(prefix[-1]) + 1)
    body = {
        "key": _b64(prefix), "range_end": _b64(end), "limit": 1,
        "sort_order": "ASCEND", "sort_target": "CREATE",
    }  # fmt: skip
    kv = cluster.post("kv/range", body)["kvs"][0]
    import base64

    node_id = json.loads(base64.b64decode(kv["value"]))["node_id"]
    return int(node_id.split(":")[-2])


def _b64(text: str) -> str:
    import base64

    return base64.b64encode(text.encode()).decode()


def test_two_nodes_two_procs_ranks_once_and_nothing_left(etcd_server, etcd_job):
    job = etcd_job(etcd_server, "2")
    job.node(nproc=2)
    job.node(nproc=2)
    records = job.wait_records(in_round(0, 4))
    assert sorted(r["rank"] for r in records) == [0, 1, 2, 3]
    assert {r["sum"] for r in records} == {4}
    assert PREFIX + "lease" in etcd_server.keys(PREFIX)
    # members beat: each liveness key is bound to its node's own lease, no longer "joining"
    alive = etcd_server.keys(PREFIX + "liveness/")
    assert len(alive) == 2 and all(etcd_server.get(k) == b"1" for k in alive), alive
    assert job.finish() == [0, 0], job.logs()
    assert etcd_server.keys(PREFIX) == []  # the last node out deleted the prefix


def test_scale_up_with_the_first_listed_endpoint_dead(etcd_server, etcd_job):
    """Failover: every request skips the dead first member; the job scales 1 -> 2."""
    endpoints = f"127.0.0.1:{free_port()},{etcd_server.endpoint}"
    job = etcd_job(etcd_server, "1:2", endpoint=endpoints)
    first = job.node()
    job.wait_records(in_round(0, 1))
    job.node()
    records = job.wait_records(in_round(1, 2))
    round1 = [r for r in records if r["meshrun_round"] == 1]
    assert sorted(r["rank"] for r in round1) == [0, 1]
    assert {r["torchelastic_restart_count"] for r in round1} == {0}
    assert job.finish() == [0, 0], job.logs()
    assert "waiting to join" in (job.tmp / f"{first.name}.err").read_text()
    assert etcd_server.keys(PREFIX) == []


def test_kill_first_joined_agent_survivor_finishes_alone(etcd_server, etcd_job):
    job = etcd_job(etcd_server, "1:2")
    job.node()
    job.node()
    before = last_round(job.wait_records(full_round(2)))
    pid = first_joined_pid(etcd_server)
    victim = next(p for p in job.nodes if p.pid == pid)
    survivor = next(p for p in job.nodes if p.pid != pid)
    killed_at = time.monotonic()
    os.killpg(victim.pid, signal.SIGKILL)  # the agent and its workers
    victim.wait(10)
    job.wait_records(full_round(1, after=before), timeout=40)
    assert time.monotonic() - killed_at < 25
    job.stop_file.touch()
    assert survivor.wait(60) == 0, job.logs()
    assert "lost" in (job.tmp / f"{survivor.name}.err").read_text()
    assert etcd_server.keys(PREFIX) == []  # the survivor, the last out, cleaned up


def test_a_joiner_killed_before_its_round_closed_is_found_lost(etcd_server, etcd_job):
    """A joiner does not beat until it is a member; its key says "joining", bound to the job's
    lease, which the others keep alive. So a joiner killed -9 while it waited must still be
    found lost once a round closes with it (after dead_after), not kept alive by that lease:
    the survivor meets the next node in a new round, spending no restart."""
    job = etcd_job(etcd_server, "2")
    first = job.node()
    deadline = time.monotonic() + 30
    while etcd_server.get(PREFIX + "liveness/" + _first_node_id(etcd_server)) != b"joining":
        assert time.monotonic() < deadline and first.poll() is None, job.logs()
        time.sleep(0.1)
    os.killpg(first.pid, signal.SIGKILL)
    first.wait(10)
    start = time.monotonic()
    job.node()  # closes round 0 with the dead joiner as node rank 0
    job.node()
    records = job.wait_records(in_round(1, 2), timeout=60)
    assert time.monotonic() - start < 40
    assert {r["torchelastic_restart_count"] for r in records} == {0}
    assert job.finish()[1:] == [0, 0], job.logs()
    assert wait_keys_gone(etcd_server, timeout=15) < 12


def _first_node_id(cluster: EtcdCluster) -> str:
    prefix = f"{PREFIX}r0/node/"
    end = prefix[:-1] + chr(ord(prefix[-1]) + 1)
    kvs = cluster.post("kv/range", {"key": _b64(prefix), "range_end": _b64(end)}).get("kvs")
    import base64

    return json.loads(base64.b64decode(kvs[0]["value"]))["node_id"] if kvs else "-"


def test_spare_exits_0_when_job_finishes(etcd_server, etcd_job):
    job = etcd_job(etcd_server, "1:2")
    job.node()
    job.node()
    before = last_round(job.wait_records(full_round(2)))
    spare = job.node()
    job.wait_joined(
        spare, before + 1,
        lambda r: sum(k.startswith(f"{PREFIX}r{r}/node/") for k in etcd_server.keys(PREFIX)),
    )  # fmt: skip
    time.sleep(1)  # the full round is not restarted for it
    assert last_round(job.read_records()) == before
    assert job.finish() == [0, 0, 0], job.logs()
    assert etcd_server.keys(PREFIX) == []


def test_a_node_still_stopping_when_the_job_finishes_exits_0(etcd_server, etcd_job):
    """A worker fails; the other node's worker takes 8 s to answer SIGTERM (it saves), so its
    node is still stopping when the failed node's next round (MIN = 1) trains and finishes
    alone, and the last node out deletes the job's keys. The late node finds them gone and
    reads from etcd's history that the job succeeded: exit 0, as the job did (it exited 3,
    "expired", before)."""
    job = etcd_job(etcd_server, "1:2")
    env = {"FAIL_RANK": "0", "FAIL_ATTEMPT": "0", "SLOW_TERM_S": "8"}
    for _ in range(2):
        job.node("--max-restarts", "3", "--shutdown-timeout", "30", env=env)
    job.wait_records(in_round(0, 2))
    job.wait_records(in_round(1, 1), timeout=40)  # the failed node, alone
    job.stop_file.touch()
    assert job.finish() == [0, 0], job.logs()
    logs = job.logs()
    assert logs.count("the job finished without this node (job finished)") == 1, logs
    assert etcd_server.keys(PREFIX) == []


def test_waiting_costs_no_polling_and_kill9_leaves_nothing(etcd_server, etcd_job):
    """A node waiting for a MIN that never comes sits in watches: etcd's count of reads stays
    flat (only lease keep-alives go on). Then kill -9: the job's keys expire with its lease."""
    job = etcd_job(etcd_server, "2", conf="join_timeout=60,read_timeout=3")
    lonely = job.node()
    deadline = time.monotonic() + 30
    while not any(k.startswith(PREFIX + "r0/node/") for k in etcd_server.keys(PREFIX)):
        assert time.monotonic() < deadline and lonely.poll() is None, job.logs()
        time.sleep(0.2)
    time.sleep(0.5)
    reads = etcd_server.metric("etcd_mvcc_range_total")
    keepalives = etcd_server.metric("etcd_debugging_lease_renewed_total")
    time.sleep(4)
    read_delta = etcd_server.metric("etcd_mvcc_range_total") - reads
    renewed = etcd_server.metric("etcd_debugging_lease_renewed_total") - keepalives
    # the protocol cuts waits into 5 s pieces (a few reads each); polling would be hundreds
    assert read_delta <= 8, read_delta
    # only the job's lease is kept alive (every 5/3 s): a joiner is not beating, its liveness
    # key says so, bound to the job's lease
    assert 2 <= renewed <= 4, renewed
    marks = [k for k in etcd_server.keys(PREFIX + "liveness/")]
    assert len(marks) == 1, marks
    assert etcd_server.get(marks[0]) == b"joining"
    os.killpg(lonely.pid, signal.SIGKILL)
    lonely.wait(10)
    assert etcd_server.keys(PREFIX)  # still there: the lease has not expired yet
    assert wait_keys_gone(etcd_server, timeout=15) < 12  # job lease TTL: 5 s


def test_job_marked_finished_while_workers_run_exits_0_on_every_node(etcd_server, etcd_job):
    """The job's state says succeeded while this round's workers still run (the others
    finished without these nodes, or a phantom ``done`` ended it): the agents stop their
    workers and exit 0. Before: `JobFinished` escaped the agent loop (a traceback, exit 1)."""
    job = etcd_job(etcd_server, "2")
    job.node()
    job.node()
    job.wait_records(in_round(0, 2))
    state = {"round": 0, "restarts": 0, "status": "succeeded", "reason": "finished elsewhere"}
    etcd_server.post("kv/put", {"key": _b64(PREFIX + "state"), "value": _b64(json.dumps(state))})
    codes = [p.wait(60) for p in job.nodes]
    assert codes == [0, 0], job.logs()
    assert "Traceback" not in job.logs(), job.logs()
    assert wait_keys_gone(etcd_server, timeout=15) < 12


def test_tls_with_a_throwaway_ca_and_a_wrong_ca(tmp_path, etcd_job):
    ca = make_ca(tmp_path / "ca")
    other = make_ca(tmp_path / "other", name="other")
    tls = {"cacert": ca["cacert"], "cert": ca["server"], "key": ca["server_key"],
           "client_ca": ca["cacert"], "client_cert": ca["client"], "client_key": ca["client_key"]}  # fmt: skip
    cluster = EtcdCluster(tmp_path / "etcd", tls=tls).start()
    try:
        good = f"cacert={ca['cacert']},cert={ca['client']},key={ca['client_key']}"
        job = etcd_job(cluster, "1:2", conf=good)
        job.node()
        job.wait_records(in_round(0, 1))
        assert job.finish() == [0], job.logs()
        assert cluster.keys(PREFIX) == []
        bad = etcd_job(cluster, "1:2", conf=f"cacert={other['cacert']},read_timeout=20")
        node = bad.node()
        start = time.monotonic()
        assert node.wait(30) == 3, bad.logs()
        assert time.monotonic() - start < 15  # refused at once, not retried for read_timeout
        lines = [line for line in bad.logs().splitlines()[1:] if line.strip()]
        assert len(lines) == 1, lines
        assert "not signed by the CA in --rdzv-conf cacert" in lines[0], lines
        # no client certificate for a server that requires one; plain HTTP to a TLS-only
        # server: each error line says what to give
        endpoint = cluster.endpoints.replace("https://", "")
        # (the server's refusal arrives as an EOF or as a bad-certificate alert, by timing)
        for conf, says in (({"cacert": ca["cacert"]}, r"client certificate.*\)$"),
                           ({"protocol": "http"}, "if etcd there serves only TLS")):
            options = EtcdOptions.from_conf(endpoint, conf, 2.0)
            with pytest.raises(RendezvousError, match=says):
                Gateway(options).call("kv/range", {"key": _b64("/x")})
    finally:
        cluster.stop()


def test_auth_right_password_works_wrong_one_exits_3(etcd_server, etcd_job):
    etcd_server.enable_auth("meshrun", "s3cret")
    job = etcd_job(etcd_server, "1:2", conf="user=meshrun,password=s3cret,insecure=true")
    job.node()
    job.wait_records(in_round(0, 1))
    assert job.finish() == [0], job.logs()
    token = etcd_server.post("auth/authenticate", {"name": "root", "password": "s3cret"})["token"]
    assert etcd_server.keys(PREFIX, token=token) == []
    bad = etcd_job(etcd_server, "1:2", conf="user=meshrun,password=wrong,insecure=true")
    node = bad.node()
    assert node.wait(30) == 3, bad.logs()
    lines = [line for line in bad.logs().splitlines()[1:] if line.strip()]
    assert len(lines) == 1 and "wrong user name or password" in lines[0], lines


def test_etcd_member_killed_mid_round_job_finishes(tmp_path, etcd_job):
    cluster = EtcdCluster(tmp_path / "etcd3", size=3).start(timeout=60)
    try:
        job = etcd_job(cluster, "2", endpoint=cluster.endpoints)
        job.node()
        job.node()
        job.wait_records(in_round(0, 2))
        cluster.members[0].kill()  # the member both agents talk to (the first listed)
        time.sleep(4)  # heartbeats and monitor reads go on through the other members
        assert all(p.poll() is None for p in job.nodes), job.logs()
        assert job.finish() == [0, 0], job.logs()
        assert cluster.keys(PREFIX, member=1) == []
    finally:
        cluster.stop()


def test_etcd_down_exits_3_within_read_timeout(etcd_server, etcd_job):
    job = etcd_job(etcd_server, "1:2", conf="read_timeout=3")
    node = job.node()
    job.wait_records(in_round(0, 1))
    etcd_server.stop()
    start = time.monotonic()
    assert node.wait(30) == 3, job.logs()
    assert time.monotonic() - start < 12  # read_timeout 3 s, plus a monitor tick and shutdown
    err = (job.tmp / f"{node.name}.err").read_text()
    assert "rendezvous store lost" in err and etcd_server.endpoint in err, err
