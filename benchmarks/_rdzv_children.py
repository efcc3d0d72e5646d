"""Child processes of ``benchmarks/rendezvous.py``: a store host, a group of agent threads, and
a lone agent that is killed (dead-node detection).

``--impl``: ``meshrun`` (meshrun's protocol on a TCPStore, the c10d backend), ``etcd``
(meshrun's protocol on etcd v3 through its JSON gateway, ``--endpoint host:port``; the parent
runs the etcd server, so there is no store-host for it) or ``torch`` (torch's dynamic
rendezvous on a TCPStore).

Each runs in its own process so that a stuck case (torch's rendezvous at large N) can be killed
by the parent without polluting later measurements, and so that the store server does not
share a GIL with the agents it serves. The parent talks to them over stdin/stdout, one line
per message:

    store-host   -> "PORT <port>"; serves until its stdin closes.
    agents       -> "READY"; <- "GO"; -> "RANKED <idx> <node_rank> <t_done> <ops...>" per agent
                    (t_done: time.time()), "ERROR <idx> <message>"; <- "EXIT".
                    meshrun and etcd: <ops...> = protocol ops, heartbeat ops, raw store calls
                    (TCPStore calls; etcd: HTTP requests of the protocol), t_joined, t_closed;
                    etcd adds the heartbeat's HTTP requests.
    victim       -> "RANKED <node_rank>"; then sleeps until killed (kill -9 by the parent).
"""

from __future__ import annotations

import argparse
import functools
import os
import resource
import sys
import threading
import time
from datetime import timedelta
from pathlib import Path

os.environ.setdefault("TORCH_CPP_LOG_LEVEL", "ERROR")


def raise_fd_limit() -> int:
    """Raise RLIMIT_NOFILE to the hard limit (each agent holds two sockets); return it."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft < hard:
        resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    return resource.getrlimit(resource.RLIMIT_NOFILE)[0]


def say(*parts: object) -> None:
    with _print_lock:
        sys.stdout.write(" ".join(str(p) for p in parts) + "\n")
        sys.stdout.flush()


_print_lock = threading.Lock()


# -- the store host ------------------------------------------------------------------------------


def store_host(impl: str, timeout: float) -> None:
    """Host a TCPStore on 127.0.0.1 (port chosen by the OS) until stdin closes."""
    raise_fd_limit()
    if impl == "etcd":
        raise SystemExit("store-host: etcd is run by the parent (benchmarks/rendezvous.py)")
    if impl == "meshrun":
        from meshrun.rendezvous.c10d import TCPStoreBackend

        store = TCPStoreBackend("127.0.0.1", 0, is_host=True, timeout=timeout)
        port = store.port
    else:
        import torch.distributed as dist

        # what torch's c10d rendezvous backend creates (_create_tcp_store): a multi-tenant
        # TCPStore, libuv by default
        store = dist.TCPStore(
            "127.0.0.1",
            0,
            is_master=True,
            multi_tenant=True,
            timeout=timedelta(seconds=timeout),
            wait_for_workers=False,
        )
        port = store.port
    say("PORT", port)
    sys.stdin.readline()  # until the parent closes our stdin (or dies)


# -- counting wrappers ---------------------------------------------------------------------------


class _CallCounter:
    """Counts calls made through a TCPStore client (proxy on the raw torch object)."""

    def __init__(self, inner):
        self._inner = inner
        self.calls = 0

    def __getattr__(self, name):
        attr = getattr(self._inner, name)
        if callable(attr):

            def counted(*args, **kwargs):
                self.calls += 1
                return attr(*args, **kwargs)

            return counted
        return attr


@functools.cache
def _counting_classes():
    """(SplitCountingStore, BeatCounting), built on first use (meshrun imported lazily).

    `CountingStore` is test code (``tests/rendezvous/counting_store.py``), not meshrun's."""
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests" / "rendezvous"))
    from counting_store import CountingStore

    from meshrun.rendezvous.store import Liveness

    class BeatCounting(Liveness):
        def __init__(self, owner, inner):
            self._owner, self._inner = owner, inner

        def joining(self):
            self._owner.beat_ops += 1
            return self._inner.joining()

        def beat(self):
            self._owner.beat_ops += 1
            self._inner.beat()

        def is_alive(self, node_id):
            self._owner.beat_ops += 1
            return self._inner.is_alive(node_id)

        def close(self):
            self._inner.close()

    class SplitCountingStore(CountingStore):
        """`CountingStore` whose heartbeat-thread ops go to ``beat_ops`` (their number grows
        with elapsed time, 2 per second, not with N), so ``ops`` is the protocol's own.
        ``make_liveness(node_id, dead_after)`` builds the heartbeat's inner liveness."""

        beat_ops = 0
        t_joined = t_closed = 0.0  # phases: when this agent had joined / saw the close

        def __init__(self, inner, make_liveness):
            super().__init__(inner)
            self._make_liveness = make_liveness

        def register(self, prefix, name, value):
            out = super().register(prefix, name, value)
            if prefix.endswith("/node/") and not self.t_joined:
                self.t_joined = time.time()
            return out

        def _saw(self, key, item):
            if item is not None and key.endswith("/closed") and not self.t_closed:
                self.t_closed = time.time()

        def get(self, key):
            out = super().get(key)
            self._saw(key, out)
            return out

        def get_many(self, keys):
            out = super().get_many(keys)
            for key, item in zip(keys, out, strict=True):
                self._saw(key, item)
            return out

        def wait_for_change(self, key, version, timeout):
            out = super().wait_for_change(key, version, timeout)
            self._saw(key, out)
            return out

        def liveness(self, node_id, dead_after):
            return BeatCounting(self, self._make_liveness(node_id, dead_after))

    return SplitCountingStore, BeatCounting


