"""The etcd v3 JSON-gateway client: how meshrun talks to etcd, below the store contract.

torch's etcd rendezvous backends speak etcd's v2 API only, which etcd 3.4 disables and 3.6
removes. meshrun speaks v3, through etcd's JSON gateway (``/v3/...``, served by every etcd
>= 3.4 on its client port): JSON over HTTP POSTs, sent with ``urllib3``.

Why the JSON gateway: it needs no grpc and no protobuf. The gRPC clients pin or break on
protobuf: ``etcd3`` 0.12 (2020, unmaintained) fails to import with protobuf >= 4 unless
``PROTOCOL_BUFFERS_PYTHON_IMPLEMENTATION=python``; ``etcd-sdk-python`` needs protobuf >=
5.27.2 without declaring it. A launcher is installed next to the user's own packages, so it
must not fight them over protobuf. Why ``urllib3`` and not ``etcd3gw`` (its JSON-gateway client,
on ``requests``), which meshrun used before: every call here is one POST of a small JSON body,
and ``requests`` spent about twice urllib3's client CPU on each: 1024 agents of one job on one
host (`benchmarks/rendezvous.py`) spent 12-13 s of CPU in a round instead of 20-27 s. etcd3gw gave only that POST: user/password auth (``POST
/v3/auth/authenticate``, the token sent as the ``Authorization`` header, re-authenticated when
etcd says it is invalid or expired), failover between cluster members, watches bounded by a
timeout, and the lease calls (grant, keep-alive, revoke) were this module's already.

Endpoints are ``host[:port]`` (default port 2379), comma-separated for a cluster: a request
that cannot reach a member goes to the next one, and the gateway keeps the one that works. Only
when no member answers for ``read_timeout`` seconds is the store lost (`StoreLostError`,
exit 3). ``--rdzv-conf`` keys: ``cacert``, ``cert``, ``key`` (TLS; https is used when any is
given, or with ``protocol=https``), ``user`` and the password: ``password_file=PATH``, the
variable ``MESHRUN_ETCD_PASSWORD``, or ``password=`` (torchrun's key; on the command line ``ps``
shows it). user/password over plain http is refused unless ``insecure=true``. A refused
password or certificate is a `RendezvousError` of one line.

The store contract on top of this client is `meshrun.rendezvous.etcd`; node liveness on leases
is `meshrun.rendezvous.etcd_liveness`.
"""

from __future__ import annotations

import base64
import json
import os
import re
import stat
import time
from dataclasses import dataclass

from meshrun.rendezvous.api import RendezvousError, StoreLostError

DEFAULT_PORT = 2379
PASSWORD_ENV = "MESHRUN_ETCD_PASSWORD"  # the etcd password, when neither password= nor a file


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


