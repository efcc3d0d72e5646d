"""The etcd gateway client against servers that are not etcd, or not the etcd one expects.

Each case is one line and exit 3 in an agent (a `RendezvousError`), never a traceback, a
hang or a busy loop: found by a breaker when the client moved from requests to urllib3.
"""

from __future__ import annotations

import json
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
from etcd_fixtures import free_port

from meshrun.rendezvous.api import RendezvousError
from meshrun.rendezvous.etcd import EtcdOptions, EtcdStore
from meshrun.rendezvous.etcd_gateway import Gateway, b64

pytestmark = pytest.mark.timeout(60)


class _Fake(BaseHTTPRequestHandler):
    """Answers every POST with the server's ``reply(path) -> (status, body bytes)``."""

    def do_POST(self):  # noqa: N802 - http.server's name
        self.rfile.read(int(self.headers.get("Content-Length", 0)))
        status, body = self.server.reply(self.path)
        self.send_response(status)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args):
        pass


@pytest.fixture
def fake():
    """``fake(reply)``: the endpoint of an HTTP server on 127.0.0.1 answering with ``reply``."""
    servers = []

    def start(reply):
        server = ThreadingHTTPServer(("127.0.0.1", 0), _Fake)
        server.reply = reply
        threading.Thread(target=server.serve_forever, daemon=True).start()
        servers.append(server)
        return f"127.0.0.1:{server.server_address[1]}"

    yield start
    for server in servers:
        server.shutdown()
        server.server_close()


@pytest.mark.parametrize(("status", "body", "says"), [
    (200, b"", "not etcd's v3 gateway JSON"),
    (200, b"<html>welcome</html>", "not etcd's v3 gateway JSON"),
    (200, b"[1, 2]", "not etcd's v3 gateway JSON"),
    (404, b"404 page not found", "answered HTTP 404"),
    (500, b"<html>" + b"x" * 50_000 + b"</html>", "answered HTTP 500"),
])  # fmt: skip
def test_a_server_that_is_not_etcd_is_one_short_error(fake, status, body, says):
    endpoint = fake(lambda path: (status, body))
    options = EtcdOptions.from_conf(endpoint, {}, read_timeout=3.0)
    start = time.monotonic()
    with pytest.raises(RendezvousError) as caught:
        EtcdStore(options, "/meshrun/t/")
    message = str(caught.value)
    assert says in message and "is --rdzv-endpoint an etcd client port?" in message, message
    assert endpoint in message and len(message) < 400 and "\n" not in message, message
    assert time.monotonic() - start < 2.5  # said at once, not retried for read_timeout


def test_a_token_that_stays_invalid_is_an_error_not_a_recursion(fake):
    """etcd takes the password but refuses every token it hands out: re-authenticated once,
    then an error (it recursed until RecursionError)."""

    def reply(path):
        if path.endswith("auth/authenticate"):
            return 200, json.dumps({"header": {}, "token": "t.1"}).encode()
        error = "etcdserver: invalid auth token"
        return 401, json.dumps({"error": error, "message": error, "code": 16}).encode()

    options = EtcdOptions.from_conf(fake(reply), {"user": "u", "password": "p",
                                                  "insecure": "true"}, read_timeout=3.0)
    gw = Gateway(options)
    with pytest.raises(RendezvousError, match="invalid auth token"):
        gw.call("kv/range", {"key": b64("k")})
    gw.close()


def test_a_watch_on_a_member_that_refuses_fails_over(etcd_server):
    """A member that refuses connections when a watch opens: the watch says 'broken' and moves
    to the next member (it said 'no event yet' and stayed: the store's wait re-opened it on
    the dead member in a busy loop until its timeout, missing the write)."""
    dead = f"127.0.0.1:{free_port()}"
    gw = Gateway(EtcdOptions.from_conf(f"{dead},{etcd_server.endpoint}", {}, read_timeout=3.0))
    try:
        changed, item, revision = gw.watch("/meshrun/t/k", 0, 1, 5.0)
        assert (changed, item, revision) == (False, None, -1)
        assert gw.current == 1
    finally:
        gw.close()


@pytest.mark.parametrize("forged", [b"notanumber", b"12345"])
def test_a_forged_job_lease_key_is_refused_not_waited_on(etcd_server, forged):
    """``<prefix>lease`` written by another program: a value that is not a lease id crashed
    the agent (ValueError), one naming a lease that does not exist was re-read for ever."""
    prefix = f"/meshrun/forged-{forged[:3].decode()}/"
    etcd_server.post("kv/put", {"key": b64(prefix + "lease"), "value": b64(forged)})
    options = EtcdOptions.from_conf(etcd_server.endpoint, {}, read_timeout=3.0)
    try:
        start = time.monotonic()
        with pytest.raises(RendezvousError, match="not this job's lease"):
            EtcdStore(options, prefix)
        assert time.monotonic() - start < 2.5
    finally:
        etcd_server.post("kv/deleterange", {"key": b64(prefix + "lease")})


def test_watch_messages_are_whole_however_the_chunks_cut_them():
    from meshrun.rendezvous.etcd_gateway import _json_lines

    big = {"v": "x" * 100_000}
    text = (json.dumps({"a": 1}) + "\n\n" + json.dumps(big) + "\n" + json.dumps({"c": 3}) + "\n")
    for size in (1, 7, 4096, len(text)):
        chunks = [text[i : i + size].encode() for i in range(0, len(text), size)]
        assert list(_json_lines(chunks)) == [{"a": 1}, big, {"c": 3}], size


def test_a_store_never_reached_is_said_so_not_lost():
    """Nothing listening at the endpoint: the line says the store was not reached and asks
    whether etcd runs there, instead of calling a store that never answered "lost"."""
    from meshrun.rendezvous.api import StoreLostError

    port = free_port()  # nothing listens on it
    options = EtcdOptions(endpoints=(("127.0.0.1", port),), read_timeout=1.0)
    with pytest.raises(StoreLostError) as caught:
        Gateway(options).call("kv/range", {"key": b64("/x")})
    line = str(caught.value)
    assert "store not reached" in line and f"127.0.0.1:{port}" in line, line
    assert "is etcd running there" in line and "lost" not in line, line
