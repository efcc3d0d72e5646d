"""The store contract on etcd's v3 API (the ``etcd`` backend, also ``etcd-v3``).

torch's etcd rendezvous backends speak etcd's v2 API only, which etcd 3.4 disables and 3.6
removes. meshrun speaks v3, through etcd's JSON gateway (``/v3/...``, served by every etcd
>= 3.4 on its client port), with the ``etcd3gw`` client.

Why ``etcd3gw``: it needs only ``requests`` -- no grpc, no protobuf. The gRPC clients pin or
break on protobuf: ``etcd3`` 0.12 (2020, unmaintained) fails to import with protobuf >= 4
unless ``PROTOCOL_BUFFERS_PYTHON_IMPLEMENTATION=python``; ``etcd-sdk-python`` needs
protobuf >= 5.27.2 without declaring it. A launcher is installed next to the user's own
packages, so it must not fight them over protobuf. The gateway costs about 1.4 ms per
operation, which is nothing next to a rendezvous. What etcd3gw lacks, this module adds over
the same gateway: user/password auth (``POST /v3/auth/authenticate``, the token sent as the
``Authorization`` header, re-authenticated when etcd says it is invalid or expired), failover
between cluster members, watches bounded by a timeout, and lease keep-alive (no etcd client
keeps a lease alive in the background; this store does, on its own thread).

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
  timeout: waiting costs no requests at all until something changes;
- liveness: each node has a lease (TTL ``ceil(dead_after)``, at least 2 s; etcd raises shorter
  TTLs to its own minimum) and the key ``<prefix>liveness/<node_id>`` bound to it; ``beat()``
  is a lease keep-alive, and a node is alive while its key exists;
- nothing outlives the job: every key the store writes is bound to a job-wide lease, shared
  through the key ``<prefix>lease`` and kept alive by every live agent, so after ``kill -9``
  of every agent all the job's keys vanish within the lease's TTL; after a normal end the last
  node out deletes the prefix (`Rendezvous.leave`) and revokes the lease.

Endpoints are ``host[:port]`` (default port 2379), comma-separated for a cluster: a request
that cannot reach a member goes to the next one, and the store keeps the one that works. Only
when no member answers for ``read_timeout`` seconds is the store lost (`StoreLostError`,
exit 3). ``--rdzv-conf`` keys: ``cacert``, ``cert``, ``key`` (TLS; https is used when any is
given, or with ``protocol=https``), ``user`` and the password: ``password_file=PATH``, the
variable ``MESHRUN_ETCD_PASSWORD``, or ``password=`` (torchrun's key; on the command line ``ps``
shows it). user/password over plain http is refused unless ``insecure=true``. A refused
password or certificate is a `RendezvousError` of one line.
"""

from __future__ import annotations

import base64
import json
import math
import os
import stat
import threading
import time
import uuid
from dataclasses import dataclass

from meshrun.rendezvous.api import RendezvousError, StoreLostError
from meshrun.rendezvous.store import Liveness, Store, Versioned

DEFAULT_PORT = 2379
TXN_MAX_OPS = 128  # etcd's default --max-txn-ops: more operations in one transaction fail
PASSWORD_ENV = "MESHRUN_ETCD_PASSWORD"  # the etcd password, when neither password= nor a file
MIN_TTL = 2  # seconds; etcd's own minimum is 1.5 x its election timeout, rounded up

# etcd error messages (gRPC status messages, passed through the gateway) that mean "this
# member cannot serve now, another may": retried on the next member within read_timeout.
_TRANSIENT = (
    "leader changed",
    "no leader",
    "request timed out",
    "too many requests",
    "not capable",
    "unhealthy cluster",
    "stopped",
    "timed out",
    "connection",
    "unavailable",
)
_AUTH_RETRY = ("invalid auth token", "auth token", "auth store is old", "user name is empty")


def _b64(data: bytes | str) -> str:
    if isinstance(data, str):
        data = data.encode()
    return base64.b64encode(data).decode()


def _unb64(text: str) -> bytes:
    return base64.b64decode(text)