class Gateway:
    """One connection per member to an etcd cluster's JSON gateway, with failover.

    Not shared between threads: the store, its liveness, its lease refresher and each watch
    thread have one.
    """

    def __init__(self, options: EtcdOptions):
        import urllib3  # lazily: only the etcd backend needs it

        self.options = options
        self._urllib3 = urllib3
        rt = options.read_timeout
        connect, read = min(2.0, max(0.5, rt / 4)), max(1.0, rt / 2)
        self.request_timeout = (connect, read)
        self._timeout = urllib3.Timeout(connect=connect, read=read)
        self.headers = {"Content-Type": "application/json"}  # + Authorization, once logged in
        tls = {}
        if options.protocol == "https":
            # No CA bundle from the environment unless no cacert was given: an explicit cacert
            # always wins (requests let REQUESTS_CA_BUNDLE override it). Hosts are verified.
            env_bundle = os.environ.get("REQUESTS_CA_BUNDLE") or os.environ.get("CURL_CA_BUNDLE")
            tls = {"cert_reqs": "CERT_REQUIRED", "ca_certs": options.cacert or env_bundle}
            if options.cert:
                tls.update(cert_file=options.cert, key_file=options.key)
        pool = urllib3.HTTPSConnectionPool if options.protocol == "https" else \
            urllib3.HTTPConnectionPool
        # one kept-alive connection per member for calls (a thread's calls are sequential);
        # a watch takes a second one for as long as it streams
        self.members = [
            pool(host, port, maxsize=2, retries=False, timeout=self._timeout, **tls)
            for host, port in options.endpoints
        ]
        self.current = 0
        if options.user:
            self._authenticate()

    # -- errors --------------------------------------------------------------------------------
    def _member(self, i: int) -> str:
        host, port = self.options.endpoints[i]
        return f"{host}:{port}"

    @staticmethod
    def _message(status: int, data: bytes) -> str:
        """The error text of a gateway reply with HTTP status ``status`` and body ``data``."""
        detail = data.decode(errors="replace")
        try:
            body = json.loads(detail)
            text = body.get("message") or body.get("error") or detail
        except (ValueError, AttributeError):
            text = detail or f"HTTP {status}"
        text = " ".join(str(text).split())
        return text.removeprefix("etcdserver: ")

    def _tls_error(self, i: int, e: Exception) -> RendezvousError:
        text = " ".join(str(e).split())
        if "CERTIFICATE_VERIFY_FAILED" in text:
            why = "the server's certificate is not signed by the CA in --rdzv-conf cacert"
            if not self.options.cacert:
                why = "the server's certificate is not trusted (give --rdzv-conf cacert=CA.pem)"
        elif "certificate" in text.lower() or "alert" in text.lower():
            why = "the TLS handshake failed (is --rdzv-conf cert/key a client certificate " \
                  "the server trusts?)"
        elif "EOF occurred" in text and not self.options.cert:
            why = "the server closed the TLS handshake (does it require a client certificate? " \
                  "give --rdzv-conf cert=CLIENT.pem,key=CLIENT.key)"
        else:
            why = "the TLS handshake failed"
        text = re.sub(r"\s*\(_ssl\.c:\d+\)", "", text)  # where in CPython: no help to a user
        detail = text[text.find("[SSL"):].split(")")[0] if "[SSL" in text else text[:160]
        detail = detail.strip("'")  # the end of the quoted OpenSSL reason
        return RendezvousError(f"etcd at {self._member(i)}: {why} ({detail})")

    # -- calls ---------------------------------------------------------------------------------
    def _authenticate(self) -> None:
        self.headers.pop("Authorization", None)
        result = self.call(
            "auth/authenticate",
            {"name": self.options.user, "password": self.options.password or ""},
            _auth=False,
        )
        if result.get("token"):  # none when this etcd has auth off: then none is needed
            self.headers["Authorization"] = result["token"]

    def _post(self, i: int, path: str, body: dict) -> tuple[int, bytes]:
        """One POST to member ``i``: (HTTP status, body). Raises urllib3's errors as they are."""
        response = self.members[i].urlopen(
            "POST", "/v3/" + path, body=json.dumps(body), headers=self.headers,
            retries=False, timeout=self._timeout,
        )  # fmt: skip
        return response.status, response.data

    def call(self, path: str, body: dict, *, _auth: bool = True, _reauthenticated: bool = False
             ) -> dict:
        """POST one v3 request to the current member, failing over to the others.

        Raises:
            RendezvousError: etcd refused us (credentials, certificate, permission).
            StoreLostError: no member answered within ``read_timeout``.
        """
        errors = self._urllib3.exceptions
        deadline = time.monotonic() + self.options.read_timeout
        last = "no answer"
        n = len(self.members)
        while True:
            for step in range(n):
                i = (self.current + step) % n
                try:
                    status, data = self._post(i, path, body)
                except (errors.HTTPError, OSError) as e:  # refused, reset, timed out, TLS
                    if isinstance(e, errors.SSLError) or "SSL" in str(e):
                        raise self._tls_error(i, e) from None
                    last = f"{self._member(i)}: {_connection_reason(e)}"
                    continue
                _REACHED.add(self.options.endpoints)
                if status == 200:
                    self.current = i
                    return self._reply(i, data)
                if status in _UNAVAILABLE:  # this member cannot serve now; another may
                    last = f"{self._member(i)}: {_UNAVAILABLE[status]}"
                    continue
                message = self._message(status, data)
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
                if _auth and self.options.user and not _reauthenticated and any(
                    word in lowered for word in _AUTH_RETRY
                ):
                    self._authenticate()
                    return self.call(path, body, _reauthenticated=True)  # once: then an error
                if not any(word in lowered for word in _TRANSIENT):
                    if not _is_etcd_error(data):  # another server on that port
                        raise RendezvousError(
                            f"etcd at {self._member(i)} answered HTTP {status} "
                            f"({_snippet(data)}): not etcd's v3 gateway; is --rdzv-endpoint an "
                            "etcd client port?"
                        ) from None
                    raise EtcdError(message) from None
                last = f"{self._member(i)}: {message[:200]}"
            remaining = deadline - time.monotonic()
            if remaining <= 0 and self.options.endpoints not in _REACHED:
                hint = "is etcd running there, and is --rdzv-endpoint its client port?"
                if self.options.protocol == "http" and "closed by the server" in last:
                    hint = ("if etcd there serves only TLS (it closes plain HTTP "
                            "connections), give --rdzv-conf cacert=CA.pem (https)")
                raise StoreLostError(
                    f"rendezvous store not reached: no member of {self.options.describe()} "
                    f"answered within read_timeout={self.options.read_timeout:g} s (last "
                    f"error: {last}); {hint}"
                )
            if remaining <= 0:
                raise StoreLostError(
                    f"rendezvous store lost: no member of {self.options.describe()} answered "
                    f"within read_timeout={self.options.read_timeout:g} s (last error: {last})"
                )
            time.sleep(min(0.2, remaining))

    def _reply(self, i: int, data: bytes) -> dict:
        """The JSON object of a 200 reply from member ``i``.

        Raises:
            RendezvousError: the reply is not a JSON object (another server on that port).
        """
        try:
            result = json.loads(data)
        except ValueError:
            result = None
        if not isinstance(result, dict):
            raise RendezvousError(
                f"etcd at {self._member(i)} answered {bytes(data[:60])!r}, not etcd's v3 "
                "gateway JSON; is --rdzv-endpoint an etcd client port?"
            )
        return result

    def stream(self, path: str, body: dict, timeout: float):
        """A streaming POST (a watch) to the current member; returns the open response
        (urllib3's, unread), which the caller must ``close()``.

        Raises urllib3's errors as they are: the caller decides (timeout or loss).
        """
        return self.members[self.current].urlopen(
            "POST", "/v3/" + path, body=json.dumps(body), headers=self.headers,
            retries=False, preload_content=False,
            timeout=self._urllib3.Timeout(connect=self.request_timeout[0],
                                          read=max(0.05, timeout)),
        )  # fmt: skip

    # -- leases --------------------------------------------------------------------------------
    def grant(self, ttl: int) -> int:
        """A new lease of ``ttl`` seconds; its ID."""
        return int(self.call("lease/grant", {"TTL": str(ttl), "ID": "0"})["ID"])

    def keepalive(self, lease: int) -> int:
        """Refresh ``lease``; its new TTL, or 0 when it no longer exists."""
        result = self.call("lease/keepalive", {"ID": str(lease)})
        return int(result.get("result", {}).get("TTL", 0))

    def revoke(self, lease: int) -> None:
        """Revoke ``lease`` (and so delete the keys bound to it); one already gone is no error."""
        try:
            self.call("kv/lease/revoke", {"ID": str(lease)})
        except EtcdError:
            pass  # already gone

    # -- watches -------------------------------------------------------------------------------
    def watch(
        self, key: str, version: int, start: int, timeout: float
    ) -> tuple[bool, Item | None, int]:
        """Watch ``key`` from revision ``start`` for up to ``timeout`` s.

        Returns ``(True, item, rev)`` when its version left ``version`` (``item`` None: deleted);
        ``(False, None, rev)`` on timeout; ``(False, None, -1)`` when the stream broke (the caller
        re-reads).
        """
        errors = self._urllib3.exceptions
        deadline = time.monotonic() + timeout
        body = {"create_request": {"key": b64(key), "start_revision": str(start)}}
        try:
            response = self.stream("watch", body, timeout)
        except errors.NewConnectionError:  # refused (urllib3 files it under timeouts)
            self.fail_over()
            return False, None, -1
        except errors.TimeoutError:
            return False, None, start - 1
        except (errors.HTTPError, OSError):
            self.fail_over()
            return False, None, -1
        try:
            if response.status != 200:
                self.fail_over()
                return False, None, -1
            for message in _json_lines(response.stream(None)):
                result = message.get("result", {})
                if result.get("canceled") or "error" in message:
                    return False, None, -1
                for event in result.get("events") or []:
                    kv = event["kv"]
                    if event.get("type") == "DELETE":
                        if version != 0:
                            return True, None, int(kv["mod_revision"])
                    elif int(kv["mod_revision"]) != version:
                        return True, Item.from_kv(kv), int(kv["mod_revision"])
                if time.monotonic() >= deadline:
                    return False, None, start - 1
            return False, None, -1  # the member closed the stream
        except errors.ReadTimeoutError:  # no event within the timeout
            return False, None, start - 1
        except (errors.HTTPError, OSError):
            self.fail_over()
            return False, None, -1
        finally:
            response.close()  # a stream is never read to its end: its connection goes

    def fail_over(self) -> None:
        """Move on to the next member (the current one broke a stream)."""
        self.current = (self.current + 1) % len(self.members)

    def close(self) -> None:
        for pool in self.members:
            pool.close()