def meshrun_counting_store(port: int, timeout: float, preconnect: bool = True):
    """One agent's client: ``CountingStore`` (contract ops, heartbeat ops counted apart) over a
    ``TCPStoreBackend`` whose raw TCPStore calls are counted too.

    The heartbeat's own connection (``TCPStoreBackend.liveness`` opens it inside
    ``next_round``) is opened here, before the clock starts, like every torch client: on this
    sandbox many TCPStore connects at once from one process stall 5-10 s in reverse-DNS
    lookups inside torch's socket code, which would measure the sandbox, not the protocol.
    """
    from meshrun.rendezvous.c10d import TCPStoreBackend
    from meshrun.rendezvous.store import CounterLiveness

    split_counting_store, _ = _counting_classes()
    backend = TCPStoreBackend("127.0.0.1", port, is_host=False, timeout=timeout)
    if preconnect:
        beat_client = TCPStoreBackend("127.0.0.1", port, is_host=False, timeout=timeout)

    def make_liveness(node_id, dead_after):
        if not preconnect:
            return backend.liveness(node_id, dead_after)
        # what TCPStoreBackend.liveness builds, on the client connected beforehand
        return CounterLiveness(beat_client, node_id, dead_after, prefix="/liveness/")

    counter = _CallCounter(backend._store)  # benchmark-only peek: raw TCPStore calls
    backend._store = counter
    return split_counting_store(backend, make_liveness), counter


class _GatewayCounter:
    """Counts the HTTP requests one etcd gateway connection
    (`meshrun.rendezvous.etcd_gateway.Gateway`) makes: every ``call`` (one POST) and ``stream`` (one watch POST). Benchmark-only peek: the
    instance's methods are wrapped in place."""

    def __init__(self, gw):
        self.calls = 0
        call, stream = gw.call, gw.stream

        def counted_call(*args, **kwargs):
            self.calls += 1
            return call(*args, **kwargs)

        def counted_stream(*args, **kwargs):
            self.calls += 1
            return stream(*args, **kwargs)

        gw.call, gw.stream = counted_call, counted_stream


# The job lease's TTL for part 1's etcd agents: what the default read_timeout (10 s) gives
# (EtcdStore: max(5, ceil(read_timeout))); the agents' read_timeout itself is the case's timeout,
# as for the TCPStore clients, so a slow answer under load is waited for, not a lost store.
ETCD_JOB_TTL = 10


def etcd_counting_store(endpoint: str, run_id: str, timeout: float):
    """One agent's etcd client: ``CountingStore`` (contract ops, heartbeat ops apart) over an
    ``EtcdStore`` (what ``open_etcd_store`` builds, job lease TTL ``ETCD_JOB_TTL``) whose HTTP
    requests are counted: the protocol's (the store's own connection) and the heartbeat's (the
    liveness's connection, opened inside ``next_round`` as in the agent). The store's
    constructor joins the job lease (2-3 requests): setup, before the clock. Not counted: the
    job-lease refresher's keep-alive, one per ``ETCD_JOB_TTL / 3`` s on its own connection."""
    from meshrun.rendezvous.etcd import EtcdOptions, EtcdStore

    split_counting_store, _ = _counting_classes()
    options = EtcdOptions.from_conf(endpoint, {}, timeout)
    store = EtcdStore(options, f"/meshrun/{run_id}/", job_ttl=ETCD_JOB_TTL)
    counter = _GatewayCounter(store._gw)
    beat_http: list[_GatewayCounter] = []

    def make_liveness(node_id, dead_after):
        live = store.liveness(node_id, dead_after)
        beat_http.append(_GatewayCounter(live._gw))
        return live

    counting = split_counting_store(store, make_liveness)
    counting.beat_http = beat_http
    return counting, counter