def _range_end(prefix: str) -> str:
    end = bytearray(prefix.encode())
    end[-1] += 1
    return _b64(bytes(end))


def parse_endpoints(text: str) -> list[tuple[str, int]]:
    """``"h1:2379,h2,[::1]:2380"`` -> ``[("h1", 2379), ("h2", 2379), ("::1", 2380)]``.

    Raises:
        ValueError: an empty list or a malformed member, named in the message.
    """
    from meshrun.rendezvous.c10d import parse_endpoint

    items = [item.strip() for item in text.split(",") if item.strip()]
    if not items:
        raise ValueError("empty etcd endpoint; give --rdzv-endpoint HOST[:PORT][,HOST[:PORT]...]")
    out = []
    for item in items:
        for scheme in ("http://", "https://"):
            if item.startswith(scheme):
                item = item[len(scheme) :]
        out.append(parse_endpoint(item.rstrip("/"), default_port=DEFAULT_PORT))
    return out


@dataclass(frozen=True)
class EtcdOptions:
    """How to reach etcd: the members, TLS files and credentials, and the patience."""

    endpoints: tuple[tuple[str, int], ...]
    protocol: str = "http"
    cacert: str | None = None
    cert: str | None = None
    key: str | None = None
    user: str | None = None
    password: str | None = None
    read_timeout: float = 10.0

    @classmethod
    def from_conf(cls, endpoint: str, conf: dict[str, str], read_timeout: float) -> EtcdOptions:
        """From ``--rdzv-endpoint`` and the ``--rdzv-conf`` backend keys.

        Raises:
            ValueError: a malformed endpoint, ``cert`` without ``key``, an unknown protocol,
                a password without a user.
        """
        protocol = conf.get("protocol", "").strip().lower()
        tls = any(conf.get(k) for k in ("cacert", "cert", "key"))
        if protocol and protocol not in ("http", "https"):
            raise ValueError(f"--rdzv-conf protocol={protocol}: expected http or https")
        # a scheme in the endpoint (https://host:2379) says the protocol too: never dropped
        schemes = {m.split("://")[0].lower() for m in endpoint.split(",") if "://" in m}
        if len(schemes) > 1 or (schemes and protocol and schemes != {protocol}):
            raise ValueError(
                f"--rdzv-endpoint {endpoint}: its schemes and --rdzv-conf protocol= disagree; "
                "give one protocol for every member"
            )
        protocol = protocol or next(iter(schemes), "")
        if bool(conf.get("cert")) != bool(conf.get("key")):
            raise ValueError("--rdzv-conf cert and key: give both (a client certificate and its key)")
        if conf.get("password") and conf.get("password_file"):
            raise ValueError("--rdzv-conf password=*** and password_file: give one of them")
        password = conf.get("password")
        if conf.get("password_file"):
            password = _read_password_file(conf["password_file"])
        elif not password and os.environ.get(PASSWORD_ENV):
            password = os.environ[PASSWORD_ENV]
        if password and not conf.get("user"):
            raise ValueError("--rdzv-conf password: give user= too")
        protocol = protocol or ("https" if tls else "http")
        insecure = conf.get("insecure", "").strip().lower()
        if insecure not in ("", "1", "true", "yes", "y", "on", "0", "false", "no", "n", "off"):
            raise ValueError(f"--rdzv-conf insecure={conf['insecure']}: expected true or false")
        if conf.get("user") and protocol == "http" and insecure not in ("1", "true", "yes", "y", "on"):
            raise ValueError(
                "--rdzv-conf user=...: etcd user/password auth over plain http sends the "
                "password and the token unencrypted; give etcd TLS (cacert=PATH, or "
                "protocol=https), or insecure=true to send them in the clear anyway"
            )
        return cls(
            endpoints=tuple(parse_endpoints(endpoint)),
            protocol=protocol,
            cacert=conf.get("cacert") or None,
            cert=conf.get("cert") or None,
            key=conf.get("key") or None,
            user=conf.get("user") or None,
            password=password,
            read_timeout=read_timeout,
        )

    def __repr__(self) -> str:  # the password is never shown
        return f"EtcdOptions({self.describe()}, user={self.user!r})"

    def describe(self) -> str:
        hosts = ",".join(f"[{h}]:{p}" if ":" in h else f"{h}:{p}" for h, p in self.endpoints)
        return f"etcd at {self.protocol}://{hosts}"


