"""The store contract on torch's TCPStore (the ``c10d`` backend), hosted by one agent.

TCPStore has no versions and no change notification: ``wait`` only waits for a key to exist,
and a blocked call holds its connection. So (docs/design.md §3.2):

- a versioned key ``k`` stores ``b"<version>|<writer>|<payload>"``; compare-and-set is
  TCPStore's native ``compare_set`` on the whole stored bytes (the writer id makes two writers
  of the same payload distinguishable);
- every successful write of version ``v`` also creates the marker key ``k@v``, so waiting for
  a change past version ``v`` is ``wait(["k@<v+1>"])``; the marker of ``v-2`` is deleted then
  (a waiter two versions behind sees the change at its wait's timeout, as every protocol wait
  is bounded and re-reads);
- a register (`Store.register`) is the contract's emulation on raw keys: ``<prefix>n`` (a
  TCPStore counter) draws the position, one ``multi_set`` writes ``<prefix>at/<position>`` (the
  value; waitable, as TCPStore waits for a key to exist) and ``<prefix>id/<name>``;
- liveness is a heartbeat counter per node (`CounterLiveness`) on its own client connection;
  so is a `KeyWatch`'s blocking wait (`watcher`; `interrupt` shuts it down at close);
- ``delete_prefix`` lists the store's keys (``list_keys``, torch >= 2.6; with an older torch
  nothing is deleted: the store dies with the job anyway) and deletes those under the prefix.

Counters (``add``) are plain TCPStore counters and are not waitable; the protocol never waits
on one. TCPStore's client does not retry a request, so an ``add`` applies once. torch is imported lazily: only multi-node jobs pay for it, and only in the agent.
"""

from __future__ import annotations

import ipaddress
import os
import socket
import threading
import uuid
from datetime import timedelta

from meshrun.rendezvous.api import RendezvousError, StoreLostError
from meshrun.rendezvous.store import CounterLiveness, Liveness, Store, Versioned, parse_position

DEFAULT_PORT = 29400
LIVENESS_PREFIX = "/liveness/"  # <prefix><node_id>: a node's heartbeat counter (`CounterLiveness`)

_CONNECT_LOCK = threading.Lock()

# Environment variables the agent sets for itself only; worker_env() takes them out again.
AGENT_ONLY_ENV: dict[str, str | None] = {}


def import_torch_distributed():
    """Import ``torch.distributed`` in the agent, with torch's C++ warnings off.

    TCPStore logs a warning for every wait that times out (the protocol's waits time out
    routinely) and a C++ stack for every failed connection; the agent reports store trouble in
    one line of its own instead. The workers keep the user's own ``TORCH_CPP_LOG_LEVEL`` (see
    `AGENT_ONLY_ENV`).
    """
    if "TORCH_CPP_LOG_LEVEL" not in AGENT_ONLY_ENV:
        AGENT_ONLY_ENV["TORCH_CPP_LOG_LEVEL"] = os.environ.get("TORCH_CPP_LOG_LEVEL")
        os.environ["TORCH_CPP_LOG_LEVEL"] = "FATAL"
    import torch.distributed as dist

    return dist


def parse_endpoint(endpoint: str, default_port: int = DEFAULT_PORT) -> tuple[str, int]:
    """Split ``host[:port]`` (IPv6 in brackets: ``[::1]:29400``) into host and port.

    Raises:
        ValueError: a malformed endpoint or port, named in the message.
    """
    text = endpoint.strip()
    if not text:
        raise ValueError("empty rendezvous endpoint; give --rdzv-endpoint HOST[:PORT]")
    if text.startswith("["):
        host, sep, rest = text[1:].partition("]")
        if not sep:
            raise ValueError(f"--rdzv-endpoint {endpoint}: missing ']' after an IPv6 address")
        port_text = rest[1:] if rest.startswith(":") else ""
        if rest and not rest.startswith(":"):
            raise ValueError(f"--rdzv-endpoint {endpoint}: expected ':PORT' after ']'")
    elif text.count(":") > 1:
        host, port_text = text, ""  # a bare IPv6 address
    else:
        host, _, port_text = text.partition(":")
    if not port_text:
        return host, default_port
    if not port_text.isdigit() or not 0 <= int(port_text) < 65536:
        raise ValueError(f"--rdzv-endpoint {endpoint}: port {port_text!r} is not 0..65535")
    return host, int(port_text)


