"""Shared-secret authentication of every rendezvous value (docs/design.md §3.7).

A TCPStore has no access control: any process that reaches its port can read and write every
key. With a shared secret (``--rdzv-conf secret_file=PATH``, or the environment variable
``MESHRUN_RDZV_SECRET``; never a value on the command line, which ``ps`` shows to everyone),
`AuthenticatedStore` wraps the backend's store and seals every value it writes with
HMAC-SHA256 (RFC 2104) over the job's run id, the key and the value, and checks the seal on
every read. A process without the secret can then write only values that fail the check:

- a value that fails the check (a forgery, a value moved from another key, or from another
  job) is treated as *absent*: reads skip it (a warning line names the key, once), a waiter
  waits on past it, and a write-once ("only if absent") write replaces it. So a forger can
  neither join a round, nor forge the membership, the workers' master address, or the job's
  outcome. Where a forgery overwrote a value this agent had already read (TCPStore cannot
  stop the overwrite), the rendezvous fails with one `RendezvousError` line (exit 3):
  what was lost cannot be read back, and it is never silently replaced by the forger's value;
- register entries (joiners, the exit barrier) carry their name inside the sealed bytes;
  `entries` returns only the authentic ones, each name once, so fewer than ``limit`` may come
  back (the protocol closes a round with authentic joiners only);
- counters (``add``: register positions on TCPStore, heartbeat counters) are integers and
  cannot carry a seal. A forger can move them, which can only delay or stop the job (see
  docs/security.md): the protocol never lets a count alone decide a membership or an
  outcome (the exit barrier checks every member's sealed ``succeeded`` key).

Cost: 45 bytes per value (``M1`` and the base64 of the 32-byte MAC), and one HMAC-SHA256 of
a few hundred bytes per write and per read (microseconds; measured in docs/security.md).

The wrapped store's own bookkeeping (TCPStore's version prefixes and change markers, etcd's
job lease key) is not sealed: a forger can spoil it, which is again a denial of service.
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import logging
import os
import stat
import struct
import time

from meshrun.rendezvous.api import SECRET_AS_VALUE, SECRET_ENV, RendezvousError
from meshrun.rendezvous.store import Liveness, Store, Versioned

log = logging.getLogger("meshrun.rendezvous")

MIN_SECRET_BYTES = 16
MAX_SECRET_BYTES = 64 * 1024
_TAG = b"M1"  # format version of a sealed value
_MAC_CHARS = 43  # base64 (urlsafe, unpadded) of 32 bytes
HEADER_BYTES = len(_TAG) + _MAC_CHARS
_MAKE_SECRET = "head -c 32 /dev/urandom | base64 > FILE; chmod 600 FILE"


def load_secret(conf: dict[str, str], environ=os.environ) -> bytes | None:
    """The rendezvous secret: the contents of ``--rdzv-conf secret_file=PATH`` (which wins),
    else the value of ``MESHRUN_RDZV_SECRET``, stripped of surrounding whitespace; None when
    neither is given (values are not authenticated).

    Raises:
        ValueError: ``secret=`` given as a value (visible in ``ps``), or a secret file that is
            missing, not a regular file, unreadable, readable or writable by group or others,
            larger than 64 KiB, or holding fewer than 16 bytes; one line naming the fix. The
            secret itself is never part of a message.
    """
    if "secret" in conf:
        raise ValueError(SECRET_AS_VALUE)
    path = conf.get("secret_file")
    if path:
        raw = _read_secret_file(path)
        where = f"--rdzv-conf secret_file={path}"
    elif SECRET_ENV in environ:
        raw = os.fsencode(environ[SECRET_ENV])  # its bytes, also when not UTF-8
        where = SECRET_ENV
    else:
        return None
    secret = raw.strip()
    if not secret:
        raise ValueError(f"{where}: the secret is empty; make one with: {_MAKE_SECRET}")
    if len(secret) < MIN_SECRET_BYTES:
        raise ValueError(
            f"{where}: the secret is shorter than {MIN_SECRET_BYTES} bytes (too easy to guess); "
            f"make one with: {_MAKE_SECRET}"
        )
    return secret


def _read_secret_file(path: str) -> bytes:
    where = f"--rdzv-conf secret_file={path}"
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOCTTY | os.O_NONBLOCK)
    except FileNotFoundError:
        raise ValueError(f"{where}: no such file; make one with: {_MAKE_SECRET}") from None
    except OSError as e:
        raise ValueError(f"{where}: cannot read it: {e.strerror or e}") from None
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode):
            raise ValueError(f"{where}: not a regular file")
        if info.st_mode & 0o077:
            raise ValueError(
                f"{where}: group or others may access it (mode {info.st_mode & 0o777:04o}); "
                f"make it private: chmod 600 {path}"
            )
        if info.st_size > MAX_SECRET_BYTES:
            raise ValueError(f"{where}: larger than {MAX_SECRET_BYTES // 1024} KiB; not a secret")
        try:
            return os.read(fd, MAX_SECRET_BYTES + 1)
        except OSError as e:
            raise ValueError(f"{where}: cannot read it: {e.strerror or e}") from None
    finally:
        os.close(fd)


def _mac(secret: bytes, *parts: bytes) -> bytes:
    """HMAC-SHA256 of ``parts``, each length-prefixed (no two part lists encode alike)."""
    message = b"".join(struct.pack(">I", len(p)) + p for p in parts)
    digest = hmac.new(secret, message, hashlib.sha256).digest()
    return base64.urlsafe_b64encode(digest).rstrip(b"=")


class AuthenticatedStore(Store):
    """``inner`` with every value sealed by HMAC-SHA256 over (run id, key, value).

    Args:
        inner: the backend's store (TCPStore, etcd, in-memory).
        secret: the shared secret (`load_secret`), the same on every node of the job.
        run_id: the job's ``--rdzv-id``: a value sealed for another job fails the check.
    Raises (from its methods): what ``inner`` raises, and `RendezvousError` when a forgery
        overwrote a value this store had read (see the module docstring).
    """

    def __init__(self, inner: Store, secret: bytes, run_id: str):
        self.inner = inner
        self._secret = secret
        self._run_id = run_id.encode()
        self._read: set[str] = set()  # keys whose authentic value this store has seen
        self._warned: set[str] = set()

    def __getattr__(self, name: str):  # backend extras: host, options, liveness_of, ...
        if name == "inner":
            raise AttributeError(name)
        return getattr(self.inner, name)

    def __repr__(self) -> str:  # never the secret
        return f"AuthenticatedStore({self.inner!r})"

    @property
    def serves_others(self):
        return self.inner.serves_others

    @property
    def outlives_agents(self):
        return self.inner.outlives_agents

    # -- sealing ---------------------------------------------------------------------------------
    def seal(self, key: str, value: bytes) -> bytes:
        """``value`` as stored under ``key``: ``M1`` + the MAC + the value."""
        return _TAG + _mac(self._secret, b"value", self._run_id, key.encode(), value) + value

    def open(self, key: str, raw: bytes) -> bytes | None:
        """The value sealed in ``raw`` for ``key``, or None when the seal does not check."""
        raw = bytes(raw)
        if len(raw) < HEADER_BYTES or not raw.startswith(_TAG):
            return None
        value = raw[HEADER_BYTES:]
        expected = _mac(self._secret, b"value", self._run_id, key.encode(), value)
        return value if hmac.compare_digest(raw[len(_TAG) : HEADER_BYTES], expected) else None

    def _seal_entry(self, prefix: str, name: str, value: bytes) -> bytes:
        mac = _mac(self._secret, b"entry", self._run_id, prefix.encode(), name.encode(), value)
        return _TAG + mac + name.encode() + b"\0" + value

    def _open_entry(self, prefix: str, raw: bytes) -> tuple[str, bytes] | None:
        raw = bytes(raw)
        if len(raw) < HEADER_BYTES or not raw.startswith(_TAG):
            return None
        name, sep, value = raw[HEADER_BYTES:].partition(b"\0")
        if not sep:
            return None
        expected = _mac(self._secret, b"entry", self._run_id, prefix.encode(), name, value)
        if not hmac.compare_digest(raw[len(_TAG) : HEADER_BYTES], expected):
            return None
        return name.decode(errors="replace"), value

    @property
    def rejected(self) -> bool:
        """Whether a value read failed the secret's check (a different secret, a forger)."""
        return bool(self._warned)

    def _rejected(self, key: str, raw: bytes) -> None:
        if key not in self._warned:
            self._warned.add(key)
            log.warning(
                "meshrun: rejected a rendezvous value of %s that is not sealed with this job's "
                "secret (%r...): a node started with a different secret (give every node the "
                "same secret_file or %s), or a program without the secret, writes to the job's "
                "store; it is ignored", key, bytes(raw)[:24], SECRET_ENV,
            )  # fmt: skip

    def _unseal(self, key: str, item: Versioned | None) -> Versioned | None:
        """The authentic value of ``item`` (read from ``key``); None when absent or forged.

        Raises:
            RendezvousError: forged, where this store had read an authentic value before.
        """
        if item is None:
            return None
        value = self.open(key, item.value)
        if value is not None:
            self._read.add(key)
            return Versioned(value, item.version)
        if key in self._read:
            raise RendezvousError(
                f"the rendezvous value of {key} was overwritten by a program without the job's "
                "secret (it fails the HMAC check); the job's store is under attack or shared "
                "with another job: bind it to a private address, give the job its own --rdzv-id"
            )
        self._rejected(key, item.value)
        return None

    # -- the contract ----------------------------------------------------------------------------
    def get(self, key: str) -> Versioned | None:
        return self._unseal(key, self.inner.get(key))

    def get_many(self, keys: list[str]) -> list[Versioned | None]:
        items = self.inner.get_many(keys)
        return [self._unseal(k, item) for k, item in zip(keys, items, strict=True)]

    def compare_and_set(self, key, expected_version, value):
        sealed = self.seal(key, value)
        ok, current = self.inner.compare_and_set(key, expected_version, sealed)
        if not ok and expected_version == 0 and current is not None:
            if self._unseal(key, current) is None:  # a forgery counts as absent: replace it
                ok, current = self.inner.compare_and_set(key, current.version, sealed)
        if ok:
            self._read.add(key)
            return True, Versioned(value, current.version)
        return False, self._unseal(key, current)

    def set_once(self, key: str, value: bytes) -> Versioned:
        for _ in range(5):  # a forger racing us (each forgery it writes is replaced)
            ok, current = self.compare_and_set(key, 0, value)
            if current is not None:
                return current
        raise RendezvousError(
            f"the rendezvous value of {key} keeps being overwritten by a program without the "
            "job's secret"
        )

    def add(self, key: str, delta: int) -> int:
        return self.inner.add(key, delta)

    def wait_for_change(self, key, version, timeout):
        deadline = time.monotonic() + timeout
        waited_for = version
        while True:
            item = self.inner.wait_for_change(
                key, waited_for, max(0.0, deadline - time.monotonic())
            )
            current = self._unseal(key, item)
            if item is None or current is not None:
                return current
            # a forgery: wait on past it (its version), as if the key were still unchanged
            if item.version == waited_for or time.monotonic() >= deadline:
                return None
            waited_for = item.version

    def register(self, prefix: str, name: str, value: bytes) -> int:
        return self.inner.register(prefix, name, self._seal_entry(prefix, name, value))

    def count(self, prefix: str) -> int:
        return self.inner.count(prefix)

    def entries(self, prefix: str, limit: int, timeout: float) -> list[bytes]:
        """The authentic values among the first ``limit`` entries of ``prefix``, each entry
        name once (a copy of an authentic entry at another position counts once): fewer than
        ``limit`` when entries fail the check."""
        out: list[bytes] = []
        names: set[str] = set()
        for raw in self.inner.entries(prefix, limit, timeout):
            opened = self._open_entry(prefix, raw)
            if opened is None:
                self._rejected(prefix, raw)
                continue
            if opened[0] not in names:
                names.add(opened[0])
                out.append(opened[1])
        return out

    def liveness(self, node_id: str, dead_after: float) -> Liveness:
        return self.inner.liveness(node_id, dead_after)

    def watcher(self) -> Store:
        inner = self.inner.watcher()
        return self if inner is self.inner else AuthenticatedStore(inner, self._secret,
                                                                   self._run_id.decode())

    @property
    def interrupts(self) -> bool:  # type: ignore[override]
        return self.inner.interrupts

    def interrupt(self) -> None:
        self.inner.interrupt()

    def last_value(self, key: str, since_version: int) -> bytes | None:
        raw = self.inner.last_value(key, since_version)
        return None if raw is None else self.open(key, raw)  # a forgery is no value

    def delete_prefix(self, prefix: str) -> None:
        self.inner.delete_prefix(prefix)

    def close(self) -> None:
        self.inner.close()


__all__ = ["SECRET_ENV", "AuthenticatedStore", "load_secret"]