def _read_password_file(path: str) -> str:
    """The etcd password in ``path`` (``--rdzv-conf password_file=PATH``), stripped.

    Raises:
        ValueError: missing, unreadable, not a regular file, or empty; one line.
    """
    where = f"--rdzv-conf password_file={path}"
    try:  # O_NONBLOCK: opening a FIFO must not wait for a writer (it is refused below)
        fd = os.open(path, os.O_RDONLY | os.O_NOCTTY | os.O_NONBLOCK)
    except FileNotFoundError:
        raise ValueError(f"{where}: no such file") from None
    except OSError as e:
        raise ValueError(f"{where}: cannot read it: {e.strerror or e}") from None
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):  # the file opened, not the path again
            raise ValueError(f"{where}: not a regular file")
        text = os.read(fd, 64 * 1024).strip()
    except OSError as e:
        raise ValueError(f"{where}: cannot read it: {e.strerror or e}") from None
    finally:
        os.close(fd)
    if not text:
        raise ValueError(f"{where}: the file is empty")
    return text.decode(errors="replace")


class _Gateway:
    """One connection (a requests session) to an etcd cluster's JSON gateway, with failover.

    Not shared between threads: the store, its liveness and its lease refresher each have one.
    """

    def __init__(self, options: EtcdOptions):
        import etcd3gw  # lazily: only the etcd backend needs it
        import requests

        self.options = options
        self._requests = requests
        session = requests.Session()
        # No proxies, .netrc or CA bundle from the environment: etcd is reached directly, and
        # an explicit cacert must win over REQUESTS_CA_BUNDLE (which requests lets override a
        # session's verify). Without cacert, the environment's bundle is still honoured.
        session.trust_env = False
        env_bundle = os.environ.get("REQUESTS_CA_BUNDLE") or os.environ.get("CURL_CA_BUNDLE")
        session.verify = options.cacert or env_bundle or True
        if options.cacert:
            session.verify = options.cacert
        if options.cert:
            session.cert = (options.cert, options.key)
        rt = options.read_timeout
        self.request_timeout = (min(2.0, max(0.5, rt / 4)), max(1.0, rt / 2))
        self.session = session
        self.clients = [
            etcd3gw.Etcd3Client(
                host=host,
                port=port,
                protocol=options.protocol,
                timeout=self.request_timeout,
                api_path="/v3/",  # etcd >= 3.4; saves a /version round trip per member
                session=session,
            )
            for host, port in options.endpoints
        ]
        self.current = 0
        self._exc = etcd3gw.exceptions
        if options.user:
            self._authenticate()

    # -- errors --------------------------------------------------------------------------------
    def _member(self, i: int) -> str:
        host, port = self.options.endpoints[i]
        return f"{host}:{port}"

    @staticmethod
    def _message(e: Exception) -> str:
        detail = getattr(e, "detail_text", None) or ""
        try:
            body = json.loads(detail)
            text = body.get("message") or body.get("error") or detail
        except (ValueError, AttributeError):
            text = detail or str(e) or type(e).__name__
        text = " ".join(str(text).split())
        return text.removeprefix("etcdserver: ")

    def _is_tls_error(self, e: Exception) -> bool:
        cause = e.__context__ or e
        return isinstance(cause, self._requests.exceptions.SSLError) or "SSL" in str(e)

    def _tls_error(self, i: int, e: Exception) -> RendezvousError:
        text = " ".join(str(e.__context__ or e).split())
        if "CERTIFICATE_VERIFY_FAILED" in text:
            why = "the server's certificate is not signed by the CA in --rdzv-conf cacert"
            if not self.options.cacert:
                why = "the server's certificate is not trusted (give --rdzv-conf cacert=CA.pem)"
        elif "certificate" in text.lower() or "alert" in text.lower():
            why = "the TLS handshake failed (is --rdzv-conf cert/key a client certificate " \
                  "the server trusts?)"
        else:
            why = "the TLS handshake failed"
        detail = text[text.find("[SSL"):].split(")")[0] if "[SSL" in text else text[:160]
        return RendezvousError(f"etcd at {self._member(i)}: {why} ({detail})")

    # -- calls ---------------------------------------------------------------------------------
    def _authenticate(self) -> None:
        self.session.headers.pop("Authorization", None)
        result = self.call(
            "auth/authenticate",
            {"name": self.options.user, "password": self.options.password or ""},
            _auth=False,
        )
        if result.get("token"):  # none when this etcd has auth off: then none is needed
            self.session.headers["Authorization"] = result["token"]

    def call(self, path: str, body: dict, *, _auth: bool = True) -> dict:
        """POST one v3 request to the current member, failing over to the others.

        Raises:
            RendezvousError: etcd refused us (credentials, certificate, permission).
            StoreLostError: no member answered within ``read_timeout``.
        """
        exc = self._exc
        deadline = time.monotonic() + self.options.read_timeout
        reauthenticated = False
        last = "no answer"
        n = len(self.clients)
        while True:
            for step in range(n):
                i = (self.current + step) % n
                client = self.clients[i]
                try:
                    result = client.post(client.get_url(path), json=body)
                    self.current = i
                    return result
                except (exc.ConnectionFailedError, exc.ConnectionTimeoutError) as e:
                    if self._is_tls_error(e):
                        raise self._tls_error(i, e) from None
                    last = f"{self._member(i)}: {_connection_reason(e)}"
                except exc.Etcd3Exception as e:
                    message = self._message(e)
                    lowered = message.lower()
                    if "authentication failed" in lowered or "invalid user id or password" in lowered:
                        raise RendezvousError(
                            f"etcd at {self._member(i)} refused user {self.options.user!r}: "
                            "wrong user name or password (--rdzv-conf user=..., password=...)"
                        ) from None
                    if "user name is empty" in lowered and not self.options.user:
                        raise RendezvousError(
                            f"etcd at {self._member(i)} requires authentication: give "
                            "--rdzv-conf user=NAME,password=SECRET"
                        ) from None
                    if "permission denied" in lowered:
                        raise RendezvousError(
                            f"etcd at {self._member(i)}: permission denied for user "
                            f"{self.options.user!r} on {path} (grant it a role on /meshrun/)"
                        ) from None
                    if "authentication is not enabled" in lowered and not _auth:
                        return {}
                    if _auth and self.options.user and not reauthenticated and any(
                        word in lowered for word in _AUTH_RETRY
                    ):
                        reauthenticated = True
                        self._authenticate()
                        return self.call(path, body)
                    if not any(word in lowered for word in _TRANSIENT):
                        raise _EtcdError(message) from None
                    last = f"{self._member(i)}: {message[:200]}"
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise StoreLostError(
                    f"rendezvous store lost: no member of {self.options.describe()} answered "
                    f"within read_timeout={self.options.read_timeout:g} s (last error: {last})"
                )
            time.sleep(min(0.2, remaining))

    def stream(self, path: str, body: dict, timeout: float):
        """A streaming POST (a watch) to the current member; returns the open response.

        Raises the ``requests`` exceptions as they are: the caller decides (timeout or loss).
        """
        client = self.clients[self.current]
        return self.session.post(
            client.get_url(path),
            json=body,
            stream=True,
            timeout=(self.request_timeout[0], max(0.05, timeout)),
        )

    def fail_over(self) -> None:
        """Move on to the next member (the current one broke a stream)."""
        self.current = (self.current + 1) % len(self.clients)

    def close(self) -> None:
        self.session.close()


