"""etcd requests that etcd applied but whose reply was lost, retried on the next member.

A `ReplyDropper` proxy stands in front of the real etcd as the first listed member: it forwards
a chosen request and loses its reply, so the client times out and retries on the second member
(the same etcd, directly). Every write of the store and of the protocol must then count once:
a join, an exit-barrier ``done``, a counter increment.
"""

from __future__ import annotations

import threading
import time

import pytest
from etcd_fixtures import ETCD, SKIP_REASON
from reply_dropper import ReplyDropper, puts_under

from meshrun.rendezvous import NodeDesc, Rendezvous, RendezvousSettings
from meshrun.rendezvous.etcd import EtcdOptions, EtcdStore

pytestmark = [pytest.mark.timeout(60), pytest.mark.skipif(ETCD is None, reason=SKIP_REASON)]

PREFIX = "/meshrun/job/"
READ_TIMEOUT = 3.0  # a lost reply is given up after max(1, read_timeout / 2) = 1.5 s


@pytest.fixture
def dropper(etcd_server):
    """make(prefix) -> a `ReplyDropper` in front of etcd losing the reply of the first
    transaction that puts a key under ``prefix``."""
    proxies = []

    def make(prefix: str) -> ReplyDropper:
        proxies.append(ReplyDropper(etcd_server.endpoint, puts_under(prefix)))
        return proxies[-1]

    yield make
    for p in proxies:
        p.close()


def store_at(endpoints: str) -> EtcdStore:
    options = EtcdOptions.from_conf(endpoints, {}, read_timeout=READ_TIMEOUT)
    return EtcdStore(options, PREFIX)


def settings(n: int) -> RendezvousSettings:
    return RendezvousSettings(
        run_id="job", min_nodes=n, max_nodes=n, last_call_timeout=0.2, join_timeout=20,
        keep_alive_interval=0.5, keep_alive_max_attempt=6, read_timeout=READ_TIMEOUT,
    )  # fmt: skip


def node(store: EtcdStore, name: str, n: int = 2) -> Rendezvous:
    me = NodeDesc(node_id=name, addr="127.0.0.1", nproc=1)
    return Rendezvous(store, settings(n), me, host_bootstrap=lambda: ("127.0.0.1", 4000))


def on_thread(fn) -> tuple[threading.Thread, list]:
    out: list = []

    def run():
        try:
            out.append(fn())
        except BaseException as e:  # noqa: BLE001 - returned to the test
            out.append(e)

    t = threading.Thread(target=run, daemon=True)
    t.start()
    return t, out


def test_add_whose_reply_was_lost_counts_once(etcd_server, dropper):
    proxy = dropper(PREFIX + "n")
    store = store_at(f"{proxy.endpoint},{etcd_server.endpoint}")
    other = store_at(etcd_server.endpoint)
    try:
        assert store.add(PREFIX + "n", 1) == 1
        assert proxy.dropped, "the proxy lost no reply: the test tested nothing"
        assert other.add(PREFIX + "n", 0) == 1
        assert store.add(PREFIX + "n", 2) == 3
    finally:
        store.close()
        other.close()


def test_join_whose_reply_was_lost_ranks_every_node_once(etcd_server, dropper):
    """Before: the retried join drew a second number, node #1's slot was never written, and
    the round could not close (RendezvousError on every node)."""
    proxy = dropper(PREFIX + "r0/")
    a_store = store_at(f"{proxy.endpoint},{etcd_server.endpoint}")
    b_store = store_at(etcd_server.endpoint)
    a, b = node(a_store, "a"), node(b_store, "b")
    try:
        ta, ra = on_thread(a.next_round)
        while not proxy.dropped and ta.is_alive():
            time.sleep(0.01)
        tb, rb = on_thread(b.next_round)
        ta.join(30)
        tb.join(30)
        assert proxy.dropped
        (info_a,), (info_b,) = ra, rb
        assert not isinstance(info_a, BaseException), info_a
        assert not isinstance(info_b, BaseException), info_b
        assert info_a.nodes == info_b.nodes
        assert [d.node_id for d in info_a.nodes] == ["a", "b"]  # a joined first
        assert {info_a.node_rank, info_b.node_rank} == {0, 1}
    finally:
        for x in (a, b, a_store, b_store):
            x.close()


def test_done_whose_reply_was_lost_does_not_end_the_job(etcd_server, dropper):
    """Before: the retried ``done`` counted twice, so the first node to succeed ended the job
    while the other's workers still ran (whose next poll then raised JobFinished)."""
    proxy = dropper(PREFIX + "r0/done")
    a_store = store_at(f"{proxy.endpoint},{etcd_server.endpoint}")
    b_store = store_at(etcd_server.endpoint)
    a, b = node(a_store, "a"), node(b_store, "b")
    try:
        ta, _ = on_thread(a.next_round)
        b.next_round()
        ta.join(30)
        barrier, result = on_thread(lambda: a.exit_barrier(0.1))
        while not proxy.dropped and barrier.is_alive():
            time.sleep(0.01)
        time.sleep(2.5)  # past the lost reply's timeout and the retry
        assert proxy.dropped
        assert barrier.is_alive(), f"a left the exit barrier alone: {result}"
        assert b.read_state()[0].status == "running"
        assert b.poll() is None
        assert b.exit_barrier(0.1) is None
        barrier.join(10)
        assert result == [None]
        assert b.read_state()[0].status == "succeeded"
    finally:
        for x in (a, b, a_store, b_store):
            x.close()
