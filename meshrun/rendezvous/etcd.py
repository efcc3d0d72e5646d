"""The store contract on etcd's v3 API (the ``etcd`` backend, also ``etcd-v3``).

etcd is reached through its JSON gateway (`meshrun.rendezvous.etcd_gateway`: the client, its
options, auth, TLS and failover between members); node liveness on leases is
`meshrun.rendezvous.etcd_liveness`. This module is what the protocol sees: `EtcdStore`, and
`open_etcd_store` that builds it from ``--rdzv-endpoint`` and ``--rdzv-conf``.

The contract on etcd (`meshrun.rendezvous.store`):

- a key's version is its ``mod_revision``; ``compare_and_set`` is one transaction comparing it
  (0, "absent", compares ``create_revision == 0``), whose failure branch reads the current value;
- a register entry (`Store.register`) is the key ``<prefix><name>``, created in one
  transaction only if absent; its position is the number of the prefix's keys at its create
  revision (read in the same transaction, or, when a retry finds the key already there, at the
  key's ``create_revision``), and ``entries`` is one range sorted by create revision. A join
  is one request however many nodes join at once, and a retry after a lost reply finds the key
  and counts nothing twice;
- ``add`` is a compare-and-set loop on the counter's ``mod_revision`` that writes, in the same
  transaction, a key naming this call: when a retry's compare fails because the earlier try
  was applied (its reply lost), that key says so and the call returns that try's count;
- every request that cannot reach a member, or times out, is sent again to the next member,
  so every write here is safe to apply twice: a put of the same value, a "create if absent",
  a compare on a revision, a delete;
- ``get_many`` is one read-only transaction of ranges;
- ``wait_for_change`` reads once, then *watches* the key from the next revision, bounded by the
  timeout: waiting costs no requests at all until something changes (the read is what lets
  the watch start at the current revision: a watch from an older one makes etcd replay the
  history since, for every waiting node);
- liveness (`meshrun.rendezvous.etcd_liveness`): each node has a lease and the key
  ``<prefix>liveness/<node_id>`` bound to it; a node is alive while its key exists;
- nothing outlives the job: every key the store writes is bound to a job-wide lease, shared
  through the key ``<prefix>lease`` and kept alive by every live agent, so after ``kill -9``
  of every agent all the job's keys vanish within the lease's TTL; after a normal end the last
  node out deletes the prefix (`Rendezvous.leave`) and revokes the lease.
"""

from __future__ import annotations

import math
import random
import threading
import time
import uuid

from meshrun.rendezvous.api import RendezvousError, StoreGoneError
from meshrun.rendezvous.etcd_gateway import (
    EtcdError,
    EtcdOptions,
    Gateway,
    Item,
    b64,
    parse_endpoints,
    range_end,
    unb64,
)
from meshrun.rendezvous.etcd_liveness import JOINING, EtcdLiveness, liveness_key
from meshrun.rendezvous.store import Liveness, Store, Versioned

TXN_MAX_OPS = 128  # etcd's default --max-txn-ops: more operations in one transaction fail


_HISTORY_EVENTS = 256  # writes of one key replayed at most by `EtcdStore.last_value`
_HISTORY_WAIT_S = 2.0  # history is served at once; this only ends a watch with no event


def open_etcd_store(endpoint: str, settings, *, job_lease: bool = True) -> EtcdStore:
    """The `EtcdStore` of the run ``settings.run_id`` (prefix ``/meshrun/<run_id>/``, the
    protocol's) at ``--rdzv-endpoint``, with the settings' ``--rdzv-conf`` keys.

    Raises:
        ValueError: a malformed endpoint or TLS/credential options (a usage error).
        RendezvousError: etcd refused us or cannot be reached (exit 3).
    """
    options = EtcdOptions.from_conf(endpoint, settings.extra, settings.read_timeout)
    from meshrun.rendezvous.c10d import check_resolves

    for host, port in options.endpoints:  # a name that does not resolve: said at once
        check_resolves(host, port, "the etcd member")
    return EtcdStore(options, f"/meshrun/{settings.run_id}/", job_lease=job_lease)