def _connection_reason(e: BaseException) -> str:
    """A short reason for a failed connection ("connection refused", "timed out", ...)."""
    text = " ".join(str(e.__context__ or e).split())
    for needle, short in (
        ("refused", "connection refused"),
        ("Name or service not known", "unknown host"),
        ("Temporary failure in name resolution", "unknown host"),
        ("timed out", "timed out"),
        ("reset by peer", "connection reset"),
        ("RemoteDisconnected", "connection closed by the server"),
        ("Service Unavailable", "member unavailable"),
    ):
        if needle in text:
            return short
    detail = getattr(e, "detail_text", None)
    return " ".join(str(detail or text).split())[:160]


class _EtcdError(RendezvousError):
    """etcd answered with an error that no other member would answer differently."""


@dataclass(frozen=True)
class _Item:
    value: bytes
    version: int  # mod_revision
    lease: int


def _item(kv: dict) -> _Item:
    return _Item(_unb64(kv.get("value", "")), int(kv["mod_revision"]), int(kv.get("lease", 0)))


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
        self._gw = _Gateway(options)
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
                lease = int(current.value)
                if self._keepalive(self._gw, lease) > 0:
                    return lease
                time.sleep(0.05)  # it expired just now: its key goes with it
                continue
            lease = self._grant(self._gw, self.job_ttl)
            ok, _, _ = self._cas(key, 0, str(lease).encode(), lease=lease)
            if ok:
                return lease
            self._revoke(self._gw, lease)

    def _refresh_job_lease(self) -> None:
        gw = _Gateway(self.options)
        try:
            while not self._stop.wait(self.job_ttl / 3):
                try:
                    if self._keepalive(gw, self.job_lease) <= 0 and self._lease_gone(gw):
                        self._lease_lost = True
                        return
                except RendezvousError:
                    continue  # the store's own calls report a lost store
        finally:
            gw.close()

    def _lease_gone(self, gw: _Gateway) -> bool:
        """Whether the job lease really expired: a keep-alive that came back without a TTL
        (an overloaded member's reply) is asked again with ``lease/timetolive``, which says
        -1 only for a lease that no longer exists (one agent of a chaos soak under heavy load
        gave up a job whose lease the others still kept)."""
        result = gw.call("lease/timetolive", {"ID": str(self.job_lease)})
        return int(result.get("TTL", -1)) <= 0 and "grantedTTL" not in result

    @staticmethod
    def _grant(gw: _Gateway, ttl: int) -> int:
        return int(gw.call("lease/grant", {"TTL": str(ttl), "ID": "0"})["ID"])

    @staticmethod
    def _keepalive(gw: _Gateway, lease: int) -> int:
        """Refresh ``lease``; its new TTL, or 0 when it no longer exists."""
        result = gw.call("lease/keepalive", {"ID": str(lease)})
        return int(result.get("result", {}).get("TTL", 0))

    @staticmethod
    def _revoke(gw: _Gateway, lease: int) -> None:
        try:
            gw.call("kv/lease/revoke", {"ID": str(lease)})
        except _EtcdError:
            pass  # already gone

    def _check_lease(self) -> None:
        if self._lease_lost:
            raise StoreLostError(
                f"rendezvous store lost: the job's keys in {self.options.describe()} expired "
                f"(no agent refreshed the job's lease for {self.job_ttl} s)"
            )

    def _write_lease(self) -> dict:
        return {"lease": str(self.job_lease)} if self.job_lease else {}

    def _call(self, path: str, body: dict) -> dict:
        self._check_lease()
        try:
            return self._gw.call(path, body)
        except _EtcdError as e:
            if "lease not found" in str(e):
                self._lease_lost = True
                self._check_lease()
            raise

    # -- reads and writes ------------------------------------------------------------------------
    def _range(self, key: str) -> tuple[_Item | None, int]:
        result = self._call("kv/range", {"key": _b64(key)})
        kvs = result.get("kvs") or []
        return (_item(kvs[0]) if kvs else None), int(result["header"]["revision"])

    def _get(self, key: str) -> _Item | None:
        return self._range(key)[0]

    def _cas(
        self, key: str, expected: int, value: bytes, lease: int | None = None
    ) -> tuple[bool, _Item | None, int]:
        """One transaction: put if ``key``'s mod_revision is ``expected`` (0: absent).

        Returns (succeeded, the item now stored, the revision of the transaction).
        """
        compare = (
            {"target": "CREATE", "create_revision": "0"}
            if expected == 0
            else {"target": "MOD", "mod_revision": str(expected)}
        )
        put = {"key": _b64(key), "value": _b64(value)}
        lease = self.job_lease if lease is None else lease
        if lease:
            put["lease"] = str(lease)
        result = self._call(
            "kv/txn",
            {
                "compare": [{"key": _b64(key), "result": "EQUAL", **compare}],
                "success": [{"request_put": put}],
                "failure": [{"request_range": {"key": _b64(key)}}],
            },
        )
        revision = int(result["header"]["revision"])
        if result.get("succeeded"):
            return True, _Item(value, revision, lease), revision
        kvs = (result.get("responses") or [{}])[0].get("response_range", {}).get("kvs") or []
        return False, (_item(kvs[0]) if kvs else None), revision

    @staticmethod
    def _versioned(item: _Item | None) -> Versioned | None:
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
                {"success": [{"request_range": {"key": _b64(k)}} for k in chunk]},
            )
            for response in result.get("responses") or []:
                kvs = response.get("response_range", {}).get("kvs") or []
                out.append(self._versioned(_item(kvs[0])) if kvs else None)
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
                    "compare": [{"key": _b64(key), "result": "EQUAL", **compare}],
                    "success": [
                        {"request_put": self._put(key, str(count).encode())},
                        {"request_put": self._put(applied, str(count).encode())},
                    ],
                    "failure": [
                        {"request_range": {"key": _b64(key)}},
                        {"request_range": {"key": _b64(applied)}},
                    ],
                },
            )
            if not result.get("succeeded"):
                key_kvs, applied_kvs = (
                    r.get("response_range", {}).get("kvs") or [] for r in result["responses"]
                )
                if not applied_kvs:  # somebody else's write came first: try again
                    item = _item(key_kvs[0]) if key_kvs else None
                    continue
                count = int(_unb64(applied_kvs[0].get("value", "")))  # our earlier try
            self._call("kv/deleterange", {"key": _b64(applied)})
            return count

    def _put(self, key: str, value: bytes) -> dict:
        put = {"key": _b64(key), "value": _b64(value)}
        if self.job_lease:
            put["lease"] = str(self.job_lease)
        return put

    def register(self, prefix: str, name: str, value: bytes) -> int:
        key = prefix + name
        count = {"key": _b64(prefix), "range_end": _range_end(prefix), "count_only": True}
        result = self._call(
            "kv/txn",
            {
                "compare": [{"key": _b64(key), "result": "EQUAL", "target": "CREATE",
                             "create_revision": "0"}],
                "success": [{"request_put": self._put(key, value)}, {"request_range": count}],
                "failure": [{"request_range": {"key": _b64(key), "keys_only": True}}],
            },
        )  # fmt: skip
        responses = result.get("responses") or []
        if result.get("succeeded"):  # the count includes our entry: the transaction saw its put
            return int(responses[1]["response_range"].get("count", 0))
        kv = responses[0]["response_range"]["kvs"][0]  # ours, from an earlier try
        at = self._call("kv/range", {**count, "revision": kv["create_revision"]})
        return int(at.get("count", 0))

    def count(self, prefix: str) -> int:
        body = {"key": _b64(prefix), "range_end": _range_end(prefix), "count_only": True}
        return int(self._call("kv/range", body).get("count", 0))

    def entries(self, prefix: str, limit: int, timeout: float) -> list[bytes]:
        if limit <= 0:
            return []
        body = {
            "key": _b64(prefix), "range_end": _range_end(prefix), "limit": str(limit),
            "sort_order": "ASCEND", "sort_target": "CREATE",
        }  # fmt: skip
        kvs = self._call("kv/range", body).get("kvs") or []
        if len(kvs) < limit:
            raise RendezvousError(
                f"{prefix}: {limit} entries expected, {len(kvs)} found (deleted meanwhile?)"
            )
        return [_unb64(kv.get("value", "")) for kv in kvs]

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
    ) -> tuple[bool, _Item | None, int]:
        self._check_lease()
        return _watch_key(self._gw, key, version, start, timeout)

    @property
    def current_member(self) -> int:
        """The index in ``options.endpoints`` of the member this store talks to now."""
        return self._gw.current

    def liveness(self, node_id: str, dead_after: float) -> Liveness:
        live = EtcdLiveness(self, node_id, dead_after)
        self._livenesses.append(live)
        return live

    def liveness_key(self, node_id: str) -> str:
        return f"{self.prefix}liveness/{node_id}"

    def lease_ttl(self, key: str) -> tuple[int, int] | None:
        """(remaining, granted) seconds of the lease ``key`` is bound to; None: no such key."""
        item = self._get(key)
        if item is None:
            return None
        if not item.lease:
            return (-1, -1)
        result = self._call("kv/lease/timetolive", {"ID": str(item.lease)})
        return int(result.get("TTL", -1)), int(result.get("grantedTTL", -1))

    def delete_prefix(self, prefix: str) -> None:
        self._call("kv/deleterange", {"key": _b64(prefix), "range_end": _range_end(prefix)})
        if prefix == self.prefix and self.job_lease:
            self._stop.set()
            self._revoke(self._gw, self.job_lease)  # the job is over: its lease goes too

    def close(self) -> None:
        self._stop.set()
        if self._refresher is not None:
            self._refresher.join(timeout=2)
        for live in self._livenesses:
            live.close()
        self._gw.close()


