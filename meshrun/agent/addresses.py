"""The addresses a node gives others and listens on.

A node advertises one address (the rendezvous' ``NodeDesc.addr``; node rank 0's is the
workers' MASTER_ADDR) and its stores listen on one address, never the wildcard unless
``--rdzv-conf bind_all=true`` asks (docs/design.md §3.7). The pitfall handled here: a host
name that /etc/hosts maps to 127.0.1.1 (Debian's default) makes the route to the rendezvous
store a loopback one, which other machines cannot reach.
"""

from __future__ import annotations

import ipaddress
import socket
from typing import NamedTuple

from meshrun.agent.config import LaunchConfig
from meshrun.agent.say import say
from meshrun.exits import ConfigError
from meshrun.rendezvous import RendezvousSettings
from meshrun.rendezvous.c10d import bind_address


def advertised(config: LaunchConfig, endpoint: str, addr: str) -> str:
    """The address other nodes (and their workers, as MASTER_ADDR) reach this node at.

    ``addr`` is the local address on the route to the rendezvous store. In a job that may
    span machines it must not be a loopback address, unless the endpoint itself is one
    (every node then runs on this machine): a host name that maps to 127.0.1.1 (Debian's
    /etc/hosts) gives exactly that. Then the address on this host's default route (or
    its first non-loopback interface address) is advertised instead, with a note.

    Raises:
        ConfigError: a loopback address and no other address to advertise; the message
            names ``--local-addr``.
    """
    if config.max_nodes == 1 or not _is_loopback(addr):
        return addr
    host = endpoint_host(endpoint)
    if _is_loopback_literal(host):
        return addr
    other = _non_loopback_address()
    if other is None:
        raise ConfigError(
            f"this node would tell other nodes to reach it at {addr}, a loopback address "
            f"(the rendezvous endpoint {host} resolves to it here), and it has "
            "no other address; give --local-addr ADDR with an address the other nodes "
            "can reach, or fix the host name's entry in /etc/hosts"
        )
    say(
        f"note: the rendezvous endpoint {host} resolves to the loopback address "
        f"{addr} here, which other nodes cannot reach; advertising {other} instead "
        "(give --local-addr to choose)"
    )
    return other


def note_loopback_store(endpoint: str, store) -> None:
    """Say so when the rendezvous store this node hosts listens on a loopback address
    although the endpoint is a name (a host name that /etc/hosts maps to 127.0.1.1):
    other machines cannot reach it there."""
    bound = getattr(store, "host", "") if store.serves_others else ""
    host = endpoint_host(endpoint)
    if bound and _is_loopback_literal(bound) and not _is_loopback_literal(host):
        say(
            f"note: the rendezvous endpoint {host} resolves to the loopback address "
            f"{bound} here, so the store listens there only, where other machines cannot "
            "reach it; for nodes on other machines give --rdzv-endpoint an address of this "
            "host (or fix /etc/hosts), or --rdzv-conf bind_all=true"
        )


def users_master(config: LaunchConfig, settings: RendezvousSettings) -> UsersMaster | None:
    """Where the workers' store goes when it is to be the user's: a one-node static job given
    ``--master-port P`` (or ``PET_MASTER_PORT``, P > 0). torchrun's static rendezvous hosts a
    TCPStore on P then and passes ``--master-addr`` and P through (``StaticTCPRendezvous``),
    so a script's ``init_method="tcp://localhost:P"`` meets there; meshrun's workers' store
    listens on P for it, on the address of this host that ``--master-addr`` names (every
    interface with ``--rdzv-conf bind_all=true``), and MASTER_ADDR is the name as given
    (``localhost`` stays ``localhost``). A ``--master-addr`` that is no address of this host
    (a name only a cluster's DNS resolves to another address) keeps the job running as before:
    127.0.0.1 for both, with a note. None otherwise (and with ``--rdzv-conf workers_port=N``,
    which names the store's port itself): the OS picks the port, and MASTER_ADDR is the
    address node rank 0 advertises. A static job of several nodes keeps its rendezvous store
    on P, so its workers' store cannot be there too."""
    c = config
    if c.rdzv_backend != "static" or c.max_nodes != 1 or c.standalone or not c.master_port:
        return None
    if "workers_port" in c.rdzv_conf:
        return None
    if settings.bind_all:
        return UsersMaster(c.master_addr, "", c.master_port)
    bind = bind_address(c.master_addr)
    if bind is None:
        say(f"note: --master-addr {c.master_addr} is not an address of this host; the workers' "
            f"store listens on 127.0.0.1 port {c.master_port} (--master-port), and the workers "
            "get MASTER_ADDR=127.0.0.1")  # fmt: skip
        return UsersMaster("127.0.0.1", "127.0.0.1", c.master_port)
    return UsersMaster(c.master_addr, bind, c.master_port)


