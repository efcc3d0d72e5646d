"""The workers' bootstrap store: a fresh TCPStore per round, hosted by node rank 0's agent.

Workers find each other through ``MASTER_ADDR:MASTER_PORT`` and, with
``TORCHELASTIC_USE_AGENT_STORE=True``, connect to it as TCPStore clients (torch's ``env://``
rendezvous does this). A fresh store per round means no worker ever reads a stale key from an
earlier attempt (the torchrun restart hang of pytorch#135712).

The port race is avoided by binding the listening socket ourselves on port 0 (the OS picks a
free port) and keeping it; the ~1 s ``import torch`` that TCPStore needs runs on a thread, so the
workers start at once and their connections wait in the socket's backlog until the store takes
the socket over (``TCPStore(..., master_listen_fd=fd)``).

When the store cannot start (torch does not import, TCPStore refuses the socket), nobody would
ever accept the workers' connections: they would wait in the backlog until their own timeout.
So the error is kept and `BootstrapStore.check` raises it on the agent's next monitor tick,
which ends the round. The listening descriptor is the agent's until TCPStore has taken it;
`BootstrapStore.close` closes it unless the store did (checked by its identity, not its
number, which may have been reused meanwhile).
"""

from __future__ import annotations

import os
import threading
from datetime import timedelta


class BootstrapError(RuntimeError):
    """The workers' store failed to start (the round cannot run: exit 3)."""


class BootstrapStore:
    """One round's workers' store.

    Args:
        bind_addr: the address to listen on: the one this node advertises as MASTER_ADDR
            ("127.0.0.1" for a single-node job, which needs nothing from outside); "" for every
            interface, IPv4 and IPv6 where the host has IPv6 (``--rdzv-conf bind_all=true``).
        timeout: seconds the store waits on a blocking request.
        port: the port to listen on every round (``--rdzv-conf workers_port=N``: a pod's
            declared port), or 0 (the OS picks a free one each round). A fixed port still
            gets a fresh store per round: the last round's is closed before the next binds.
    """

    def __init__(self, bind_addr: str, timeout: float = 1800.0, port: int = 0):  # 30 min: torch's
        self._bind_addr = bind_addr
        self._wanted_port = port
        self._timeout = timeout
        self._fd: int | None = None  # the listening socket, ours until the store takes it
        self._fd_id: tuple[int, int] | None = None  # its (st_dev, st_ino)
        self._port = 0
        self._thread: threading.Thread | None = None
        self._store = None
        self.error: BaseException | None = None

    def open(self) -> int:
        """Bind and listen now (workers may connect at once); return the port.

        Raises:
            OSError: the socket cannot be bound or listen.
        """
        from meshrun.rendezvous.c10d import listen_socket  # no torch import

        sock = listen_socket(self._bind_addr, self._wanted_port)
        self._port = sock.getsockname()[1]
        st = os.fstat(sock.fileno())
        self._fd, self._fd_id = sock.detach(), (st.st_dev, st.st_ino)
        self.error = None
        return self._port

    def serve(self) -> None:
        """Start the TCPStore server on a thread (no-op unless `open` was called this round).

        Called after the workers are spawned and registered with the reaper: the thread's
        ``import torch`` holds the GIL for long stretches, and must not delay that. A failure
        to start is kept in ``error`` and raised by `check`.
        """
        if self._fd is None or self._thread is not None:
            return
        self._thread = threading.Thread(target=self._serve, name="meshrun-bootstrap", daemon=True)
        self._thread.start()

    def check(self) -> None:
        """Raise `BootstrapError` when the store failed to start (called every monitor tick).

        Raises:
            BootstrapError: with the port and the cause; the workers cannot meet this round.
        """
        if self.error is not None:
            e = self.error
            raise BootstrapError(
                f"the workers' store (TCPStore on port {self._port}) failed to start: "
                f"{type(e).__name__}: {e}; the workers could not meet (check the agent's "
                "torch install: the agent imports torch for this store)"
            )

    def _serve(self) -> None:
        try:
            from meshrun.rendezvous.c10d import import_torch_distributed

            dist = import_torch_distributed()
            self._store = dist.TCPStore(
                self._bind_addr or "0.0.0.0",
                self._port,
                is_master=True,
                wait_for_workers=False,
                timeout=timedelta(seconds=self._timeout),
                master_listen_fd=self._fd,  # the store closes it when it is destroyed
            )
        except BaseException as e:  # noqa: BLE001 - raised on the agent's thread by check()
            self.error = e

    def close(self) -> None:
        """Stop serving (after the round's workers are gone) and close the listening socket,
        unless the store closed it already. Idempotent; never raises."""
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        self._store = None  # its destructor stops the server and closes the socket
        if self._fd is not None:
            _close_if_same(self._fd, self._fd_id)
        self._fd = self._fd_id = None


def _close_if_same(fd: int, ident: tuple[int, int] | None) -> None:
    """Close ``fd`` if it still is the file ``ident`` (st_dev, st_ino): the store may have
    closed it already, and its number may belong to another file by now."""
    try:
        st = os.fstat(fd)
    except OSError:
        return
    if (st.st_dev, st.st_ino) == ident:
        os.close(fd)
