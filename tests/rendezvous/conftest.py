"""Stores for the shared contract suite: every backend runs the same tests."""

import pytest

from meshrun.rendezvous.store import MemoryStore


def make_tcpstore():
    from meshrun.rendezvous.c10d import TCPStoreBackend

    host = TCPStoreBackend("127.0.0.1", 0, is_host=True, timeout=5.0)
    return host, lambda: TCPStoreBackend("127.0.0.1", host.port, is_host=False, timeout=5.0)


@pytest.fixture(params=["memory", "tcpstore"])
def store_pair(request):
    """(store, connect) where connect() returns another client of the same store."""
    if request.param == "memory":
        store = MemoryStore()
        yield store, lambda: store
    else:
        store, connect = make_tcpstore()
        yield store, connect
        store.close()
