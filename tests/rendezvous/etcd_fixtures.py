"""Real etcd servers for the tests: one member, or a 3-member cluster, on 127.0.0.1.

Each member gets free client and peer ports and a temp data dir, is started as a subprocess
(its own session), waited for until ``/health`` answers, and stopped by its PID at teardown.
Tests are skipped, with the reason, only when the ``etcd`` binary is missing. Timings suit a
loaded 2-core machine: a raised heartbeat interval and election timeout keep leaders stable.
"""

from __future__ import annotations

import base64
import os
import shutil
import signal
import ssl
import subprocess
import time
import urllib.request
from pathlib import Path

import pytest
from support import free_port

ETCD = shutil.which("etcd") or ("/usr/bin/etcd" if os.path.exists("/usr/bin/etcd") else None)
SKIP_REASON = "the etcd binary is not installed (apt install etcd-server, or put etcd on PATH)"
needs_etcd = pytest.mark.skipif(ETCD is None, reason=SKIP_REASON)


class EtcdMember:
    """One etcd process (a member of a cluster of one or more)."""

    def __init__(self, name: str, data_dir: Path, scheme: str = "http"):
        self.name = name
        self.data_dir = data_dir
        self.scheme = scheme
        self.client_port = free_port()
        self.peer_port = free_port()
        self.proc: subprocess.Popen | None = None
        self.log = data_dir.parent / f"{name}.log"
        self.extra: list[str] = []

    @property
    def endpoint(self) -> str:
        return f"127.0.0.1:{self.client_port}"

    @property
    def url(self) -> str:
        return f"{self.scheme}://{self.endpoint}"

    @property
    def peer_url(self) -> str:
        return f"http://127.0.0.1:{self.peer_port}"

    def start(self, initial_cluster: str, cluster_size: int, token: str) -> None:
        slow = cluster_size > 1
        cmd = [
            ETCD, "--name", self.name, "--data-dir", str(self.data_dir),
            "--listen-client-urls", self.url, "--advertise-client-urls", self.url,
            "--listen-peer-urls", self.peer_url, "--initial-advertise-peer-urls", self.peer_url,
            "--initial-cluster", initial_cluster, "--initial-cluster-state", "new",
            "--initial-cluster-token", token,
            "--heartbeat-interval", "200" if slow else "100",
            "--election-timeout", "2000" if slow else "1000",
            "--logger", "zap", "--log-level", "warn",
            *self.extra,
        ]  # fmt: skip
        self.proc = subprocess.Popen(
            cmd, stdout=subprocess.DEVNULL, stderr=open(self.log, "w"), start_new_session=True
        )

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            os.kill(self.proc.pid, signal.SIGKILL)
            self.proc.wait(10)


