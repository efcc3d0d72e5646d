"""The diagnostics' store traffic: ``meshrun stacks`` requests and step times cost a bounded
number of store operations per node whatever the job's size, and a request is still answered
at once.

Two agents' diagnostics (`StackRequests`, `StepWatch`, ticked as the agent's loop ticks them,
every 0.1 s) run against a real TCPStore and a real etcd, each node's store wrapped in a thin
counter of the operations on the diagnostics' keys (``stacks/``, ``steps/``); the rendezvous
says the round has 1024 nodes (two of them real). Polling, as before, cost each node a read of
the request key every second and a read and a write of its step times every 2 s (about 2
operations a second per node, ~2000 a second at 1024 nodes), and node rank 0 a read of every
node's step times every 2 s.
"""

from __future__ import annotations

import json
import threading
import time
from collections import Counter
from pathlib import Path
from types import SimpleNamespace

import pytest

from meshrun.agent.hang import ProgressWatch
from meshrun.agent.stack_requests import StackRequests
from meshrun.agent.step_times import StepWatch
from meshrun.rendezvous.api import NodeDesc, RendezvousInfo, RendezvousSettings, encode_members
from meshrun.rendezvous.protocol import (
    Rendezvous,
    closed_key,
    job_prefix,
    stacks_answer_key,
    stacks_request_key,
)
from meshrun.rendezvous.store import Store

pytestmark = pytest.mark.timeout(120)

NUM_NODES = 1024  # the round's size, as the rendezvous tells the diagnostics
RUN_SECONDS = 8.0
TICK_S = 0.1  # the agent's default --monitor-interval


def _kind(key: str) -> str:
    return "stacks" if "/stacks/" in key else "steps" if "/steps/" in key else "other"


class Counting(Store):
    """A thin wrapper of a real store: counts the keys each operation touches, by kind
    (``stacks``, ``steps``, ``other``), into a shared `Counter`; its watcher counts into the
    same one (the watch's reads are this node's too)."""

    def __init__(self, inner: Store, counts: Counter):
        self.inner, self.counts = inner, counts
        self._lock = threading.Lock()

    def _n(self, *keys: str) -> None:
        with self._lock:
            for key in keys:
                self.counts[_kind(key)] += 1

    def get(self, key):
        self._n(key)
        return self.inner.get(key)

    def get_many(self, keys):
        self._n(*keys)
        return self.inner.get_many(keys)

    def compare_and_set(self, key, expected_version, value):
        self._n(key)
        return self.inner.compare_and_set(key, expected_version, value)

    def set_once(self, key, value):
        self._n(key)
        return self.inner.set_once(key, value)

    def add(self, key, delta):
        self._n(key)
        return self.inner.add(key, delta)

    def wait_for_change(self, key, version, timeout):
        self._n(key)
        return self.inner.wait_for_change(key, version, timeout)

    def liveness(self, node_id, dead_after):
        return self.inner.liveness(node_id, dead_after)

    def delete_prefix(self, prefix):
        self._n(prefix)
        self.inner.delete_prefix(prefix)

    def watcher(self):
        if not hasattr(self.inner, "watcher"):
            return self  # a store without watchers (the code before them)
        w = self.inner.watcher()
        return self if w is self.inner else Counting(w, self.counts)

    def interrupt(self):
        if hasattr(self.inner, "interrupt"):
            self.inner.interrupt()

    def close(self):
        self.inner.close()