class EtcdLiveness(Liveness):
    """A node's lease and its key ``<prefix>liveness/<node_id>``, on its own connection.

    The lease is refreshed at most every third of its TTL (as etcd's own clients keep leases
    alive), so a dead node's key is gone between 2/3 TTL and TTL after its last refresh.
    Another node is *watched*, not polled: the first `is_alive` reads its key, then a thread
    (`_KeyWatch`) waits for the key's DELETE on a watch. A node stopped being asked about for a
    TTL is no longer watched. N agents then cost etcd about N requests per TTL/3, not 2N per
    ``keep_alive_interval``.
    """

    def __init__(self, store: EtcdStore, node_id: str, dead_after: float):
        self._store = store
        self._gw = _Gateway(store.options)
        self._key = store.liveness_key(node_id)
        self._ttl = max(MIN_TTL, math.ceil(dead_after))
        self._every = self._ttl / 3  # seconds between refreshes, and between reads of a node
        self._lease = 0
        self._refreshed = -math.inf  # time.monotonic() of the last refresh
        self._watches: dict[str, _KeyWatch] = {}
        self._closed = False

    def _attach(self) -> None:
        for _ in range(3):  # a lease that expired before our put (an overloaded etcd): again
            self._lease = EtcdStore._grant(self._gw, self._ttl)
            body = {"key": _b64(self._key), "value": _b64(b"1"), "lease": str(self._lease)}
            try:
                self._gw.call("kv/put", body)
                return
            except _EtcdError as e:
                if "lease not found" not in str(e):
                    raise
        raise StoreLostError(
            f"rendezvous store lost: {self._store.options.describe()} let three {self._ttl} s "
            "leases expire before a write bound to them (overloaded?)"
        )

    def beat(self) -> None:
        if self._closed:
            return
        now = time.monotonic()
        if self._lease and now - self._refreshed < self._every:
            return
        if not self._lease or EtcdStore._keepalive(self._gw, self._lease) <= 0:
            self._attach()  # first beat, or our lease expired (we were seen as dead)
        self._refreshed = now

    def is_alive(self, node_id: str) -> bool:
        now = time.monotonic()
        for other, watch in list(self._watches.items()):  # nodes nobody asks about any more
            if other != node_id and now - watch.asked > self._ttl:
                watch.close()
                del self._watches[other]
        watch = self._watches.get(node_id)
        if watch is not None and not watch.alive and watch.error is None:
            # a watch that saw the key go is final, but the node may be back: one that paused
            # past its TTL re-attaches under the same id (a cached verdict livelocked the job)
            watch.close()
            watch = None
        if watch is None:
            watch = _KeyWatch(self._gw, self._store.options, self._store.liveness_key(node_id))
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
        if self._lease:
            try:
                EtcdStore._revoke(self._gw, self._lease)
            except RendezvousError:
                pass
        self._gw.close()