def torch_counting_backend(port: int, run_id: str, timeout: float):
    """One agent's torch client: a TCPStore and a C10dRendezvousBackend counting store calls
    and the bytes of rendezvous state they carried."""
    import torch.distributed as dist
    from torch.distributed.elastic.rendezvous.c10d_rendezvous_backend import (
        C10dRendezvousBackend,
    )

    class CountingBackend(C10dRendezvousBackend):
        ops = 0
        nbytes = 0

        def _call_store(self, store_op, *args, **kwargs):
            self.ops += 1
            out = super()._call_store(store_op, *args, **kwargs)
            self.nbytes += len(out) if isinstance(out, (bytes, str)) else 0
            self.nbytes += sum(len(a) for a in args[1:] if isinstance(a, (bytes, str)))
            return out

    store = dist.TCPStore(
        "127.0.0.1",
        port,
        is_master=False,
        timeout=timedelta(seconds=timeout),
        wait_for_workers=False,
    )
    backend = CountingBackend(store, run_id)
    backend.ops = backend.nbytes = 0  # the constructor's sentinel write is setup, not a round
    return store, backend


def connect_all(connect, count: int) -> list:
    """``[connect(i) for i in range(count)]``, 32 at a time: a connect here now and then waits
    out a DNS timeout inside torch's socket code (see the parent's ``--res-options``), and
    overlapping them keeps the setup of 1024 agents short. Not timed."""
    from concurrent.futures import ThreadPoolExecutor

    with ThreadPoolExecutor(32) as pool:
        return list(pool.map(connect, range(count)))


# -- a group of agent threads --------------------------------------------------------------------


def agents(
    impl: str,
    port: int,
    run_id: str,
    n: int,
    first: int,
    count: int,
    timeout: float,
    connect_in_round: bool = False,
    endpoint: str = "",
) -> None:
    """Run agents ``first .. first+count-1`` of an ``n``-node rendezvous, one thread each
    (``endpoint``: etcd's ``host:port``, for ``impl == "etcd"``)."""
    raise_fd_limit()
    threading.stack_size(512 * 1024)  # 2 threads per agent; keep the address space small
    go = threading.Event()
    runners = []
    if impl in ("meshrun", "etcd"):
        from meshrun.rendezvous.api import NodeDesc, RendezvousSettings
        from meshrun.rendezvous.protocol import Rendezvous

        settings = RendezvousSettings(
            run_id, min_nodes=n, max_nodes=n, join_timeout=timeout, read_timeout=timeout
        )
        if impl == "meshrun":
            clients = connect_all(
                lambda _: meshrun_counting_store(port, timeout, not connect_in_round), count
            )
        else:
            clients = connect_all(lambda _: etcd_counting_store(endpoint, run_id, timeout), count)
        for i, (store, counter) in zip(range(first, first + count), clients, strict=True):
            rdzv = Rendezvous(
                store,
                settings,
                NodeDesc(f"agent{i}", "127.0.0.1", 1),
                host_bootstrap=lambda: ("127.0.0.1", 1),
            )
            runners.append((i, rdzv, store, counter))

        def run(i, rdzv, store, counter):
            go.wait()
            try:
                info = rdzv.next_round()
                t = time.time()
                extra = [sum(c.calls for c in store.beat_http)] if impl == "etcd" else []
                say(
                    "RANKED",
                    i,
                    info.node_rank,
                    repr(t),
                    store.ops,
                    store.beat_ops,
                    counter.calls,
                    repr(store.t_joined),
                    repr(store.t_closed),
                    *extra,
                )
            except BaseException as e:  # noqa: BLE001
                say("ERROR", i, f"{type(e).__name__}: {e}".replace("\n", " "))
    else:
        from torch.distributed.elastic.rendezvous.dynamic_rendezvous import (
            DynamicRendezvousHandler,
            RendezvousTimeout,
        )

        clients = connect_all(lambda _: torch_counting_backend(port, run_id, timeout), count)
        for i, (store, backend) in zip(range(first, first + count), clients, strict=True):
            handler = DynamicRendezvousHandler.from_backend(
                run_id,
                store,
                backend,
                min_nodes=n,
                max_nodes=n,
                local_addr="127.0.0.1",
                timeout=RendezvousTimeout(join=timedelta(seconds=timeout)),
            )
            runners.append((i, handler, store, backend))

        def run(i, handler, store, backend):
            go.wait()
            try:
                info = handler.next_rendezvous()
                t = time.time()
                say("RANKED", i, info.rank, repr(t), backend.ops, backend.nbytes)
            except BaseException as e:  # noqa: BLE001
                say("ERROR", i, f"{type(e).__name__}: {e}".replace("\n", " "))

    threads = [threading.Thread(target=run, args=r, daemon=True) for r in runners]
    for t in threads:
        t.start()
    say("READY")
    sys.stdin.readline()  # GO
    go.set()
    sys.stdin.readline()  # EXIT (or EOF)
    if impl in ("meshrun", "etcd"):
        for _, rdzv, _, _ in runners:
            rdzv.close()
    os._exit(0)  # torch's keep-alive timers and stuck threads must not hold the exit


