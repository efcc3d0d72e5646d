"""The keys of old rounds are deleted: a long elastic job's store does not grow with rounds.

Two nodes go through many rounds (each moved on by a membership change, as a node joining or
lost would), each round ending with the exit barrier's first half; the number of keys under the
job's prefix must stay bounded, on every backend (the in-memory store, a real TCPStore, a real
etcd).
"""

from __future__ import annotations

import uuid

import pytest
from etcd_fixtures import ETCD, SKIP_REASON
from test_protocol import run_all

from meshrun.rendezvous import MemoryStore, NodeDesc, Rendezvous, RendezvousSettings

pytestmark = pytest.mark.timeout(90)

ROUNDS = 12


@pytest.fixture(params=["memory", "tcpstore", "etcd"])
def backend(request):
    """(run_id, [store per node], keys()) with keys() -> every key under the job's prefix."""
    run_id = f"gc{uuid.uuid4().hex[:6]}"
    prefix = f"/meshrun/{run_id}/"
    if request.param == "memory":
        store = MemoryStore()
        yield run_id, [store, store], lambda: [k for k in store.keys() if k.startswith(prefix)]
    elif request.param == "tcpstore":
        from meshrun.rendezvous.c10d import TCPStoreBackend

        host = TCPStoreBackend("127.0.0.1", 0, is_host=True, timeout=5.0)
        other = TCPStoreBackend("127.0.0.1", host.port, is_host=False, timeout=5.0)
        yield run_id, [host, other], lambda: [
            k for k in host._store.list_keys() if k.startswith(prefix)
        ]
        other.close()
        host.close()
    else:
        if ETCD is None:
            pytest.skip(SKIP_REASON)
        from meshrun.rendezvous.etcd import EtcdOptions, EtcdStore

        cluster = request.getfixturevalue("shared_etcd")
        options = EtcdOptions.from_conf(cluster.endpoint, {}, read_timeout=5.0)
        stores = [EtcdStore(options, prefix) for _ in range(2)]
        yield run_id, stores, lambda: cluster.keys(prefix)
        for s in stores:
            s.close()


def test_old_rounds_keys_are_deleted(backend):
    run_id, stores, keys = backend
    s = RendezvousSettings(
        run_id=run_id, min_nodes=2, max_nodes=2, last_call_timeout=0.05, join_timeout=10,
        keep_alive_interval=0.5, keep_alive_max_attempt=20,
    )  # fmt: skip
    nodes = [
        Rendezvous(st, s, NodeDesc(f"n{i}", "127.0.0.1", 1), lambda: ("127.0.0.1", 4000))
        for i, st in enumerate(stores)
    ]
    counts = []
    try:
        for round_ in range(ROUNDS):
            infos = run_all([n.next_round for n in nodes])
            assert [i.round for i in infos] == [round_, round_], infos
            for n in nodes:  # a few monitor ticks and a failure record, as a round has
                n.poll()
            nodes[1].publish_failures([{"global_rank": 1}])
            nodes[0].request_restart("a node is waiting", failure=False)
            counts.append(len(keys()))
    finally:
        for n in nodes:
            n.close()
    assert max(counts[4:]) <= counts[3], counts  # bounded: no growth after the first rounds
