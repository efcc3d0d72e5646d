"""``meshrun stacks`` on an elastic job (``--nnodes 1:2``) while it has one node: its agent
answers through the store, as a multi-node job's do (c10d and etcd); and a job whose agents
all stay silent is one line on stderr and exit 1, not "0 rank(s)" and exit 0. Real runs: the
meshrun command, a plain torch script, a real TCPStore or etcd, a real SIGSTOP."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from support import free_port

pytestmark = pytest.mark.timeout(150)
REPO = Path(__file__).resolve().parents[2]
STALL = REPO / "tests" / "launcher" / "scripts" / "stall.py"
ENV = {**os.environ, "PYTHONPATH": str(REPO)}


def _job(tmp_path: Path, backend: str, endpoint: str) -> subprocess.Popen:
    """A one-node round of an elastic job: rank 0 in its own code, rank 1 in a barrier."""
    args = ["--nnodes", "1:2", "--nproc-per-node", "2", "--rdzv-backend", backend,
            "--rdzv-endpoint", endpoint, "--rdzv-id", "elastic",
            "--rdzv-conf", "last_call_timeout=0.5", str(STALL), str(tmp_path / "stop"),
            str(tmp_path / "ready")]  # fmt: skip
    return subprocess.Popen([sys.executable, "-m", "meshrun", *args], env=ENV, cwd=tmp_path,
                            stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)  # fmt: skip


def _wait_ready(tmp_path: Path, job: subprocess.Popen) -> None:
    ready, deadline = tmp_path / "ready", time.monotonic() + 90
    while not (ready.exists() and len(ready.read_text().split()) == 2):
        assert job.poll() is None and time.monotonic() < deadline, job.poll()
        time.sleep(0.1)
    time.sleep(0.5)  # into read_batch / the barrier


def _stacks(backend: str, endpoint: str, *extra: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "meshrun", "stacks", "--rdzv-backend", backend,
                           "--rdzv-endpoint", endpoint, "--rdzv-id", "elastic", *extra],
                          env=ENV, capture_output=True, text=True, timeout=90)  # fmt: skip


def _stop(job: subprocess.Popen, tmp_path: Path) -> int:
    (tmp_path / "stop").touch()
    try:
        return job.wait(60)
    finally:
        if job.poll() is None:
            job.kill()
            job.wait()


@pytest.mark.parametrize("backend", ["c10d", "etcd"])
def test_stacks_of_an_elastic_job_with_one_node(tmp_path, backend, request):
    endpoint = (request.getfixturevalue("etcd_server").endpoint if backend == "etcd"
                else f"127.0.0.1:{free_port()}")
    job = _job(tmp_path, backend, endpoint)
    try:
        _wait_ready(tmp_path, job)
        done = _stacks(backend, endpoint)
        assert done.returncode == 0, (done.stdout, done.stderr)
        assert "job elastic: round 0, 1 node(s): 2 rank(s)" in done.stdout, done.stdout
        assert re.search(r"rank 0 \(.*\): .*stall\.py:\d+ in read_batch", done.stdout), done.stdout
        assert re.search(r"rank 1 \(.*\): waiting in barrier", done.stdout), done.stdout
        assert "no answer" not in done.stdout + done.stderr, done.stdout
        assert job.poll() is None  # nothing was stopped
    finally:
        code = _stop(job, tmp_path)
    assert code == 0, job.stderr.read()


def test_no_node_answering_is_one_line_and_exit_1(tmp_path, etcd_server):
    """The job's only agent is stopped (SIGSTOP; its store is etcd, which still answers):
    the command waits --timeout, then says so in one line and exits 1."""
    endpoint = etcd_server.endpoint
    job = _job(tmp_path, "etcd", endpoint)
    try:
        _wait_ready(tmp_path, job)
        os.kill(job.pid, signal.SIGSTOP)
        try:
            started = time.monotonic()
            done = _stacks("etcd", endpoint, "--timeout", "2")
            took = time.monotonic() - started
        finally:
            os.kill(job.pid, signal.SIGCONT)
        assert done.returncode == 1, (done.stdout, done.stderr)
        assert done.stdout == "", done.stdout
        lines = done.stderr.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith(
            "meshrun stacks: no node of job elastic answered within 2 s (round 0, 1 node(s)"), lines
        assert took >= 2, took
    finally:
        _stop(job, tmp_path)  # its lease may have lapsed while stopped: any exit will do