class EtcdError(RendezvousError):
    """etcd answered with an error that no other member would answer differently."""


@dataclass(frozen=True)
class Item:
    """One key as read: its value, its version (``mod_revision``) and its lease (0: none)."""

    value: bytes
    version: int  # mod_revision
    lease: int

    @classmethod
    def from_kv(cls, kv: dict) -> Item:
        """From a key-value of a range or watch response."""
        return cls(unb64(kv.get("value", "")), int(kv["mod_revision"]), int(kv.get("lease", 0)))


def b64(data: bytes | str) -> str:
    """``data`` as the gateway carries keys and values: base64 text."""
    if isinstance(data, str):
        data = data.encode()
    return base64.b64encode(data).decode()


def unb64(text: str) -> bytes:
    """The bytes of a base64 key or value from the gateway."""
    return base64.b64decode(text)


def range_end(prefix: str) -> str:
    """The ``range_end`` (base64) that makes a range of every key starting with ``prefix``."""
    end = bytearray(prefix.encode())
    end[-1] += 1
    return b64(bytes(end))


# -- helpers -----------------------------------------------------------------------------------
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
# HTTP statuses of a member that cannot serve now (what each is called in an error line)
_UNAVAILABLE = {408: "timed out", 503: "member unavailable", 504: "timed out"}
_AUTH_RETRY = ("invalid auth token", "auth token", "auth store is old", "user name is empty")
# the endpoint lists some member of which answered in this process: a store that stops
# answering after that was lost; one that never answered was never reached (a wrong endpoint,
# etcd not running), which the error line says differently
_REACHED: set[tuple[tuple[str, int], ...]] = set()


