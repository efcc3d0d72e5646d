"""The store contract the rendezvous protocol is written against, and an in-memory store.

The protocol needs these things from a store, and nothing more:

- ``get(key)`` -> the value and its *version* (a number that grows on every write);
- ``compare_and_set(key, expected_version, value)``: write only if nobody wrote since we read
  (``expected_version=0`` means "only if absent") -- the one primitive that decides races;
- a *register* (join order, barriers): ``register(prefix, name, value)`` creates the entry
  ``name`` unless it exists and returns its position in creation order (1, 2, ...);
  ``count(prefix)`` and ``entries(prefix, limit, timeout)`` read it back. Creating an entry
  that exists creates nothing, so a request retried after a lost reply counts once;
- ``wait_for_change(key, version, timeout)``: block until the key's version differs from
  ``version`` (0 waits for the key to appear), without polling where the store can notify;
- liveness: ``liveness(node_id, dead_after)`` gives a `Liveness` to beat for this node and to
  ask whether another node is still beating;
- ``delete_prefix(prefix)``: the keys of rounds nobody needs any more, and of a finished job.

``add(key, delta)`` (an atomic counter) is the stores' own primitive for heartbeat counters and
for emulating a register; the protocol does not count with it.

Registers, per store: etcd creates ``<prefix><name>`` in one transaction ("only if absent") and
orders entries by etcd's create revision. A store without revisions emulates it, as here by
default, with a counter and two write-once keys per entry: ``<prefix>n`` (``add``) draws the
position, ``<prefix>at/<position>`` holds the value and ``<prefix>id/<name>`` the position (read
first, so registering again returns the same position). Its client calls are never retried
(TCPStore, in-process), so the emulation's read-then-add cannot apply twice.

`MemoryStore` implements the contract in one process (tests, the fake-clock protocol tests, and
single-node jobs, which need no network store at all). ``c10d.TCPStoreBackend`` implements it on
torch's TCPStore, and the etcd backend on etcd v3 transactions, watches and leases.
"""

from __future__ import annotations

import abc
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

from meshrun.rendezvous.api import RendezvousError


@dataclass(frozen=True)
class Versioned:
    """A stored value and its version (>= 1; versions of one key only grow)."""

    value: bytes
    version: int


class Liveness(abc.ABC):
    """One node's heartbeat, and its view of other nodes' heartbeats.

    Mirrors torch elastic's keep-alive, but per node key rather than inside a shared state blob.
    """

    joining_grace: float  # seconds a node marked `joining` is alive from the first look

    @abc.abstractmethod
    def beat(self) -> None:
        """Record that this node is alive now. Called every ``keep_alive_interval`` seconds."""

    @abc.abstractmethod
    def is_alive(self, node_id: str) -> bool:
        """False once ``node_id`` has not beaten for ``dead_after`` seconds (of our clock). A
        node not seen beating yet is alive for ``joining_grace`` from the first question about
        it, when it is marked `joining` (etcd), or on any heartbeat counter (``dead_after``)."""

    def joining(self) -> bool:
        """Mark this node as joining, before its first `beat`: nobody asks about a node until
        a round closes with it, so a joiner need not beat until it is a member; others see it
        alive for ``joining_grace`` from their first look, then lost if it never beats.
        Returns whether the store marked it (then the caller beats once the node is a
        member); False (here): beat from the start."""
        return False

    def close(self) -> None:  # noqa: B027 - optional
        """Stop beating (a clean exit); other nodes will see this one as gone."""


