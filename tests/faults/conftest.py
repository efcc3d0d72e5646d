"""Fixtures of the fault-matrix tests: hosts as Linux network namespaces.

`netns_pair` makes two namespaces joined by a veth pair with private /30 addresses that exist
only inside them (10.213.7.1 and 10.213.7.2): nothing is ever sent outside the namespaces the
test made. Each namespace gets ``lo`` up. Module-scoped (one scenario per module). The namespaces (and with them the veth ends) are
deleted at teardown, after every process the test started in them was killed, even when the
test failed. Skipped with the reason where namespaces cannot be made (not root, no ``ip``,
no CAP_SYS_ADMIN in a container).

`netns_trio` adds a third namespace C, an outsider on a second network: A and B keep their
private /30 (the job's link) and each gets a link to C (10.213.9.1-10.213.9.2 and
10.213.9.5-10.213.9.6), so C reaches A and B at their outside addresses, never the private
ones.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
from dataclasses import dataclass, field

import pytest


@dataclass
class Host:
    """One namespace as a host: its name, veth interface and address."""

    ns: str
    ifname: str
    addr: str

    def cmd(self, *argv: str) -> list[str]:
        """``argv`` run inside this namespace."""
        return ["ip", "netns", "exec", self.ns, *argv]


@dataclass
class NetnsPair:
    a: Host
    b: Host
    procs: list[subprocess.Popen] = field(default_factory=list)

    def cut(self) -> None:
        """Cut the link: B's end of the veth goes down (A keeps its address and its store)."""
        _ip("-n", self.b.ns, "link", "set", self.b.ifname, "down")

    def popen(self, host: Host, argv: list[str], **kw) -> subprocess.Popen:
        """Start ``argv`` inside ``host``'s namespace, in a session of its own (killed at
        teardown by process group)."""
        proc = subprocess.Popen(host.cmd(*argv), start_new_session=True, **kw)
        self.procs.append(proc)
        return proc


def _ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True, text=True, timeout=30)


def _cannot_make_namespaces() -> str | None:
    if shutil.which("ip") is None:
        return "no `ip` command (iproute2) on this machine"
    if os.geteuid() != 0:
        return "network namespaces need root (`ip netns add`)"
    probe = f"mrfprobe{os.getpid()}"
    done = subprocess.run(["ip", "netns", "add", probe], capture_output=True, text=True)
    if done.returncode != 0:
        return f"`ip netns add` fails here: {done.stderr.strip()}"
    subprocess.run(["ip", "netns", "del", probe], capture_output=True)
    return None


@pytest.fixture(scope="module")
def netns_pair():
    reason = _cannot_make_namespaces()
    if reason:
        pytest.skip(reason)
    tag = f"{os.getpid() % 100000}"
    a = Host(f"mrf{tag}a", f"mrf{tag}a", "10.213.7.1")
    b = Host(f"mrf{tag}b", f"mrf{tag}b", "10.213.7.2")
    pair = NetnsPair(a, b)
    try:
        for h in (a, b):
            _ip("netns", "add", h.ns)
        _ip("link", "add", a.ifname, "netns", a.ns, "type", "veth", "peer", "name", b.ifname,
            "netns", b.ns)  # fmt: skip
        for h in (a, b):
            _ip("-n", h.ns, "addr", "add", f"{h.addr}/30", "dev", h.ifname)
            _ip("-n", h.ns, "link", "set", h.ifname, "up")
            _ip("-n", h.ns, "link", "set", "lo", "up")
        yield pair
    finally:
        _teardown(pair.procs, (a, b))


@dataclass
class NetnsTrio(NetnsPair):
    """A and B on a private link, each also linked to the outsider C: ``outside[h.ns]`` is the
    address C reaches host ``h`` at."""

    c: Host | None = None
    outside: dict[str, str] = field(default_factory=dict)


@pytest.fixture(scope="module")
def netns_trio():
    reason = _cannot_make_namespaces()
    if reason:
        pytest.skip(reason)
    tag = f"{os.getpid() % 100000}"
    a = Host(f"mrt{tag}a", f"mrt{tag}a", "10.213.7.1")
    b = Host(f"mrt{tag}b", f"mrt{tag}b", "10.213.7.2")
    c = Host(f"mrt{tag}c", "", "")
    trio = NetnsTrio(a, b, c=c)
    links = ((a, "10.213.9.1", "10.213.9.2"), (b, "10.213.9.5", "10.213.9.6"))
    try:
        for h in (a, b, c):
            _ip("netns", "add", h.ns)
            _ip("-n", h.ns, "link", "set", "lo", "up")
        _ip("link", "add", a.ifname, "netns", a.ns, "type", "veth", "peer", "name", b.ifname,
            "netns", b.ns)  # fmt: skip
        for h in (a, b):
            _ip("-n", h.ns, "addr", "add", f"{h.addr}/30", "dev", h.ifname)
            _ip("-n", h.ns, "link", "set", h.ifname, "up")
        for h, inside, outside in links:
            mine, theirs = f"{h.ifname}o", f"{h.ifname}c"
            _ip("link", "add", mine, "netns", h.ns, "type", "veth", "peer", "name", theirs,
                "netns", c.ns)  # fmt: skip
            _ip("-n", h.ns, "addr", "add", f"{inside}/30", "dev", mine)
            _ip("-n", c.ns, "addr", "add", f"{outside}/30", "dev", theirs)
            _ip("-n", h.ns, "link", "set", mine, "up")
            _ip("-n", c.ns, "link", "set", theirs, "up")
            trio.outside[h.ns] = inside
        yield trio
    finally:
        _teardown(trio.procs, (a, b, c))


def _teardown(procs: list[subprocess.Popen], hosts) -> None:
    """Kill what the test started in the namespaces (by process group), then delete them."""
    for p in procs:
        if p.poll() is None:
            try:
                os.killpg(p.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            try:
                p.wait(10)
            except subprocess.TimeoutExpired:
                pass
    for h in hosts:
        subprocess.run(["ip", "netns", "del", h.ns], capture_output=True)