def _json_lines(chunks):
    """The JSON messages of a watch stream: one per line, however the chunks cut them.

    Linear in the bytes: a round's membership (about 200 KB for 1024 nodes) arrives in
    some fifty chunks, and re-scanning what was buffered at each one cost each of a thousand
    waiting nodes milliseconds of CPU.
    """
    pending: list[bytes] = []  # the current line's earlier chunks
    for chunk in chunks:
        while (cut := chunk.find(b"\n")) >= 0:
            line = b"".join(pending) + chunk[:cut] if pending else chunk[:cut]
            pending, chunk = [], chunk[cut + 1 :]
            if line.strip():
                yield json.loads(line)
        if chunk:
            pending.append(chunk)


def _snippet(data: bytes, limit: int = 80) -> str:
    """The start of a reply's text for an error line: tags out, blanks folded, cut at a word."""
    text = " ".join(re.sub(r"<[^>]*>", " ", data[:4096].decode(errors="replace")).split())
    if len(text) > limit:
        text = text[:limit].rsplit(" ", 1)[0] + " ..."
    return text or "an empty body"


def _is_etcd_error(data: bytes) -> bool:
    """Whether an error reply's body is etcd's (a JSON object with an error or a message)."""
    try:
        body = json.loads(data)
    except ValueError:
        return False
    return isinstance(body, dict) and ("error" in body or "message" in body)


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


def _connection_reason(e: BaseException) -> str:
    """A short reason for a failed connection ("connection refused", "timed out", ...)."""
    text = " ".join(f"{e} {e.__context__ or ''}".split())
    for needle, short in (
        ("refused", "connection refused"),
        ("Name or service not known", "unknown host"),
        ("Temporary failure in name resolution", "unknown host"),
        ("timed out", "timed out"),
        ("reset by peer", "connection reset"),
        ("RemoteDisconnected", "connection closed by the server"),
        ("closed connection without response", "connection closed by the server"),
    ):
        if needle in text:
            return short
    return text[:160]


__all__ = [
    "DEFAULT_PORT", "PASSWORD_ENV", "EtcdError", "EtcdOptions", "Gateway", "Item", "b64",
    "parse_endpoints", "range_end", "unb64",
]  # fmt: skip
