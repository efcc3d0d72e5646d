"""Node liveness on etcd leases: the `Liveness` that `meshrun.rendezvous.etcd.EtcdStore` gives.

Each node has a lease (TTL ``ceil(dead_after)``, at least `MIN_TTL` s; etcd raises shorter TTLs
to its own minimum) and the key ``<prefix>liveness/<node_id>`` bound to it; ``beat()`` is a
lease keep-alive, and a node is alive while its key exists. No etcd client keeps a lease alive
in the background; the agent's keep-alive loop does, through ``beat()``.

A node that is only joining (no round has it as a member yet) need not beat: nobody asks about
it until a round closes with it. ``joining()`` writes its key with the value `JOINING`, bound
to the job's lease, and the node's first ``beat()`` (once it is a member) binds the key to its
own lease. A node whose key still says `JOINING` is alive for ``joining_grace`` =
``max(dead_after, read_timeout)`` seconds from the asker's first look, then lost: it died
before it was a member. A live member may be that slow to read the membership and begin
beating (3 s apart between the first and the last of 1024 nodes on 2 cores), and a grace of
``dead_after`` alone would restart such a round for nothing; and it ends before the others
give up waiting for node rank 0 to publish the workers' store (`Rendezvous._wait_for_master`,
``read_timeout + dead_after``), so a node rank 0 that died while it joined moves the round on
instead of failing the rendezvous. So a thousand nodes joining at once do not also keep a
thousand leases alive while they wait (at 1024 nodes those keep-alives were half of etcd's
requests); a node that dies while it joins is found lost up to ``joining_grace`` after the
round closes with it.

Apart from the store because it runs on connections of its own, with traffic of its own
(keep-alives, and a watch per node asked about; see `EtcdLiveness`).
"""

from __future__ import annotations

import math
import threading
import time

from meshrun.rendezvous.api import RendezvousError, StoreLostError
from meshrun.rendezvous.etcd_gateway import EtcdError, EtcdOptions, Gateway, Item, b64
from meshrun.rendezvous.store import Liveness

MIN_TTL = 2  # seconds; etcd's own minimum is 1.5 x its election timeout, rounded up
JOINING = b"joining"  # a joiner's liveness value, bound to the job's lease (module docstring)


def liveness_key(prefix: str, node_id: str) -> str:
    """The key that exists while ``node_id`` of the job under ``prefix`` is alive."""
    return f"{prefix}liveness/{node_id}"


class EtcdLiveness(Liveness):
    """A node's lease and its key ``<prefix>liveness/<node_id>``, on its own connection.

    The lease is refreshed at most every third of its TTL (as etcd's own clients keep leases
    alive), so a dead node's key is gone between 2/3 TTL and TTL after its last refresh.
    Another node is *watched*, not polled: the first `is_alive` reads its key, then a thread
    (`_KeyWatch`) waits for the key's DELETE on a watch. A node stopped being asked about for a
    TTL is no longer watched. N agents then cost etcd about N requests per TTL/3, not 2N per
    ``keep_alive_interval``.
    """

    def __init__(self, options: EtcdOptions, prefix: str, node_id: str, dead_after: float,
                 job_lease: int = 0):
        self._options = options
        self._prefix = prefix
        self._gw = Gateway(options)
        self._key = liveness_key(prefix, node_id)
        self._ttl = max(MIN_TTL, math.ceil(dead_after))
        self._every = self._ttl / 3  # seconds between refreshes, and between reads of a node
        self.joining_grace = max(dead_after, options.read_timeout)  # s (module docstring)
        self._job_lease = job_lease  # 0: no job lease, so no joining marker (it would stay)
        self._marked = False  # our key says JOINING (and is bound to the job lease)
        self._lease = 0
        self._refreshed = -math.inf  # time.monotonic() of the last refresh
        self._watches: dict[str, _KeyWatch] = {}
        self._closed = False

    def _attach(self) -> None:
        for _ in range(3):  # a lease that expired before our put (an overloaded etcd): again
            self._lease = self._gw.grant(self._ttl)
            body = {"key": b64(self._key), "value": b64(b"1"), "lease": str(self._lease)}
            try:
                self._gw.call("kv/put", body)
                return
            except EtcdError as e:
                if "lease not found" not in str(e):
                    raise
        raise StoreLostError(
            f"rendezvous store lost: {self._options.describe()} let three {self._ttl} s "
            "leases expire before a write bound to them (overloaded?)"
        )

    def joining(self) -> bool:
        """Mark this node as joining (module docstring): one write of its key, bound to the
        job's lease. False, with nothing written, when the store has no job lease."""
        if not self._job_lease:
            return False
        body = {"key": b64(self._key), "value": b64(JOINING), "lease": str(self._job_lease)}
        try:
            self._gw.call("kv/put", body)
        except EtcdError as e:
            if "lease not found" not in str(e):
                raise
            return False  # the job's lease is gone: the store's own calls say so, in its words
        self._marked = True
        return True

    def beat(self) -> None:
        if self._closed:
            return
        now = time.monotonic()
        if self._lease and now - self._refreshed < self._every:
            return
        if not self._lease or self._gw.keepalive(self._lease) <= 0:
            self._attach()  # first beat, or our lease expired (we were seen as dead)
        self._refreshed = now

    def is_alive(self, node_id: str) -> bool:
        now = time.monotonic()
        for other, watch in list(self._watches.items()):  # nodes nobody asks about any more
            if other != node_id and now - watch.asked > self._ttl:
                watch.close()
                del self._watches[other]
        watch = self._watches.get(node_id)
        if watch is not None and not watch.exists and watch.error is None:
            # a watch that saw the key go is final, but the node may be back: one that paused
            # past its TTL re-attaches under the same id (a cached verdict livelocked the job)
            watch.close()
            watch = None
        if watch is None:
            key = liveness_key(self._prefix, node_id)
            watch = _KeyWatch(self._gw, self._options, key, self.joining_grace)
            self._watches[node_id] = watch
        watch.asked = now
        if watch.error is not None:
            raise watch.error
        return watch.alive

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        for watch in self._watches.values():
            watch.close()
        try:
            if self._lease:
                self._gw.revoke(self._lease)  # its key goes with it
            elif self._marked:  # joined, never a member: the marker goes
                self._gw.call("kv/deleterange", {"key": b64(self._key)})
        except RendezvousError:
            pass
        self._gw.close()