class Node:
    """One agent's diagnostics: its rendezvous (over a counted store), one local rank that
    beats every tick through a real progress file, `StepWatch` and `StackRequests`."""

    def __init__(self, store: Store, node_rank: int, tmp: Path, run_id: str):
        self.counts: Counter = Counter()
        nodes = tuple(NodeDesc(f"node{i}", "127.0.0.1", 1) for i in range(NUM_NODES))
        settings = RendezvousSettings(run_id=run_id, min_nodes=1, max_nodes=NUM_NODES)
        self.rdzv = Rendezvous(Counting(store, self.counts), settings, nodes[node_rank],
                               host_bootstrap=lambda: ("127.0.0.1", 0))  # fmt: skip
        self.info = RendezvousInfo(run_id, 0, 0, node_rank, nodes, "127.0.0.1", 1)
        self.rdzv.info = self.info
        log_dir = tmp / f"node{node_rank}"
        self.watch = ProgressWatch([log_dir], timeout=None)
        self.progress = log_dir / "progress"
        spec = SimpleNamespace(local_rank=0, global_rank=node_rank, log_dir=log_dir, node_rank=0)
        self.group = SimpleNamespace(specs=[spec])
        self.steps = StepWatch("vm", emit=lambda kind, **fields: None)
        self.stacks = StackRequests()
        self.beats = 0
        self.answered = 0

    def take(self) -> list[dict]:
        self.answered += 1
        return []

    def tick(self) -> None:
        self.beats += 1
        self.progress.write_bytes(self.beats.to_bytes(8, "little") + bytes(32))
        self.steps.tick(self.rdzv, self.info, self.group, self.watch)
        self.stacks.answer(self.rdzv, self.info.num_nodes, self.take)

    def diagnostics(self) -> int:
        return self.counts["stacks"] + self.counts["steps"]


def _run(nodes: list[Node], seconds: float, until=lambda: False) -> float:
    start = time.monotonic()
    while time.monotonic() - start < seconds and not until():
        for node in nodes:
            node.tick()
        time.sleep(TICK_S)
    return time.monotonic() - start


def _check_traffic_and_latency(stores: list[Store], asker: Store, tmp_path: Path, run_id: str):
    nodes = [Node(store, rank, tmp_path, run_id) for rank, store in enumerate(stores)]
    asker.set_once(closed_key(job_prefix(run_id), 0), encode_members(list(nodes[0].info.nodes)))
    try:
        took = _run(nodes, RUN_SECONDS)
        worker, rank0 = nodes[1], nodes[0]
        per_s = worker.diagnostics() / took
        print(f"node rank 1: {worker.counts['stacks']} stacks-key and {worker.counts['steps']} "
              f"step-times operations in {took:.1f} s ({per_s:.2f}/s); node rank 0: "
              f"{rank0.counts['steps']} step-times keys read")  # fmt: skip
        # a node: its first step times and the watch's first read and wait, nothing more
        # (then one wait a WATCH_PIECE_S and one write a publish_interval: 64 s at 1024
        # nodes); before, ~2 a second (~16 in 8 s)
        assert worker.diagnostics() <= 5, worker.counts
        assert worker.counts["steps"] >= 1, worker.counts  # it did publish
        # node rank 0 also reads every node's step times, once per interval (64 s at 1024
        # nodes: 16 keys a second); before, every 2 s (4 x 1024 keys in 8 s)
        assert NUM_NODES <= rank0.counts["steps"] <= NUM_NODES + 8, rank0.counts
        assert worker.answered == rank0.answered == 0

        # a `meshrun stacks` request, written as the command writes it
        prefix = job_prefix(run_id)
        current = asker.get(stacks_request_key(prefix))
        value = json.dumps({"id": "req1", "round": 0}).encode()
        asked = time.monotonic()
        asker.compare_and_set(stacks_request_key(prefix), current.version if current else 0,
                              value)  # fmt: skip
        answers = [stacks_answer_key(prefix, "req1", r) for r in (0, 1)]
        _run(nodes, 30, until=lambda: all(asker.get(k) is not None for k in answers))
        latency = time.monotonic() - asked
        print(
            f"a stacks request answered by both nodes {latency * 1e3:.0f} ms after it was written"
        )
        assert all(asker.get(k) is not None for k in answers)
        assert latency < 3.0  # the watch wakes at once; generous for a loaded machine
        assert worker.answered == rank0.answered == 1
        _run(nodes, 1.0)
        assert worker.answered == rank0.answered == 1  # once each
    finally:
        for node in nodes:
            node.rdzv.close()