class EtcdCluster:
    """``size`` members on 127.0.0.1; ``endpoints`` is the comma list for --rdzv-endpoint."""

    def __init__(self, base: Path, size: int = 1, tls: dict | None = None):
        base.mkdir(parents=True, exist_ok=True)
        self.tls = tls  # {"cacert", "cert", "key"} server files, or None
        scheme = "https" if tls else "http"
        self.members = [
            EtcdMember(f"m{i}", base / f"m{i}.etcd", scheme) for i in range(size)
        ]
        for m in self.members:
            if tls:
                m.extra = ["--cert-file", tls["cert"], "--key-file", tls["key"]]
                if tls.get("client_ca"):
                    m.extra += ["--client-cert-auth", "--trusted-ca-file", tls["client_ca"]]

    @property
    def endpoints(self) -> str:
        return ",".join(m.endpoint for m in self.members)

    @property
    def endpoint(self) -> str:
        return self.members[0].endpoint

    def start(self, timeout: float = 30) -> EtcdCluster:
        initial = ",".join(f"{m.name}={m.peer_url}" for m in self.members)
        token = f"meshrun-test-{os.getpid()}-{self.members[0].peer_port}"  # one per cluster
        for m in self.members:
            m.start(initial, len(self.members), token)
        deadline = time.monotonic() + timeout
        for m in self.members:
            while not self.healthy(m):
                if m.proc.poll() is not None or time.monotonic() > deadline:
                    log = m.log.read_text() if m.log.exists() else ""
                    self.stop()
                    raise RuntimeError(f"etcd member {m.name} did not become healthy:\n{log}")
                time.sleep(0.1)
        return self

    def _ssl_context(self):
        if not self.tls:
            return None
        ctx = ssl.create_default_context(cafile=self.tls["cacert"])
        if self.tls.get("client_cert"):
            ctx.load_cert_chain(self.tls["client_cert"], self.tls["client_key"])
        return ctx

    def healthy(self, member: EtcdMember) -> bool:
        try:
            with urllib.request.urlopen(
                f"{member.url}/health", timeout=1, context=self._ssl_context()
            ) as r:
                return b'"true"' in r.read()
        except OSError:
            return False

    def post(self, path: str, body: dict, token: str | None = None, member: int = 0) -> dict:
        """One v3 JSON-gateway call (test setup: auth, inspection)."""
        import json

        m = self.members[member]
        req = urllib.request.Request(
            f"{m.url}/v3/{path.lstrip('/')}", data=json.dumps(body).encode(), method="POST"
        )
        if token:
            req.add_header("Authorization", token)
        with urllib.request.urlopen(req, timeout=5, context=self._ssl_context()) as r:
            return json.loads(r.read() or b"{}")

    def keys(self, prefix: str, token: str | None = None, member: int = 0) -> list[str]:
        """Every key under ``prefix`` now stored (a live member answers)."""
        end = bytearray(prefix.encode())
        end[-1] += 1
        body = {"key": _b64(prefix.encode()), "range_end": _b64(bytes(end)), "keys_only": True}
        result = self.post("kv/range", body, token, member)
        return sorted(base64.b64decode(kv["key"]).decode() for kv in result.get("kvs", []))

    def get(self, key: str, member: int = 0) -> bytes | None:
        """The value stored at ``key`` now, or None."""
        kvs = self.post("kv/range", {"key": _b64(key.encode())}, member=member).get("kvs")
        return base64.b64decode(kvs[0].get("value", "")) if kvs else None

    def metric(self, name: str, member: int = 0) -> float:
        """The sum of a Prometheus counter's samples from the member's /metrics."""
        m = self.members[member]
        with urllib.request.urlopen(f"{m.url}/metrics", timeout=5, context=self._ssl_context()) as r:
            text = r.read().decode()
        return sum(
            float(line.rsplit(" ", 1)[1])
            for line in text.splitlines()
            if line.startswith(name) and line[len(name)] in " {"
        )

    def enable_auth(self, user: str, password: str) -> None:
        """Add ``root`` (with ``password``) and ``user``, then turn auth on."""
        self.post("auth/role/add", {"name": "root"})
        for name in {"root", user}:
            self.post("auth/user/add", {"name": name, "password": password})
            self.post("auth/user/grant", {"user": name, "role": "root"})
        self.post("auth/enable", {})

    def stop(self) -> None:
        for m in self.members:
            m.kill()


def _b64(data: bytes) -> str:
    return base64.b64encode(data).decode()


def make_ca(tmp: Path, name: str = "ca") -> dict:
    """A throwaway CA and a server + client certificate for 127.0.0.1, via the openssl CLI."""
    tmp.mkdir(parents=True, exist_ok=True)

    def run(*args: str) -> None:
        subprocess.run(["openssl", *args], check=True, capture_output=True, cwd=tmp, timeout=60)

    ca_key, ca_crt = f"{name}.key", f"{name}.crt"
    run("req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", ca_key, "-out", ca_crt,
        "-days", "2", "-subj", f"/CN=meshrun test {name}")  # fmt: skip
    ext = tmp / "san.ext"
    ext.write_text("subjectAltName=IP:127.0.0.1,DNS:localhost\n")
    files = {"cacert": str(tmp / ca_crt)}
    for role in ("server", "client"):
        run("req", "-newkey", "rsa:2048", "-nodes", "-keyout", f"{name}-{role}.key",
            "-out", f"{name}-{role}.csr", "-subj", f"/CN={role}")  # fmt: skip
        run("x509", "-req", "-in", f"{name}-{role}.csr", "-CA", ca_crt, "-CAkey", ca_key,
            "-CAcreateserial", "-out", f"{name}-{role}.crt", "-days", "2",
            "-extfile", "san.ext")  # fmt: skip
        files[role] = str(tmp / f"{name}-{role}.crt")
        files[f"{role}_key"] = str(tmp / f"{name}-{role}.key")
    return files


@pytest.fixture
def etcd_server(tmp_path_factory):
    """One etcd member on free ports (skipped when etcd is not installed)."""
    if ETCD is None:
        pytest.skip(SKIP_REASON)
    cluster = EtcdCluster(tmp_path_factory.mktemp("etcd")).start()
    try:
        yield cluster
    finally:
        cluster.stop()


@pytest.fixture
def etcd_cluster3(tmp_path_factory):
    """Three etcd members on free ports (skipped when etcd is not installed)."""
    if ETCD is None:
        pytest.skip(SKIP_REASON)
    cluster = EtcdCluster(tmp_path_factory.mktemp("etcd3"), size=3).start(timeout=60)
    try:
        yield cluster
    finally:
        cluster.stop()