class Store(abc.ABC):
    """The key/value contract of docs/design.md §3.2. Keys are str, values bytes.

    Every method may raise `meshrun.rendezvous.api.StoreLostError` when the store is gone.
    ``serves_others`` is True where this process hosts the store for other nodes (the c10d
    host): it must keep serving until they have read the job's outcome. ``outlives_agents``
    is True for a store that is not hosted by an agent (etcd): the job's last node out
    deletes its keys there; elsewhere the store goes with its host, and a client deleting keys
    the host may still be reading would only race it.
    """

    serves_others = False
    outlives_agents = False

    @abc.abstractmethod
    def get(self, key: str) -> Versioned | None:
        """The current value of ``key``, or None when it does not exist."""

    @abc.abstractmethod
    def compare_and_set(
        self, key: str, expected_version: int, value: bytes
    ) -> tuple[bool, Versioned | None]:
        """Write ``value`` if the key's version is ``expected_version`` (0: absent).

        Returns ``(True, new)`` on success, else ``(False, current)``.
        """

    @abc.abstractmethod
    def add(self, key: str, delta: int) -> int:
        """Atomically add ``delta`` to the counter ``key`` (created at 0); return the new value.

        Applied once per call, also when a request is retried after a lost reply."""

    @abc.abstractmethod
    def wait_for_change(self, key: str, version: int, timeout: float) -> Versioned | None:
        """Block up to ``timeout`` seconds until ``key``'s version is not ``version``.

        Returns the value then current (the unchanged one, or None, if the wait timed out).
        """

    def get_many(self, keys: list[str]) -> list[Versioned | None]:
        """Several keys in one operation where the store allows (one multi-get on TCPStore)."""
        return [self.get(key) for key in keys]

    def set_once(self, key: str, value: bytes) -> Versioned:
        """Create ``key`` if absent; return what is stored (ours or the earlier writer's)."""
        ok, current = self.compare_and_set(key, 0, value)
        assert current is not None
        return current

    # -- registers (see the module docstring) --------------------------------------------------
    def register(self, prefix: str, name: str, value: bytes) -> int:
        """Create the entry ``name`` of the register ``prefix`` unless it exists; return its
        position (1 = created first) among the entries, in creation order.

        Idempotent: registering ``name`` again creates nothing and returns the same position.
        ``prefix`` ends with "/"; ``name`` contains no "/". Positions are dense (1..count)
        while no entry is deleted.
        """
        known = self.get(f"{prefix}id/{name}")
        if known is not None:
            return parse_position(known.value, prefix)
        position = self.add(prefix + "n", 1)
        self.set_once(f"{prefix}at/{position}", value)
        self.set_once(f"{prefix}id/{name}", str(position).encode())
        return position

    def count(self, prefix: str) -> int:
        """The number of entries of the register ``prefix`` (0 when it has none)."""
        return self.add(prefix + "n", 0)

    def entries(self, prefix: str, limit: int, timeout: float) -> list[bytes]:
        """The values of the first ``limit`` entries of ``prefix``, in creation order.

        Raises:
            RendezvousError: fewer than ``limit`` entries within ``timeout`` seconds (an entry
                was counted but its writer died before writing it).
        """
        keys = [f"{prefix}at/{position}" for position in range(1, limit + 1)]
        items = self.get_many(keys)
        for i, item in enumerate(items):
            if item is None:  # counted, not yet written
                item = self.wait_for_change(keys[i], 0, timeout)
            if item is None:
                raise RendezvousError(
                    f"entry #{i + 1} of {prefix} was counted but never written within "
                    f"{timeout:g} s (its writer died?)"
                )
            items[i] = item
        return [item.value for item in items]

    @abc.abstractmethod
    def liveness(self, node_id: str, dead_after: float) -> Liveness:
        """A `Liveness` for ``node_id``; may open its own connection (it beats from a thread)."""

    def last_value(self, key: str, since_version: int) -> bytes | None:
        """The last value ``key`` held, from the store's history of its writes from version
        ``since_version`` (one this client read) on: the key may have been deleted since.
        None where the store keeps no history (TCPStore, memory), or no longer reaches back
        that far (etcd's compaction)."""
        return None

    def delete_prefix(self, prefix: str) -> None:  # noqa: B027 - optional where keys cannot be listed
        """Delete every key under ``prefix`` (old rounds; etcd: nothing may be left after a
        job). A store that cannot list its keys may keep them (they die with it)."""

    def watcher(self) -> Store:
        """A store for `wait_for_change` from another thread while this one is in use: its own
        connection where a blocked wait holds one (TCPStore), its own client elsewhere (etcd);
        this store itself where waits do not block others (memory). `KeyWatch` uses it.
        The caller closes what it got unless it is this store.

        Raises:
            StoreLostError: a new connection cannot be made.
        """
        return self

    #: Whether `interrupt` ends a wait blocked on another thread at once (a `KeyWatch` then
    #: waits for its thread at `close`; otherwise it leaves the daemon thread to its timeout).
    interrupts: bool = False

    def interrupt(self) -> None:  # noqa: B027 - optional
        """Make a `wait_for_change` blocked in this store on another thread return soon (it
        may raise `StoreLostError`); this store is closed afterwards. A store whose waits end
        within their timeout anyway need not do anything."""

    def close(self) -> None:  # noqa: B027
        """Release connections (a hosted store also stops serving)."""