class EtcdStore(Store):
    """The store contract on etcd v3 (see the module docstring).

    Args:
        options: the members, TLS and credentials (`EtcdOptions`).
        prefix: the job's key prefix (``/meshrun/<run_id>/``): its job-wide lease is kept under
            ``<prefix>lease`` and its liveness keys under ``<prefix>liveness/``.
        job_lease: join (or create) the job-wide lease and bind every write to it. False for
            read-only use (``meshrun status``), which must not keep a finished job's keys alive.
        job_ttl: the job lease's TTL in seconds (default: ``read_timeout``, at least 5 s): how
            long the job's keys outlive the last agent that was killed.
    Raises:
        RendezvousError: refused credentials or certificate; `StoreLostError`: no member
            answers within ``read_timeout``.
    """

    outlives_agents = True  # the last node out deletes the job's keys

    def __init__(
        self,
        options: EtcdOptions,
        prefix: str,
        *,
        job_lease: bool = True,
        job_ttl: int | None = None,
    ):
        if not prefix.endswith("/"):
            raise ValueError(f"EtcdStore prefix {prefix!r}: must end with '/'")
        self.options = options
        self.prefix = prefix
        self._gw = Gateway(options)
        self.job_ttl = max(5, job_ttl or math.ceil(options.read_timeout))
        self.job_lease = 0
        self._lease_lost = False
        self._stop = threading.Event()
        self._refresher: threading.Thread | None = None
        self._livenesses: list[EtcdLiveness] = []
        if job_lease:
            self.job_lease = self._join_job_lease()
            self._refresher = threading.Thread(
                target=self._refresh_job_lease, name="meshrun-etcd-lease", daemon=True
            )
            self._refresher.start()

    # -- the job lease ---------------------------------------------------------------------------
    def _join_job_lease(self) -> int:
        """The job's lease: the one in ``<prefix>lease``, or a new one put there by us."""
        key = self.prefix + "lease"
        while True:
            current = self._get(key)
            if current is not None:
                # ours is bound to the lease it names (it goes when that expires); anything
                # else was written by another program and would be waited on for ever
                value = bytes(current.value)
                if not value.isdigit() or int(value) != current.lease:
                    raise RendezvousError(
                        f"{key} in {self.options.describe()} holds {value[:40]!r}, not this "
                        "job's lease (another program wrote it); give the job another --rdzv-id"
                    )
                if self._gw.keepalive(current.lease) > 0:
                    return current.lease
                time.sleep(0.05)  # it expired just now: its key goes with it
                continue
            lease = self._gw.grant(self.job_ttl)
            ok, _, _ = self._cas(key, 0, str(lease).encode(), lease=lease)
            if ok:
                return lease
            self._gw.revoke(lease)

    def _refresh_job_lease(self) -> None:
        gw: Gateway | None = None  # its own connection, made (and logged in) at first use
        # the first refresh at a random moment of the period: agents started together (srun,
        # a pod set) would otherwise refresh together, a burst of N requests every TTL/3
        first = random.uniform(0.1, 1.0) * self.job_ttl / 3
        try:
            while not self._stop.wait(first or self.job_ttl / 3):
                first = 0
                try:
                    gw = gw or Gateway(self.options)
                    if gw.keepalive(self.job_lease) <= 0 and self._lease_gone(gw):
                        self._lease_lost = True
                        return
                except RendezvousError:
                    continue  # the store's own calls report a lost store
        finally:
            if gw is not None:
                gw.close()

    def _lease_gone(self, gw: Gateway) -> bool:
        """Whether the job lease really expired: a keep-alive that came back without a TTL
        (an overloaded member's reply) is asked again with ``lease/timetolive``, which says
        -1 only for a lease that no longer exists (one agent of a chaos soak under heavy load
        gave up a job whose lease the others still kept)."""
        result = gw.call("lease/timetolive", {"ID": str(self.job_lease)})
        return int(result.get("TTL", -1)) <= 0 and "grantedTTL" not in result

    # the lease calls on a given connection (``gw``), as the tests call them
    _keepalive = staticmethod(Gateway.keepalive)
    _revoke = staticmethod(Gateway.revoke)

    def _check_lease(self) -> None:
        if self._lease_lost:
            raise StoreGoneError(
                f"rendezvous store lost: the job's keys in {self.options.describe()} are gone: "
                "the job's last node out deleted them (the job ended without this node), or "
                f"they expired (no agent refreshed the job's lease for {self.job_ttl} s)"
            )

    def _write_lease(self) -> dict:
        return {"lease": str(self.job_lease)} if self.job_lease else {}

    def _call(self, path: str, body: dict) -> dict:
        self._check_lease()
        try:
            return self._gw.call(path, body)
        except EtcdError as e:
            if "lease not found" in str(e):
                self._lease_lost = True
                self._check_lease()
            raise

    # -- reads and writes ------------------------------------------------------------------------
    def _range(self, key: str) -> tuple[Item | None, int]:
        result = self._call("kv/range", {"key": b64(key)})
        kvs = result.get("kvs") or []
        return (Item.from_kv(kvs[0]) if kvs else None), int(result["header"]["revision"])

    def _get(self, key: str) -> Item | None:
        return self._range(key)[0]

    def _cas(
        self, key: str, expected: int, value: bytes, lease: int | None = None
    ) -> tuple[bool, Item | None, int]:
        """One transaction: put if ``key``'s mod_revision is ``expected`` (0: absent).

        Returns (succeeded, the item now stored, the revision of the transaction).
        """
        compare = (
            {"target": "CREATE", "create_revision": "0"}
            if expected == 0
            else {"target": "MOD", "mod_revision": str(expected)}
        )
        put = {"key": b64(key), "value": b64(value)}
        lease = self.job_lease if lease is None else lease
        if lease:
            put["lease"] = str(lease)
        result = self._call(
            "kv/txn",
            {
                "compare": [{"key": b64(key), "result": "EQUAL", **compare}],
                "success": [{"request_put": put}],
                "failure": [{"request_range": {"key": b64(key)}}],
            },
        )
        revision = int(result["header"]["revision"])
        if result.get("succeeded"):
            return True, Item(value, revision, lease), revision
        kvs = (result.get("responses") or [{}])[0].get("response_range", {}).get("kvs") or []
        return False, (Item.from_kv(kvs[0]) if kvs else None), revision

    @staticmethod
    def _versioned(item: Item | None) -> Versioned | None:
        return None if item is None else Versioned(item.value, item.version)

    # -- the contract --------------------------------------------------------------------------
    def get(self, key: str) -> Versioned | None:
        return self._versioned(self._get(key))

    def get_many(self, keys: list[str]) -> list[Versioned | None]:
        """Read-only transactions of at most `TXN_MAX_OPS` ranges (etcd's default limit)."""
        out: list[Versioned | None] = []
        for start in range(0, len(keys), TXN_MAX_OPS):
            chunk = keys[start : start + TXN_MAX_OPS]
            result = self._call(
                "kv/txn",
                {"success": [{"request_range": {"key": b64(k)}} for k in chunk]},
            )
            for response in result.get("responses") or []:
                kvs = response.get("response_range", {}).get("kvs") or []
                out.append(self._versioned(Item.from_kv(kvs[0])) if kvs else None)
        return out

    def compare_and_set(self, key, expected_version, value):
        ok, item, _ = self._cas(key, expected_version, value)
        return ok, self._versioned(item)

    def add(self, key: str, delta: int) -> int:
        item = self._get(key)
        if delta == 0:
            return int(item.value) if item is not None else 0  # a read: nothing written
        applied = f"{key}@add/{uuid.uuid4().hex}"  # names this call (see the module docstring)
        while True:
            count = (int(item.value) if item is not None else 0) + delta
            compare = (
                {"target": "MOD", "mod_revision": str(item.version)}
                if item is not None
                else {"target": "CREATE", "create_revision": "0"}
            )
            result = self._call(
                "kv/txn",
                {
                    "compare": [{"key": b64(key), "result": "EQUAL", **compare}],
                    "success": [
                        {"request_put": self._put(key, str(count).encode())},
                        {"request_put": self._put(applied, str(count).encode())},
                    ],
                    "failure": [
                        {"request_range": {"key": b64(key)}},
                        {"request_range": {"key": b64(applied)}},
                    ],
                },
            )
            if not result.get("succeeded"):
                key_kvs, applied_kvs = (
                    r.get("response_range", {}).get("kvs") or [] for r in result["responses"]
                )
                if not applied_kvs:  # somebody else's write came first: try again
                    item = Item.from_kv(key_kvs[0]) if key_kvs else None
                    continue
                count = int(unb64(applied_kvs[0].get("value", "")))  # our earlier try
            self._call("kv/deleterange", {"key": b64(applied)})
            return count

    def _put(self, key: str, value: bytes) -> dict:
        put = {"key": b64(key), "value": b64(value)}
        if self.job_lease:
            put["lease"] = str(self.job_lease)
        return put

    def register(self, prefix: str, name: str, value: bytes) -> int:
        key = prefix + name
        count = {"key": b64(prefix), "range_end": range_end(prefix), "count_only": True}
        result = self._call(
            "kv/txn",
            {
                "compare": [{"key": b64(key), "result": "EQUAL", "target": "CREATE",
                             "create_revision": "0"}],
                "success": [{"request_put": self._put(key, value)}, {"request_range": count}],
                "failure": [{"request_range": {"key": b64(key), "keys_only": True}}],
            },
        )  # fmt: skip
        responses = result.get("responses") or []
        if result.get("succeeded"):  # the count includes our entry: the transaction saw its put
            return int(responses[1]["response_range"].get("count", 0))
        kv = responses[0]["response_range"]["kvs"][0]  # ours, from an earlier try
        at = self._call("kv/range", {**count, "revision": kv["create_revision"]})
        return int(at.get("count", 0))

    def count(self, prefix: str) -> int:
        body = {"key": b64(prefix), "range_end": range_end(prefix), "count_only": True}
        return int(self._call("kv/range", body).get("count", 0))

    def entries(self, prefix: str, limit: int, timeout: float) -> list[bytes]:
        if limit <= 0:
            return []
        body = {
            "key": b64(prefix), "range_end": range_end(prefix), "limit": str(limit),
            "sort_order": "ASCEND", "sort_target": "CREATE",
        }  # fmt: skip
        kvs = self._call("kv/range", body).get("kvs") or []
        if len(kvs) < limit:
            raise RendezvousError(
                f"{prefix}: {limit} entries expected, {len(kvs)} found (deleted meanwhile?)"
            )
        return [unb64(kv.get("value", "")) for kv in kvs]

    def wait_for_change(self, key, version, timeout):
        deadline = time.monotonic() + timeout
        item, revision = self._range(key)
        while (item.version if item else 0) == version:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                break
            changed, item_or_none, revision = self._watch(key, version, revision + 1, remaining)
            if changed:
                return self._versioned(item_or_none)
            if revision < 0:  # the stream broke: read again (from the next member)
                time.sleep(min(0.05, max(0.0, deadline - time.monotonic())))
                item, revision = self._range(key)
        return self._versioned(item)

    def _watch(
        self, key: str, version: int, start: int, timeout: float
    ) -> tuple[bool, Item | None, int]:
        self._check_lease()
        return self._gw.watch(key, version, start, timeout)

    @property
    def current_member(self) -> int:
        """The index in ``options.endpoints`` of the member this store talks to now."""
        return self._gw.current

    def watcher(self) -> EtcdStore:
        """A client of its own (its own connections, no job lease of its own: it only reads)
        for a `KeyWatch`; its watch ends within the watch's timeout."""
        return EtcdStore(self.options, self.prefix, job_lease=False, job_ttl=self.job_ttl)

    def liveness(self, node_id: str, dead_after: float) -> Liveness:
        live = EtcdLiveness(self.options, self.prefix, node_id, dead_after, self.job_lease)
        self._livenesses.append(live)
        return live

    def liveness_of(self, node_id: str) -> tuple[int, int] | str | None:
        """``node_id``'s liveness key as `meshrun status` shows it: None when it is gone,
        "joining" while it says `JOINING` (a member that has not beaten yet, or a joiner that
        died before it was one), else the (remaining, granted) seconds of its lease."""
        item = self._get(liveness_key(self.prefix, node_id))
        if item is None:
            return None
        if item.value == JOINING:
            return "joining"
        if not item.lease:
            return (-1, -1)
        result = self._call("kv/lease/timetolive", {"ID": str(item.lease)})
        return int(result.get("TTL", -1)), int(result.get("grantedTTL", -1))

    def last_value(self, key: str, since_version: int) -> bytes | None:
        """From etcd's history: a watch from revision ``since_version`` (the key's
        mod_revision when this client read it) replays the key's writes since, up to its
        delete. A late node whose job's keys the last node out deleted reads there how the
        job ended (etcd keeps the history until a compaction; etcd's own clients resume
        watches the same way). Each watch goes to a member that answers a plain read first
        (`Gateway.call`: fail-over, and a fresh token where the idle one expired); a stream
        that breaks is tried on the next member. None when the history was compacted past
        that revision, or no member serves it; then nothing can be said."""
        if since_version <= 0:
            return None
        version, start, last = 0, since_version, None
        broken, checked = 0, False
        for _ in range(_HISTORY_EVENTS):
            if not checked:  # first, and after a broken stream
                try:
                    self._gw.call("kv/range", {"key": b64(key), "count_only": True})
                except RendezvousError:
                    return None
                checked = True
            changed, item, revision = self._gw.watch(key, version, start, _HISTORY_WAIT_S)
            if not changed:
                if revision >= 0:
                    return last  # no later write: the key still exists
                broken += 1  # the stream broke (the member failed over) or was compacted
                if broken >= len(self._gw.members):
                    return None
                checked = False
                continue
            if item is None:
                return last  # deleted: what it held before
            last, version, start = item.value, item.version, revision + 1
        return None

    def delete_prefix(self, prefix: str) -> None:
        self._call("kv/deleterange", {"key": b64(prefix), "range_end": range_end(prefix)})
        if prefix == self.prefix and self.job_lease:
            self._stop.set()
            self._gw.revoke(self.job_lease)  # the job is over: its lease goes too

    def close(self) -> None:
        self._stop.set()
        if self._refresher is not None:
            self._refresher.join(timeout=2)
        for live in self._livenesses:
            live.close()
        self._gw.close()


__all__ = ["EtcdLiveness", "EtcdOptions", "EtcdStore", "open_etcd_store", "parse_endpoints"]