# -- the agent that dies -------------------------------------------------------------------------


def victim(impl: str, port: int, run_id: str, timeout: float, endpoint: str = "") -> None:
    """One agent of a 2-node rendezvous that reports its rank and then waits to be killed."""
    if impl == "etcd":
        from meshrun.rendezvous.api import NodeDesc, RendezvousSettings
        from meshrun.rendezvous.etcd import open_etcd_store
        from meshrun.rendezvous.protocol import Rendezvous

        settings = RendezvousSettings(run_id, min_nodes=2, max_nodes=2)  # the defaults
        rdzv = Rendezvous(
            open_etcd_store(endpoint, settings),
            settings,
            NodeDesc(f"victim{os.getpid()}", "127.0.0.1", 1),
            host_bootstrap=lambda: ("127.0.0.1", 1),
        )
        rank = rdzv.next_round().node_rank
    elif impl == "meshrun":
        from meshrun.rendezvous.api import NodeDesc, RendezvousSettings
        from meshrun.rendezvous.c10d import TCPStoreBackend
        from meshrun.rendezvous.protocol import Rendezvous

        store = TCPStoreBackend("127.0.0.1", port, is_host=False, timeout=timeout)
        rdzv = Rendezvous(
            store,
            RendezvousSettings(run_id, min_nodes=2, max_nodes=2),
            NodeDesc(f"victim{os.getpid()}", "127.0.0.1", 1),
            host_bootstrap=lambda: ("127.0.0.1", 1),
        )
        rank = rdzv.next_round().node_rank
    else:
        handler = torch_handler(port, run_id, 2, timeout)
        rank = handler.next_rendezvous().rank
    say("RANKED", rank)
    while True:
        time.sleep(3600)


def torch_handler(port: int, run_id: str, n: int, timeout: float):
    """A torch DynamicRendezvousHandler (c10d backend, defaults) with its own TCPStore client."""
    import torch.distributed as dist
    from torch.distributed.elastic.rendezvous.c10d_rendezvous_backend import (
        C10dRendezvousBackend,
    )
    from torch.distributed.elastic.rendezvous.dynamic_rendezvous import (
        DynamicRendezvousHandler,
        RendezvousTimeout,
    )

    store = dist.TCPStore(
        "127.0.0.1",
        port,
        is_master=False,
        timeout=timedelta(seconds=timeout),
        wait_for_workers=False,
    )
    backend = C10dRendezvousBackend(store, run_id)
    return DynamicRendezvousHandler.from_backend(
        run_id,
        store,
        backend,
        min_nodes=n,
        max_nodes=n,
        local_addr="127.0.0.1",
        timeout=RendezvousTimeout(join=timedelta(seconds=timeout)),
    )


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("role", choices=["store-host", "agents", "victim"])
    p.add_argument("--impl", choices=["meshrun", "etcd", "torch"], required=True)
    p.add_argument("--port", type=int, default=0)
    p.add_argument("--endpoint", default="", help="etcd's host:port (--impl etcd)")
    p.add_argument("--run-id", default="bench")
    p.add_argument("--n", type=int, default=2)
    p.add_argument("--first", type=int, default=0)
    p.add_argument("--count", type=int, default=0)
    p.add_argument("--timeout", type=float, default=120.0)
    p.add_argument("--connect-in-round", action="store_true")
    a = p.parse_args()
    if a.role == "store-host":
        store_host(a.impl, a.timeout)
    elif a.role == "agents":
        agents(
            a.impl,
            a.port,
            a.run_id,
            a.n,
            a.first,
            a.count,
            a.timeout,
            a.connect_in_round,
            a.endpoint,
        )
    else:
        victim(a.impl, a.port, a.run_id, a.timeout, a.endpoint)


if __name__ == "__main__":
    main()
