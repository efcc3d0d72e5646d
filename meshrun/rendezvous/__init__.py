"""Membership: which nodes are in each round, their node ranks, and the job's restart budget.

Public API: `open_store` (pick and connect the backend's store), `Rendezvous` (the protocol),
`RendezvousInfo`, `RendezvousSettings`, `NodeDesc`, and the errors. Backends: ``static``
(fixed node ranks; store hosted by node rank 0 at MASTER_ADDR:MASTER_PORT), ``c10d`` (TCPStore
hosted by the agent on the ``--rdzv-endpoint`` host), ``etcd`` (etcd's v3 API, see
`meshrun.rendezvous.etcd`) and, for one-node jobs, an in-process store that needs no network
at all.
"""

from __future__ import annotations

from meshrun.rendezvous.api import (
    JobFailed,
    JobFinished,
    NodeDesc,
    RendezvousError,
    RendezvousInfo,
    RendezvousSettings,
    RendezvousTimeoutError,
    StoreGoneError,
    StoreLostError,
    settings_from_conf,
)
from meshrun.rendezvous.protocol import Rendezvous
from meshrun.rendezvous.store import MemoryStore, Store

__all__ = [
    "JobFailed",
    "JobFinished",
    "MemoryStore",
    "NodeDesc",
    "Rendezvous",
    "RendezvousError",
    "RendezvousInfo",
    "RendezvousSettings",
    "RendezvousTimeoutError",
    "Store",
    "StoreGoneError",
    "StoreLostError",
    "check_endpoint",
    "workers_port",
    "open_store",
    "settings_from_conf",
]


def open_store(
    backend: str,
    endpoint: str,
    settings: RendezvousSettings,
    *,
    node_rank: int | None = None,
) -> tuple[Store, str]:
    """Connect to (or host) the rendezvous store for ``backend``.

    Returns the store and the address other nodes should use to reach this node (the local
    address on the route to the store). ``endpoint`` is ``host:port``; for ``static`` it is
    MASTER_ADDR:MASTER_PORT and node rank 0 hosts the store. A job with one node (MAX = 1)
    gets an in-process store: nothing is listening, nothing can collide.

    With a shared secret (``--rdzv-conf secret_file=PATH`` or ``MESHRUN_RDZV_SECRET``), the
    store returned is an `meshrun.rendezvous.auth.AuthenticatedStore` around the backend's:
    every value is sealed with HMAC-SHA256 and checked on every read.

    Raises:
        RendezvousError: the store cannot be hosted or reached, or the secret file cannot be
            read any more (exit 3).
        ValueError: a malformed endpoint or an unknown backend (a usage error, exit 2).
    """
    if settings.max_nodes == 1:
        return MemoryStore(), "127.0.0.1"  # in-process: nobody else can reach it
    from meshrun.rendezvous.auth import AuthenticatedStore, load_secret

    try:
        secret = load_secret(settings.extra)  # checked at startup (check_endpoint); read again
    except ValueError as e:
        raise RendezvousError(str(e)) from None
    store, addr = _open_backend(backend, endpoint, settings, node_rank)
    if secret is not None:
        store = AuthenticatedStore(store, secret, settings.run_id)
    return store, addr


def _open_backend(
    backend: str, endpoint: str, settings: RendezvousSettings, node_rank: int | None
) -> tuple[Store, str]:
    from meshrun.rendezvous import c10d

    # The store an agent hosts listens on the endpoint's address only (§3.7), unless asked.
    bind_all = settings.bind_all
    if backend == "static":
        host, port = c10d.parse_endpoint(endpoint)
        store = c10d.TCPStoreBackend(
            host, port, is_host=(node_rank or 0) == 0, timeout=settings.read_timeout,
            bind_all=bind_all,
        )  # fmt: skip
        return store, c10d.outbound_address(host, port)
    if backend == "c10d":
        host, port = c10d.parse_endpoint(endpoint)
        is_host = _parse_bool(settings.extra.get("is_host"))
        if is_host is None:
            is_host = c10d.is_local_endpoint(host)
            if is_host:  # two agents on one host: the first to bind hosts, the other connects
                try:
                    store = c10d.TCPStoreBackend(
                        host, port, is_host=True, timeout=settings.read_timeout,
                        bind_all=bind_all,
                    )  # fmt: skip
                    return store, c10d.outbound_address(host, port)
                except RendezvousError:
                    is_host = False
        store = c10d.TCPStoreBackend(
            host, port, is_host=is_host, timeout=settings.read_timeout, bind_all=bind_all
        )
        return store, c10d.outbound_address(host, port)
    if backend in ("etcd", "etcd-v3"):
        from meshrun.rendezvous import etcd  # urllib3 is imported only here

        store = etcd.open_etcd_store(endpoint, settings)
        host, port = store.options.endpoints[store.current_member]
        return store, c10d.outbound_address(host, port)
    raise ValueError(f"--rdzv-backend {backend}: unknown backend (use static, c10d or etcd)")


def check_endpoint(backend: str, endpoint: str, settings: RendezvousSettings) -> None:
    """Check the endpoint and backend options without connecting (a usage error, exit 2).

    Raises:
        ValueError: a malformed endpoint, backend options that cannot work together, or a
            shared secret that cannot be used (`meshrun.rendezvous.auth.load_secret`).
    """
    from meshrun.rendezvous.auth import load_secret

    load_secret(settings.extra)
    workers_port(settings)
    if settings.max_nodes == 1 and backend != "etcd":
        return
    _parse_bool(settings.extra.get("bind_all"), "bind_all")
    if backend in ("static", "c10d"):
        from meshrun.rendezvous.c10d import parse_endpoint

        parse_endpoint(endpoint)
        _parse_bool(settings.extra.get("is_host"))
    elif backend == "etcd":
        from meshrun.rendezvous.etcd import EtcdOptions

        if not endpoint:
            raise ValueError("--rdzv-backend etcd needs --rdzv-endpoint HOST:PORT[,HOST:PORT...]")
        EtcdOptions.from_conf(endpoint, settings.extra, settings.read_timeout)


def workers_port(settings: RendezvousSettings) -> int:
    """``--rdzv-conf workers_port=N``: the port node rank 0's agent hosts the workers' store on
    every round (a pod's declared port), or 0 (the OS picks one per round).

    Raises:
        ValueError: not a port number 1..65535.
    """
    text = settings.extra.get("workers_port")
    if text is None:
        return 0
    try:
        port = int(text)
    except ValueError:
        port = -1
    if not 0 < port < 65536:
        raise ValueError(f"--rdzv-conf workers_port={text}: give a port number 1..65535")
    return port


def _parse_bool(text: str | None, key: str = "is_host") -> bool | None:
    if text is None:
        return None
    lowered = text.strip().lower()
    if lowered in ("1", "true", "yes", "y", "on"):
        return True
    if lowered in ("0", "false", "no", "n", "off"):
        return False
    raise ValueError(f"--rdzv-conf {key}={text}: expected true or false")