#: Seconds one wait of a `KeyWatch` lasts before it is renewed (one read each time).
WATCH_PIECE_S = 30.0


class KeyWatch:
    """The latest value of one key, followed from a thread, so that a loop that must not
    block reads it (`latest`) without a store operation.

    The thread reads the key once, then calls ``wait_for_change`` past the version it holds,
    over and over, on a store of its own (``open_store()``, typically `Store.watcher`): on etcd
    a watch (no request until the key changes), on TCPStore a wait on its own connection
    (the server answers when the key's next change marker appears). Cost: one read when it
    starts, then one wait and one read after each change and every ``piece`` seconds of quiet
    (where the wait is renewed); nothing else, whatever the caller's tick.

    Args:
        open_store: called once, on the thread, for the store to wait on.
        key: the key followed.
        shared: the caller's own store: where ``open_store()`` returned it (a store whose
            `Store.watcher` is itself), `close` neither interrupts nor closes it.
        piece: seconds each wait lasts (`WATCH_PIECE_S`).

    Attributes:
        latest: the value last seen (None: absent, or not read yet; see `ready`).
        error: the store error that ended the thread, or None while it runs.
    """

    def __init__(
        self,
        open_store: Callable[[], Store],
        key: str,
        *,
        shared: Store | None = None,
        piece: float = WATCH_PIECE_S,
    ):
        self.key = key
        self.latest: Versioned | None = None
        self.error: BaseException | None = None
        self._open_store = open_store
        self._shared = shared
        self._piece = piece
        self._store: Store | None = None
        self._ready = threading.Event()
        self._stopped = False
        self._thread = threading.Thread(target=self._run, name="meshrun-key-watch", daemon=True)

    def start(self) -> KeyWatch:
        self._thread.start()
        return self

    @property
    def ready(self) -> bool:
        """Whether the first read is done (`latest` is then the key's value)."""
        return self._ready.is_set()

    @property
    def running(self) -> bool:
        """Whether the thread still runs (it ends at `close`, or on a store error)."""
        return self._thread.is_alive()

    def wait_ready(self, timeout: float) -> bool:
        """Block up to ``timeout`` seconds for the first read (tests); returns `ready`."""
        return self._ready.wait(timeout)

    def _run(self) -> None:
        try:
            self._store = self._open_store()
            if self._stopped:  # closed while it connected
                if self._store is not self._shared:
                    self._store.close()
                return
            item = self._store.get(self.key)
            self.latest = item
            self._ready.set()
            while not self._stopped:
                version = item.version if item is not None else 0
                item = self._store.wait_for_change(self.key, version, self._piece)
                if (item.version if item is not None else 0) != version:
                    self.latest = item
        except Exception as e:  # noqa: BLE001 - the caller falls back (and sees a lost store)
            if not self._stopped:
                self.error = e
        finally:
            self._ready.set()

    def close(self) -> None:
        """Stop the thread (its wait is interrupted where the store can), and close its store."""
        self._stopped = True
        store = self._store
        own = store is not None and store is not self._shared
        if own:
            store.interrupt()
        if self._thread.is_alive():
            # a wait that interrupt() ends (TCPStore: a thread left in its C++ at exit could
            # abort the process), or whose piece is short, is waited for; an etcd watch's HTTP
            # read is not interrupted, and its daemon thread, in Python, ends with its piece or
            # the process (a 2 s join here made an agent on etcd take 2-4 s to exit on SIGTERM)
            ends_soon = (own and store.interrupts) or self._piece < 2.0
            self._thread.join(timeout=2.0 if ends_soon else 0.05)
        if own:
            store.close()