def local_addresses() -> set[str]:
    """This host's own addresses, from its interfaces (psutil), without reverse DNS."""
    import psutil

    addrs = {"localhost"}
    for entries in psutil.net_if_addrs().values():
        for entry in entries:
            if entry.family in (socket.AF_INET, socket.AF_INET6):
                addrs.add(entry.address.split("%")[0])
    return addrs


def is_local_endpoint(host: str) -> bool:
    """Whether ``host`` names this machine: one of its addresses, or a name that resolves to
    one of them (forward lookups only)."""
    mine = local_addresses()
    if host in mine or host == socket.gethostname():
        return True
    try:
        ipaddress.ip_address(host)
        return False  # a literal address that is not ours
    except ValueError:
        pass
    try:
        infos = socket.getaddrinfo(host, None)
    except (OSError, UnicodeError):  # UnicodeError: a label over 63 characters (idna)
        return False
    return any(info[4][0].split("%")[0] in mine for info in infos)


def outbound_address(host: str, port: int) -> str:
    """The local address this host uses to reach ``host:port`` (a UDP connect sends nothing)."""
    try:
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        with socket.socket(family, socket.SOCK_DGRAM) as s:
            s.connect((host, port))
            return s.getsockname()[0]
    except (OSError, UnicodeError):
        return socket.gethostname()


def bind_address(host: str) -> str | None:
    """The address of this host that ``host`` names: ``host`` itself when it is a literal
    address of this host (or a loopback one), else the first address the name resolves to
    here that is one; None when there is none. A listening socket is bound to it, never to the
    wildcard (docs/design.md §3.7)."""
    mine = local_addresses()
    try:
        candidates = [str(ipaddress.ip_address(host.strip("[]")))]
    except ValueError:
        try:
            infos = socket.getaddrinfo(host, None, type=socket.SOCK_STREAM)
        except (OSError, UnicodeError):
            return None
        candidates = [info[4][0].split("%")[0] for info in infos]
    for addr in candidates:
        if addr in mine or ipaddress.ip_address(addr).is_loopback:
            return addr
    return None


def listen_socket(addr: str, port: int) -> socket.socket:
    """A listening TCP socket bound to ``addr:port`` (port 0: the OS picks one); ``addr`` ""
    is every interface (dual-stack where the host has IPv6).

    Raises:
        OSError: it cannot be bound (EADDRINUSE, EADDRNOTAVAIL) or listen.
    """
    sock = None
    if addr == "" and socket.has_ipv6:
        try:
            sock = socket.socket(socket.AF_INET6, socket.SOCK_STREAM)
            sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 0)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            sock.bind(("::", port))
        except OSError:
            sock.close()
            sock = None
    if sock is None:
        sock = socket.socket(socket.AF_INET6 if ":" in addr else socket.AF_INET)
        try:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            sock.bind((addr, port))
        except BaseException:
            sock.close()
            raise
    try:
        sock.listen(int(os.environ.get("MESHRUN_LISTEN_BACKLOG", "1024")))
    except BaseException:
        sock.close()
        raise
    return sock


def check_resolves(host: str, port: int, what: str) -> None:
    """Look ``host`` up at once, so a name that does not resolve (a typo, a name only the
    cluster's DNS knows) is one line naming it and the resolver's answer, not a connect that
    waits out its timeout.

    Raises:
        StoreLostError: the lookup failed (the agent exits 3).
    """
    try:
        socket.getaddrinfo(host.strip("[]"), port, type=socket.SOCK_STREAM)
    except socket.gaierror as e:
        raise StoreLostError(
            f"cannot resolve {what}'s host {host!r}: {e.strerror} (a typo, or a name only the "
            "cluster's DNS knows? give a name this host resolves, or an address)"
        ) from None
    except UnicodeError as e:
        raise StoreLostError(f"cannot resolve {what}'s host {host!r}: {e}") from None


