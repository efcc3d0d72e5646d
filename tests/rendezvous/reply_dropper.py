"""A TCP proxy in front of one etcd member that loses chosen replies: an ambiguous outcome.

etcd applies the request; its reply never reaches the client, which times out and, like any
etcd client, retries on the next member. This is the "applied, but did the write happen?"
case that a request timeout, a member crash after commit, or a cut link produce for real.

The proxy speaks just enough HTTP/1.1 to see request boundaries on a keep-alive connection
(the request line, the headers, a ``Content-Length`` body: what ``requests`` sends to etcd's
JSON gateway); everything else is forwarded byte for byte. ``drop(path, body)`` picks the
requests whose reply is lost (``body`` is the decoded JSON); the first ``times`` of them are.
Stdlib only; stopped with `close`.
"""

from __future__ import annotations

import base64
import json
import socket
import threading
from collections.abc import Callable


class ReplyDropper:
    """Listen on 127.0.0.1 (a free port) and forward to ``upstream`` ("host:port")."""

    def __init__(self, upstream: str, drop: Callable[[str, dict], bool], times: int = 1):
        host, _, port = upstream.rpartition(":")
        self._upstream = (host, int(port))
        self._drop = drop
        self._left = times
        self._lock = threading.Lock()
        self.dropped: list[tuple[str, dict]] = []  # (path, body) of each reply lost
        self._server = socket.create_server(("127.0.0.1", 0))
        self._closed = False
        self._sockets: list[socket.socket] = []
        threading.Thread(target=self._accept, name="reply-dropper", daemon=True).start()

    @property
    def endpoint(self) -> str:
        return f"127.0.0.1:{self._server.getsockname()[1]}"

    def close(self) -> None:
        self._closed = True
        self._server.close()
        for s in list(self._sockets):
            _close(s)

    # -- the proxy -----------------------------------------------------------------------------
    def _accept(self) -> None:
        while not self._closed:
            try:
                client, _ = self._server.accept()
            except OSError:
                return
            try:
                upstream = socket.create_connection(self._upstream)
            except OSError:  # etcd is gone (the test is ending)
                _close(client)
                continue
            self._sockets += [client, upstream]
            muted = threading.Event()  # set: the replies on this connection are lost
            threading.Thread(target=self._requests, args=(client, upstream, muted), daemon=True).start()
            threading.Thread(target=self._replies, args=(upstream, client, muted), daemon=True).start()

    def _requests(self, client: socket.socket, upstream: socket.socket, muted: threading.Event):
        buffer = b""
        try:
            while True:
                while b"\r\n\r\n" not in buffer:
                    chunk = client.recv(65536)
                    if not chunk:
                        return
                    buffer += chunk
                head, _, buffer = buffer.partition(b"\r\n\r\n")
                length = 0
                for line in head.split(b"\r\n")[1:]:
                    name, _, value = line.partition(b":")
                    if name.strip().lower() == b"content-length":
                        length = int(value.strip())
                while len(buffer) < length:
                    chunk = client.recv(65536)
                    if not chunk:
                        return
                    buffer += chunk
                body, buffer = buffer[:length], buffer[length:]
                path = head.split(b" ", 2)[1].decode()
                try:
                    decoded = json.loads(body) if body else {}
                except ValueError:
                    decoded = {}
                with self._lock:
                    if self._left > 0 and self._drop(path, decoded):
                        self._left -= 1
                        self.dropped.append((path, decoded))
                        muted.set()  # before etcd can answer
                upstream.sendall(head + b"\r\n\r\n" + body)
        except OSError:
            pass
        finally:
            _close(upstream)
            if not muted.is_set():
                _close(client)

    @staticmethod
    def _replies(upstream: socket.socket, client: socket.socket, muted: threading.Event):
        try:
            while True:
                chunk = upstream.recv(65536)
                if not chunk:
                    break
                if not muted.is_set():
                    client.sendall(chunk)
        except OSError:
            pass
        finally:
            if not muted.is_set():
                _close(client)  # a muted client keeps waiting until its own read timeout


def txn_puts(body: dict) -> list[str]:
    """The keys a ``kv/txn`` request body would put, in either branch."""
    keys = []
    for branch in ("success", "failure"):
        for op in body.get(branch) or []:
            put = op.get("request_put")
            if put:
                keys.append(base64.b64decode(put["key"]).decode())
    return keys


def puts_under(prefix: str) -> Callable[[str, dict], bool]:
    """A ``drop`` predicate: a transaction that puts a key under ``prefix``."""
    return lambda path, body: path.endswith("/kv/txn") and any(
        key.startswith(prefix) for key in txn_puts(body)
    )


def _close(s: socket.socket) -> None:
    try:
        s.shutdown(socket.SHUT_RDWR)
    except OSError:
        pass
    s.close()