class _KeyWatch:
    """Whether ``key`` exists, kept up to date by a watch on its own thread and connection.

    The key is read once (on ``gw``, the caller's connection) when the watch is made; after
    that ``alive`` turns False when a watch sees the key deleted, or a re-read (after a broken
    stream) finds it gone. A store that stops answering sets ``error`` (`StoreLostError`).
    """

    _WAIT = 5.0  # seconds per watch request (then another, from the same revision)

    def __init__(self, gw: _Gateway, options: EtcdOptions, key: str):
        self.key = key
        self.asked = time.monotonic()
        self.error: RendezvousError | None = None
        self._options = options
        self._stop = threading.Event()
        self.alive, revision, version = self._read(gw)
        if self.alive:
            threading.Thread(
                target=self._run, args=(revision + 1, version), name="meshrun-etcd-watch",
                daemon=True,
            ).start()  # fmt: skip

    def _read(self, gw: _Gateway) -> tuple[bool, int, int]:
        """(exists, the read's revision, the key's mod_revision or 0)."""
        result = gw.call("kv/range", {"key": _b64(self.key)})
        kvs = result.get("kvs") or []
        version = int(kvs[0]["mod_revision"]) if kvs else 0
        return bool(kvs), int(result["header"]["revision"]), version

    def _run(self, start: int, version: int) -> None:
        gw = _Gateway(self._options)
        try:
            while not self._stop.is_set() and self.alive:
                changed, item, revision = _watch_key(gw, self.key, version, start, self._WAIT)
                if changed:
                    if item is None:
                        self.alive = False  # deleted: its lease expired, or it left
                    else:
                        version, start = item.version, revision + 1
                elif revision < 0:  # the stream broke: read again (from the next member)
                    self.alive, revision, version = self._read(gw)
                    start = revision + 1
        except RendezvousError as e:
            self.error = e
        finally:
            gw.close()

    def close(self) -> None:
        self._stop.set()