class TCPStoreBackend(Store):
    """The store contract on a TCPStore at ``host:port``.

    Args:
        host, port: the store's address.
        is_host: start the store server in this process (the agent chosen to host it). Its
            socket is bound to the address ``host`` names on this host (`bind_address`), or
            with ``bind_all`` to every interface, and handed to TCPStore
            (``master_listen_fd``).
        timeout: seconds for connecting and for each blocking operation (``read_timeout``).
    Raises:
        StoreLostError: the store cannot be reached, hosted (``host`` is no address of this
            host, the port is taken), or stops answering.
    """

    def __init__(
        self, host: str, port: int, *, is_host: bool, timeout: float, bind_all: bool = False
    ):
        self.host, self.port, self.is_host, self.timeout = host, port, is_host, timeout
        self._writer = uuid.uuid4().hex[:8]
        listen_fd = None
        if is_host:  # port 0: the OS picks one, and the store's own client uses it
            listen_fd, self.host, self.port = self._listen(host, port, bind_all)
            host, port = self.host, self.port
        # The new connection is found by comparing this process's connections before and
        # after; a lock keeps two connects in one process from seeing each other's.
        with _CONNECT_LOCK:
            before = _tcp_fds_to(host, port)
            self._store = self._connect(host, port, is_host, timeout, listen_fd)
            self.port = self._store.port
            self.serves_others = is_host
            self._fds: set[int] = set()  # this client's own connection (`interrupt`)
            if not is_host:
                self._fds = _tcp_fds_to(host, self.port) - before
                for fd in self._fds:
                    _fail_fast_when_silent(fd, timeout)

    @staticmethod
    def _listen(host: str, port: int, bind_all: bool) -> tuple[int, str, int]:
        """Bind and listen for the store this agent hosts; return the descriptor, and the
        address and port its own clients connect to (the bound ones).

        Raises:
            StoreLostError: ``host`` names no address of this host, or the bind fails.
        """
        addr = "" if bind_all else bind_address(host)
        if addr is None:
            raise StoreLostError(
                f"cannot host the rendezvous store at {host}:{port}: {host} is not an address "
                "of this host, so the store cannot listen on it (give an endpoint address of "
                "this host, or --rdzv-conf bind_all=true to listen on every interface, e.g. "
                "behind NAT or a service address)"
            )
        try:
            sock = listen_socket(addr, port)
        except OSError as e:
            where = f"{addr}:{port}" if addr else f"port {port} (every interface)"
            raise StoreLostError(
                f"cannot host the rendezvous store at {host}:{port}: cannot listen on "
                f"{where}: {e.strerror or e} (is the port already in use?)"
            ) from None
        bound_port = sock.getsockname()[1]
        return sock.detach(), addr or host, bound_port

    @staticmethod
    def _connect(host: str, port: int, is_host: bool, timeout: float, listen_fd: int | None):
        """Host or reach the store, bounded by ``timeout`` seconds.

        TCPStore's client handshake has no deadline of its own: against a listener that is
        not a TCPStore it waits forever. It runs on a thread here (it releases the GIL), so a
        wrong endpoint is an error after ``timeout``, never a hang.
        """
        check_resolves(host, port, "the rendezvous store")
        dist = import_torch_distributed()
        outcome: list = []

        def connect() -> None:
            try:
                outcome.append(
                    dist.TCPStore(
                        host,
                        port,
                        is_master=is_host,
                        wait_for_workers=False,
                        timeout=timedelta(seconds=timeout),
                        use_libuv=True,
                        **({"master_listen_fd": listen_fd} if listen_fd is not None else {}),
                    )
                )
            except Exception as e:  # noqa: BLE001 - reported below (the agent exits 3)
                outcome.append(e)

        before = _tcp_fds_to(host, port)
        thread = threading.Thread(target=connect, name="meshrun-store-connect", daemon=True)
        thread.start()
        thread.join(timeout + 1.0)
        if not outcome:
            # Unblock the handshake (a thread stuck in C++ at exit would abort the process).
            for fd in _tcp_fds_to(host, port) - before:
                _shutdown(fd)
            thread.join(5.0)
            raise StoreLostError(
                f"the rendezvous store at {host}:{port} did not answer within {timeout:g} s "
                "(read_timeout): is something other than a meshrun/torch store listening there?"
            )
        if isinstance(outcome[0], Exception):
            verb = "host" if is_host else "reach"
            hint = (
                "is the port already in use?"
                if is_host
                else "is the node hosting the store up, and the endpoint right?"
            )
            raise StoreLostError(
                f"cannot {verb} the rendezvous store at {host}:{port}: "
                f"{_first_line(outcome[0])} ({hint})"
            )
        return outcome[0]

    # -- helpers ---------------------------------------------------------------------------------
    def _lost(self, e: Exception) -> StoreLostError:
        return StoreLostError(
            f"rendezvous store at {self.host}:{self.port} lost: {_first_line(e)}"
        )

    def _call(self, fn, *args):
        try:
            return fn(*args)
        except Exception as e:  # noqa: BLE001 - TCPStore raises several error types
            raise self._lost(e) from None

    @staticmethod
    def _parse(raw: bytes) -> Versioned:
        version, sep, rest = raw.partition(b"|")
        _, _, payload = rest.partition(b"|")
        if not sep or not version.isdigit():
            raise RendezvousError(
                f"a rendezvous value in the c10d store is malformed ({raw[:40]!r}): another "
                f"program is writing to the job's store; give the job its own --rdzv-id or "
                f"endpoint")
        return Versioned(payload, int(version))

    # -- the contract ----------------------------------------------------------------------------
    def get(self, key: str) -> Versioned | None:
        if not self._call(self._store.check, [key]):
            return None
        return self._parse(self._call(self._store.get, key))

    def get_many(self, keys: list[str]) -> list[Versioned | None]:
        if keys and self._call(self._store.check, keys):
            return [self._parse(raw) for raw in self._call(self._store.multi_get, keys)]
        if len(keys) < 2:
            return [self.get(key) for key in keys]
        # some are absent (check is True only when all exist): which, then one multi_get
        present = [key for key in keys if self._call(self._store.check, [key])]
        if not present:
            return [None] * len(keys)
        raws = dict(zip(present, self._call(self._store.multi_get, present), strict=True))
        return [self._parse(raws[key]) if key in raws else None for key in keys]

    def compare_and_set(self, key, expected_version, value):
        if expected_version == 0:
            expected_raw = b""
        else:
            current = self.get(key)
            if current is None or current.version != expected_version:
                return False, current
            expected_raw = self._call(self._store.get, key)
        version = expected_version + 1
        new_raw = b"%d|%s|%s" % (version, self._writer.encode(), value)
        stored = self._call(self._store.compare_set, key, expected_raw, new_raw)
        if stored != new_raw:
            return False, self._parse(stored) if stored else None
        self._call(self._store.set, f"{key}@{version}", b"1")
        if version > 2:  # keep the last two markers: a key changed every round stays bounded
            self._call(self._store.delete_key, f"{key}@{version - 2}")
        return True, Versioned(value, version)

    def add(self, key: str, delta: int) -> int:
        return int(self._call(self._store.add, key, delta))

    def wait_for_change(self, key, version, timeout):
        marker = f"{key}@{version + 1}"
        try:
            self._store.wait([marker], timedelta(seconds=max(timeout, 0.001)))
        except Exception as e:  # noqa: BLE001
            if not _is_timeout(e):
                raise self._lost(e) from None
        return self.get(key)

    def register(self, prefix: str, name: str, value: bytes) -> int:
        id_key = f"{prefix}id/{name}"
        if self._call(self._store.check, [id_key]):
            return parse_position(self._call(self._store.get, id_key), prefix)
        position = int(self._call(self._store.add, prefix + "n", 1))
        self._call(
            self._store.multi_set,
            [f"{prefix}at/{position}", id_key],
            [value, str(position).encode()],
        )
        return position

    def entries(self, prefix: str, limit: int, timeout: float) -> list[bytes]:
        keys = [f"{prefix}at/{position}" for position in range(1, limit + 1)]
        if not keys:
            return []
        try:  # waits for entries counted but not written yet
            self._store.wait(keys, timedelta(seconds=max(timeout, 0.001)))
        except Exception as e:  # noqa: BLE001
            if not _is_timeout(e):
                raise self._lost(e) from None
            missing = next(i for i, k in enumerate(keys) if not self._call(self._store.check, [k]))
            raise RendezvousError(
                f"entry #{missing + 1} of {prefix} was counted but never written within "
                f"{timeout:g} s (its writer died?)"
            ) from None
        return list(self._call(self._store.multi_get, keys))

    def delete_prefix(self, prefix: str) -> None:
        if not hasattr(self._store, "list_keys"):
            return  # torch < 2.6: the keys stay until the store (the job) ends
        for key in self._call(self._store.list_keys):
            if key.startswith(prefix):
                self._call(self._store.delete_key, key)

    def liveness(self, node_id: str, dead_after: float) -> Liveness:
        # Its own connection: the heartbeat thread must not queue behind a blocked wait.
        client = TCPStoreBackend(self.host, self.port, is_host=False, timeout=self.timeout)
        return CounterLiveness(client, node_id, dead_after, prefix=LIVENESS_PREFIX)

    def watcher(self) -> TCPStoreBackend:
        # Its own connection: a blocked wait holds the one it is sent on.
        return TCPStoreBackend(self.host, self.port, is_host=False, timeout=self.timeout)

    interrupts = True

    def interrupt(self) -> None:
        """Shut this client's connection down, so a wait blocked on it raises at once (a
        thread left inside TCPStore's C++ at interpreter exit could abort the process)."""
        for fd in self._fds:
            _shutdown(fd)

    def close(self) -> None:
        self._store = None