def parse_position(raw: bytes, prefix: str) -> int:
    """A register position read back from the store (an entry's ``id`` key).

    Raises:
        RendezvousError: not a number (another program wrote it), one line.
    """
    text = bytes(raw).strip()
    if not text.isdigit():
        raise RendezvousError(
            f"a rendezvous value (a position in {prefix}) is malformed: {bytes(raw)[:40]!r}; "
            "another program is writing to the job's store"
        )
    return int(text)


class CounterLiveness(Liveness):
    """Liveness over any store's ``add``: a heartbeat counter per node.

    A watcher remembers the last counter value it saw for each node and when (its own
    monotonic clock) that value changed, so no clocks need to agree across hosts. Used by the
    in-memory and TCPStore backends; etcd uses leases instead.
    """

    def __init__(
        self,
        store: Store,
        node_id: str,
        dead_after: float,
        prefix: str,
        clock: Callable[[], float] = time.monotonic,
    ):
        self._store = store
        self._node_id = node_id
        self._dead_after = dead_after
        self._prefix = prefix
        self._clock = clock
        self._seen: dict[str, tuple[int, float]] = {}
        self.joining_grace = dead_after  # a counter not seen moving yet: from the first look

    def beat(self) -> None:
        self._store.add(self._prefix + self._node_id, 1)

    def is_alive(self, node_id: str) -> bool:
        count = self._store.add(self._prefix + node_id, 0)
        now = self._clock()
        last = self._seen.get(node_id)
        if last is None or last[0] != count:
            self._seen[node_id] = (count, now)
            return True
        return now - last[1] < self._dead_after

    def close(self) -> None:
        # A clean exit is told apart from a death by the exit barrier, not by liveness.
        pass


class MemoryStore(Store):
    """The store contract in one process: a dict, a lock and a condition variable.

    ``clock`` and ``sleep`` are injectable so the protocol can run under a fake clock; with
    the defaults it is an ordinary thread-safe store. Counts every operation in ``ops`` (per
    calling thread's node, see `ops_by`), which the O(1)-per-node tests read.
    """


    outlives_agents = True  # like etcd: shared by the nodes, hosted by none of them
    def __init__(self, clock: Callable[[], float] = time.monotonic):
        self._data: dict[str, Versioned] = {}
        self._lock = threading.Condition()
        self._clock = clock
        self._next_version = 1
        self.ops = 0

    def _write(self, key: str, value: bytes) -> Versioned:
        item = Versioned(value, self._next_version)
        self._next_version += 1
        self._data[key] = item
        self._lock.notify_all()
        return item

    def get(self, key: str) -> Versioned | None:
        with self._lock:
            self.ops += 1
            return self._data.get(key)

    def compare_and_set(self, key, expected_version, value):
        with self._lock:
            self.ops += 1
            current = self._data.get(key)
            current_version = current.version if current else 0
            if current_version != expected_version:
                return False, current
            return True, self._write(key, value)

    def add(self, key: str, delta: int) -> int:
        with self._lock:
            self.ops += 1
            current = self._data.get(key)
            count = (int(current.value) if current else 0) + delta
            if current is None or delta != 0:
                self._write(key, str(count).encode())
            return count

    def wait_for_change(self, key, version, timeout):
        deadline = self._clock() + timeout
        with self._lock:
            self.ops += 1
            while True:
                current = self._data.get(key)
                if (current.version if current else 0) != version:
                    return current
                remaining = deadline - self._clock()
                if remaining <= 0:
                    return current
                self._lock.wait(remaining)

    def liveness(self, node_id: str, dead_after: float) -> Liveness:
        return CounterLiveness(self, node_id, dead_after, "/liveness/", self._clock)

    def delete_prefix(self, prefix: str) -> None:
        with self._lock:
            self.ops += 1
            for key in [k for k in self._data if k.startswith(prefix)]:
                del self._data[key]
            self._lock.notify_all()

    def keys(self) -> list[str]:
        """Every key now stored (tests check that nothing is left behind)."""
        with self._lock:
            return sorted(self._data)
