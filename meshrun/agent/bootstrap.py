"""The workers' bootstrap store: a fresh TCPStore per round, hosted by node rank 0's agent.

Workers find each other through ``MASTER_ADDR:MASTER_PORT`` and, with
``TORCHELASTIC_USE_AGENT_STORE=True``, connect to it as TCPStore clients (torch's ``env://``
rendezvous does this). A fresh store per round means no worker ever reads a stale key from an
earlier attempt (the torchrun restart hang of pytorch#135712).

The port race is avoided by binding the listening socket ourselves on port 0 (the OS picks a
free port) and keeping it; the ~1 s ``import torch`` that TCPStore needs runs on a thread, so the
workers start at once and their connections wait in the socket's backlog until the store takes
the socket over (``TCPStore(..., master_listen_fd=fd)``).
"""

from __future__ import annotations

import os
import socket
import threading
from datetime import timedelta


class BootstrapStore:
    """One round's workers' store.

    Args:
        bind_addr: the address to listen on ("" for every interface, IPv4 and IPv6 where the
            host has IPv6; "127.0.0.1" for a single-node job, which needs nothing from outside).
        timeout: seconds the store waits on a blocking request.
    """

    def __init__(self, bind_addr: str, timeout: float = 1800.0):  # 30 min, as torch's default
        self._bind_addr = bind_addr
        self._timeout = timeout
        self._sock: socket.socket | None = None
        self._thread: threading.Thread | None = None
        self._store = None
        self.error: BaseException | None = None

    def open(self) -> int:
        """Bind and listen now (workers may connect at once); return the port."""
        sock = _listen_socket(self._bind_addr)
        sock.listen(int(os.environ.get("MESHRUN_LISTEN_BACKLOG", "1024")))
        self._sock = sock
        return sock.getsockname()[1]

    def serve(self) -> None:
        """Start the TCPStore server on a thread (no-op unless `open` was called this round).

        Called after the workers are spawned and registered with the reaper: the thread's
        ``import torch`` holds the GIL for long stretches, and must not delay that.
        """
        if self._sock is None or self._thread is not None:
            return
        port = self._sock.getsockname()[1]
        self._thread = threading.Thread(
            target=self._serve, args=(port,), name="meshrun-bootstrap", daemon=True
        )
        self._thread.start()

    def _serve(self, port: int) -> None:
        try:
            from meshrun.rendezvous.c10d import import_torch_distributed

            dist = import_torch_distributed()

            fd = self._sock.detach()  # the store owns the fd from here on
            self._store = dist.TCPStore(
                self._bind_addr or "0.0.0.0",
                port,
                is_master=True,
                wait_for_workers=False,
                timeout=timedelta(seconds=self._timeout),
                master_listen_fd=fd,
            )
        except BaseException as e:  # noqa: BLE001 - reported by close(); workers will time out
            self.error = e

    def close(self) -> None:
        """Stop serving (after the round's workers are gone)."""
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        self._store = None
        if self._sock is not None and self._sock.fileno() != -1:
            self._sock.close()
        self._sock = None


def _listen_socket(addr: str) -> socket.socket:
    """A TCP socket bound to ``addr`` on an OS-assigned port; "" is dual-stack where possible."""
    if addr == "" and socket.has_ipv6:
        try:
            sock = socket.socket(socket.AF_INET6, socket.SOCK_STREAM)
            sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 0)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            sock.bind(("::", 0))
            return sock
        except OSError:
            sock.close()
    family = socket.AF_INET6 if ":" in addr else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((addr, 0))
    return sock
