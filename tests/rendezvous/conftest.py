"""Stores for the shared contract suite: every backend runs the same tests."""

import base64

import pytest
from etcd_fixtures import ETCD, SKIP_REASON, EtcdCluster, etcd_cluster3, etcd_server  # noqa: F401

from meshrun.rendezvous.store import MemoryStore

# Contract tests that time liveness below what etcd can: its leases last at least 2 s (etcd
# raises shorter TTLs to 1.5 x its election timeout); the etcd suite tests its own liveness.
_ETCD_TOO_FAST = {
    "test_liveness_sees_a_silent_node_die": "dead_after=0.4 s is below etcd's minimum lease "
    "TTL (2 s); see test_etcd_store.py::test_liveness_lease_expires",
}


def make_tcpstore():
    from meshrun.rendezvous.c10d import TCPStoreBackend

    host = TCPStoreBackend("127.0.0.1", 0, is_host=True, timeout=5.0)
    return host, lambda: TCPStoreBackend("127.0.0.1", host.port, is_host=False, timeout=5.0)


@pytest.fixture(scope="session")
def shared_etcd(tmp_path_factory):
    """One etcd member for the whole session's contract tests (each test wipes its keys)."""
    if ETCD is None:
        pytest.skip(SKIP_REASON)
    cluster = EtcdCluster(tmp_path_factory.mktemp("etcd-contract")).start()
    try:
        yield cluster
    finally:
        cluster.stop()


def make_etcdstore(cluster: EtcdCluster, prefix: str):
    from meshrun.rendezvous.etcd import EtcdOptions, EtcdStore

    options = EtcdOptions.from_conf(cluster.endpoint, {}, read_timeout=5.0)
    clients = []

    def connect():
        client = EtcdStore(options, prefix)
        clients.append(client)
        return client

    return connect(), connect, clients


@pytest.fixture(params=["memory", "tcpstore", "etcd"])
def store_pair(request):
    """(store, connect) where connect() returns another client of the same store."""
    if request.param == "memory":
        store = MemoryStore()
        yield store, lambda: store
    elif request.param == "tcpstore":
        store, connect = make_tcpstore()
        yield store, connect
        store.close()
    else:
        reason = _ETCD_TOO_FAST.get(getattr(request.function, "__name__", ""))
        if reason:
            pytest.skip(reason)
        cluster = request.getfixturevalue("shared_etcd")
        store, connect, clients = make_etcdstore(cluster, f"/contract/{request.node.name}/")
        yield store, connect
        for client in clients:
            client.close()
        everything = base64.b64encode(b"\0").decode()
        cluster.post("kv/deleterange", {"key": everything, "range_end": everything})