def test_tcpstore_diagnostics_cost_a_bounded_number_of_operations_per_node(tmp_path):
    from meshrun.rendezvous.c10d import TCPStoreBackend

    host = TCPStoreBackend("127.0.0.1", 0, is_host=True, timeout=5.0)
    clients = [TCPStoreBackend("127.0.0.1", host.port, is_host=False, timeout=5.0)
               for _ in range(2)]  # fmt: skip
    try:
        _check_traffic_and_latency([host, clients[0]], clients[1], tmp_path, "traffic")
    finally:
        for c in clients:
            c.close()
        host.close()


def test_etcd_diagnostics_cost_a_bounded_number_of_operations_per_node(tmp_path, etcd_server):
    from meshrun.rendezvous.etcd import EtcdOptions, EtcdStore

    run_id = "traffic"
    options = EtcdOptions.from_conf(etcd_server.endpoint, {}, read_timeout=5.0)
    stores = [EtcdStore(options, job_prefix(run_id)) for _ in range(3)]
    try:
        _check_traffic_and_latency(stores[:2], stores[2], tmp_path, run_id)
    finally:
        for s in stores:
            s.close()


def test_a_key_watch_sees_each_change_and_its_close_ends_a_blocked_tcpstore_wait():
    """The watch's thread waits inside TCPStore's C++ on a connection of its own; close shuts
    that connection down, so the thread ends at once (one left inside TCPStore at the
    interpreter's exit could abort the process), not after its 60 s wait."""
    from meshrun.rendezvous.c10d import TCPStoreBackend
    from meshrun.rendezvous.store import KeyWatch

    host = TCPStoreBackend("127.0.0.1", 0, is_host=True, timeout=5.0)
    try:
        watch = KeyWatch(host.watcher, "/k", piece=60.0).start()
        assert watch.wait_ready(10) and watch.latest is None
        for n in range(1, 4):
            current = host.get("/k")
            host.compare_and_set("/k", current.version if current else 0, b"v%d" % n)
            deadline = time.monotonic() + 10
            while (watch.latest is None or watch.latest.value != b"v%d" % n) and (
                time.monotonic() < deadline
            ):
                time.sleep(0.01)
            assert watch.latest.value == b"v%d" % n and watch.latest.version == n
        time.sleep(0.3)  # blocked in the wait again
        started = time.monotonic()
        watch.close()
        assert not watch.running and time.monotonic() - started < 2.0
        assert watch.error is None
    finally:
        host.close()


def test_a_key_watch_through_the_secret_sees_the_opened_value_on_a_connection_of_its_own():
    from meshrun.rendezvous.auth import AuthenticatedStore
    from meshrun.rendezvous.c10d import TCPStoreBackend
    from meshrun.rendezvous.store import KeyWatch

    host = TCPStoreBackend("127.0.0.1", 0, is_host=True, timeout=5.0)
    auth = AuthenticatedStore(host, b"s" * 32, "job")
    try:
        watcher = auth.watcher()
        assert isinstance(watcher, AuthenticatedStore) and watcher.inner is not host
        watch = KeyWatch(lambda: watcher, "/req").start()
        assert watch.wait_ready(10)
        auth.compare_and_set("/req", 0, b'{"id": "x"}')
        deadline = time.monotonic() + 10
        while watch.latest is None and time.monotonic() < deadline:
            time.sleep(0.01)
        assert watch.latest.value == b'{"id": "x"}'  # opened, not the sealed bytes
        watch.close()
        assert not watch.running
    finally:
        host.close()


def test_a_key_watch_on_a_store_that_is_its_own_watcher_leaves_it_open():
    from meshrun.rendezvous.store import KeyWatch, MemoryStore

    class Closing(MemoryStore):
        closed = False

        def close(self):
            self.closed = True

    store = Closing()
    watch = KeyWatch(store.watcher, "/k", shared=store, piece=0.2).start()
    assert watch.wait_ready(10)
    store.compare_and_set("/k", 0, b"v")
    deadline = time.monotonic() + 10
    while watch.latest is None and time.monotonic() < deadline:
        time.sleep(0.01)
    assert watch.latest.value == b"v"
    watch.close()
    assert not watch.running and not store.closed  # the caller's store stays open