def _tcp_fds_to(host: str, port: int) -> set[int]:
    """File descriptors of this process's TCP connections to ``host:port``."""
    import psutil

    try:
        addrs = {info[4][0] for info in socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)}
    except (OSError, UnicodeError):
        return set()
    addrs |= {f"::ffff:{a}" for a in addrs}
    return {
        c.fd
        for c in psutil.Process().net_connections(kind="tcp")
        if c.fd != -1 and c.raddr and c.raddr.port == port and c.raddr.ip in addrs
    }


def _shutdown(fd: int) -> None:
    """Shut down the socket behind ``fd`` (both directions), through a duplicate."""
    try:
        sock = socket.socket(fileno=os.dup(fd))
    except OSError:
        return
    try:
        sock.shutdown(socket.SHUT_RDWR)
    except OSError:
        pass
    finally:
        sock.close()


def _fail_fast_when_silent(fd: int, timeout: float) -> None:
    """Make a store connection fail within about ``timeout`` seconds when its peer goes silent.

    A host that vanishes (power, network cut) sends no RST: TCPStore would wait on the socket
    forever. ``TCP_USER_TIMEOUT`` bounds how long sent data may stay unacknowledged, and
    keep-alive probes cover a connection that is idle; the socket then errors, TCPStore raises,
    and the agent reports the store as lost (exit 3). Set on a duplicate of the descriptor,
    which shares the socket.
    """
    try:
        sock = socket.socket(fileno=os.dup(fd))
    except OSError:
        return  # closed meanwhile
    try:
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_USER_TIMEOUT, int(timeout * 1000))
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
        interval = max(1, int(timeout / 3))
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPIDLE, interval)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPINTVL, interval)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPCNT, 3)
    except OSError:
        pass  # not a TCP socket after all, or an option this kernel lacks
    finally:
        sock.close()  # closes the duplicate only; TCPStore's descriptor stays open


def _first_line(e: BaseException) -> str:
    text = str(e).strip().splitlines()
    return text[0] if text else type(e).__name__


def _is_timeout(e: BaseException) -> bool:
    text = str(e).lower()
    return "timeout" in text or "timed out" in text