class UsersMaster(NamedTuple):
    """The workers' store on the user's ``--master-port`` (`users_master`): the MASTER_ADDR
    the workers get, the address it listens on ("" for every interface), the port."""

    master_addr: str
    bind: str
    port: int


def bootstrap_bind(config: LaunchConfig, settings: RendezvousSettings, advertised: str) -> str:
    """The address the workers' store listens on when this node hosts it: the one it
    advertises as MASTER_ADDR (resolved here when a name), never the wildcard unless
    ``--rdzv-conf bind_all=true`` asks (""); 127.0.0.1 for a single-node job (`users_master`
    says where a one-node job given ``--master-port`` listens).

    Raises:
        ConfigError: the advertised address (``--local-addr``) is no address of this host.
    """
    if config.max_nodes == 1:
        return "127.0.0.1"
    if settings.bind_all:
        return ""
    addr = bind_address(advertised)
    if addr is None:
        given = " (--local-addr)" if config.local_addr else ""
        raise ConfigError(
            f"this node advertises {advertised}{given} to the workers as "
            "MASTER_ADDR, which is not an address of this host, so their store cannot "
            "listen on it; give --local-addr an address of this host, or --rdzv-conf "
            "bind_all=true to listen on every interface (e.g. behind NAT)"
        )
    return addr


def endpoint_host(endpoint: str) -> str:
    """The host of the first ``host[:port]`` in a (comma-separated) endpoint list."""
    first = endpoint.split(",")[0].strip()
    first = first.split("://", 1)[-1]  # etcd endpoints may carry a scheme
    try:
        from meshrun.rendezvous.c10d import parse_endpoint

        return parse_endpoint(first)[0]
    except ValueError:
        return first


def _is_loopback_literal(host: str) -> bool:
    """Whether ``host`` is "localhost" or a loopback address literal (127.0.0.0/8, ::1)."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def _is_loopback(addr: str) -> bool:
    """Whether ``addr`` is, or (a name) resolves only to, loopback addresses."""
    if _is_loopback_literal(addr):
        return True
    try:
        ipaddress.ip_address(addr)
        return False
    except ValueError:
        pass
    try:
        infos = socket.getaddrinfo(addr, None)
    except (OSError, UnicodeError):
        return False
    return bool(infos) and all(_is_loopback_literal(i[4][0].split("%")[0]) for i in infos)


def _non_loopback_address() -> str | None:
    """This host's address on its default route (a UDP connect sends nothing), else its first
    IPv4 (then IPv6) address on an interface that is up and neither loopback nor link-local;
    None when it has none."""
    for family, probe in ((socket.AF_INET, "198.51.100.1"), (socket.AF_INET6, "2001:db8::1")):
        try:
            with socket.socket(family, socket.SOCK_DGRAM) as s:
                s.connect((probe, 9))
                found = s.getsockname()[0]
            if not ipaddress.ip_address(found.split("%")[0]).is_loopback:
                return found
        except (OSError, ValueError):
            pass
    import psutil

    stats = psutil.net_if_stats()
    for family in (socket.AF_INET, socket.AF_INET6):
        for name, entries in psutil.net_if_addrs().items():
            if name in stats and not stats[name].isup:
                continue
            for entry in entries:
                if entry.family != family:
                    continue
                ip = ipaddress.ip_address(entry.address.split("%")[0])
                if not (ip.is_loopback or ip.is_link_local):
                    return str(ip)
    return None