def _watch_key(
    gw: _Gateway, key: str, version: int, start: int, timeout: float
) -> tuple[bool, _Item | None, int]:
    """Watch ``key`` from revision ``start`` for up to ``timeout`` s, on ``gw``.

    Returns ``(True, item, rev)`` when its version left ``version`` (``item`` None: deleted);
    ``(False, None, rev)`` on timeout; ``(False, None, -1)`` when the stream broke (the caller
    re-reads).
    """
    requests = gw._requests
    from urllib3.exceptions import ReadTimeoutError
    deadline = time.monotonic() + timeout
    body = {"create_request": {"key": _b64(key), "start_revision": str(start)}}
    try:
        response = gw.stream("watch", body, timeout)
    except requests.exceptions.Timeout:
        return False, None, start - 1
    except requests.exceptions.RequestException:
        gw.fail_over()
        return False, None, -1
    buffer = b""
    try:
        if response.status_code != 200:
            gw.fail_over()
            return False, None, -1
        for chunk in response.iter_content(chunk_size=None):
            buffer += chunk
            while b"\n" in buffer:
                line, buffer = buffer.split(b"\n", 1)
                if not line.strip():
                    continue
                result = json.loads(line).get("result", {})
                if result.get("canceled") or "error" in json.loads(line):
                    return False, None, -1
                for event in result.get("events") or []:
                    kv = event["kv"]
                    if event.get("type") == "DELETE":
                        if version != 0:
                            return True, None, int(kv["mod_revision"])
                    elif int(kv["mod_revision"]) != version:
                        return True, _item(kv), int(kv["mod_revision"])
            if time.monotonic() >= deadline:
                return False, None, start - 1
        return False, None, -1  # the member closed the stream
    except requests.exceptions.ConnectionError as e:
        reason = e.args[0] if e.args else None
        if isinstance(reason, ReadTimeoutError):  # no event within the timeout
            return False, None, start - 1
        gw.fail_over()
        return False, None, -1
    except requests.exceptions.RequestException:
        gw.fail_over()
        return False, None, -1
    finally:
        response.close()


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


__all__ = ["EtcdLiveness", "EtcdOptions", "EtcdStore", "open_etcd_store", "parse_endpoints"]