class _KeyWatch:
    """Whether a node's liveness ``key`` exists, kept up to date by a watch on its own thread
    and connection; and whether it still says `JOINING`.

    The key is read once (on ``gw``, the caller's connection) when the watch is made; after
    that ``exists`` turns False when a watch sees the key deleted, or a re-read (after a broken
    stream) finds it gone. ``alive``: it exists, and it says JOINING for less than ``grace``
    seconds since this watch first read it so. A store that stops answering sets ``error``
    (`StoreLostError`).
    """

    _WAIT = 5.0  # seconds per watch request (then another, from the same revision)

    def __init__(self, gw: Gateway, options: EtcdOptions, key: str, grace: float):
        self.key = key
        self.asked = time.monotonic()
        self.error: RendezvousError | None = None
        self._options = options
        self._stop = threading.Event()
        self._grace_ends: float | None = None  # set while the key says JOINING
        item, revision = self._read(gw)
        self.exists = item is not None
        if item is not None and item.value == JOINING:
            self._grace_ends = self.asked + grace
        if item is not None:
            threading.Thread(
                target=self._run, args=(revision + 1, item.version), name="meshrun-etcd-watch",
                daemon=True,
            ).start()  # fmt: skip

    @property
    def alive(self) -> bool:
        return self.exists and (self._grace_ends is None or time.monotonic() < self._grace_ends)

    def _read(self, gw: Gateway) -> tuple[Item | None, int]:
        """(the key as read, None when it does not exist; the read's revision)."""
        result = gw.call("kv/range", {"key": b64(self.key)})
        kvs = result.get("kvs") or []
        return (Item.from_kv(kvs[0]) if kvs else None), int(result["header"]["revision"])

    def _run(self, start: int, version: int) -> None:
        gw = Gateway(self._options)
        try:
            while not self._stop.is_set() and self.exists:
                changed, item, revision = gw.watch(self.key, version, start, self._WAIT)
                if changed:
                    if item is None:
                        self.exists = False  # deleted: its lease expired, or it left
                    else:
                        version, start = item.version, revision + 1
                        if item.value != JOINING:
                            self._grace_ends = None  # it beats: a member now
                elif revision < 0:  # the stream broke: read again (from the next member)
                    item, revision = self._read(gw)
                    self.exists = item is not None
                    if item is not None:
                        version = item.version
                        if item.value != JOINING:
                            self._grace_ends = None
                    start = revision + 1
        except RendezvousError as e:
            self.error = e
        finally:
            gw.close()

    def close(self) -> None:
        self._stop.set()


__all__ = ["JOINING", "MIN_TTL", "EtcdLiveness", "liveness_key"]
