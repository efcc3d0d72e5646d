"""The etcd v3 JSON-gateway client: how meshrun talks to etcd, below the store contract.

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
between cluster members, watches bounded by a timeout, and the lease calls (grant, keep-alive,
revoke) that the store and its liveness build on.

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
    """One connection (a requests session) to an etcd cluster's JSON gateway, with failover.

    Not shared between threads: the store, its liveness, its lease refresher and each watch
    thread have one.
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
                        raise EtcdError(message) from None
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
        requests = self._requests
        from urllib3.exceptions import ReadTimeoutError
        deadline = time.monotonic() + timeout
        body = {"create_request": {"key": b64(key), "start_revision": str(start)}}
        try:
            response = self.stream("watch", body, timeout)
        except requests.exceptions.Timeout:
            return False, None, start - 1
        except requests.exceptions.RequestException:
            self.fail_over()
            return False, None, -1
        buffer = b""
        try:
            if response.status_code != 200:
                self.fail_over()
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
                            return True, Item.from_kv(kv), int(kv["mod_revision"])
                if time.monotonic() >= deadline:
                    return False, None, start - 1
            return False, None, -1  # the member closed the stream
        except requests.exceptions.ConnectionError as e:
            reason = e.args[0] if e.args else None
            if isinstance(reason, ReadTimeoutError):  # no event within the timeout
                return False, None, start - 1
            self.fail_over()
            return False, None, -1
        except requests.exceptions.RequestException:
            self.fail_over()
            return False, None, -1
        finally:
            response.close()

    def fail_over(self) -> None:
        """Move on to the next member (the current one broke a stream)."""
        self.current = (self.current + 1) % len(self.clients)

    def close(self) -> None:
        self.session.close()


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
_AUTH_RETRY = ("invalid auth token", "auth token", "auth store is old", "user name is empty")


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


__all__ = [
    "DEFAULT_PORT", "PASSWORD_ENV", "EtcdError", "EtcdOptions", "Gateway", "Item", "b64",
    "parse_endpoints", "range_end", "unb64",
]  # fmt: skip
