"""``meshrun stacks``: every rank's live stack, from the job's store (2 nodes) or its log dir
(one node), with the rank that stalls the others named; the job goes on."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest
from support import free_port

pytestmark = pytest.mark.timeout(120)
REPO = Path(__file__).resolve().parents[2]
STALL = Path(__file__).parent / "scripts" / "stall.py"
ENV = {**os.environ, "PYTHONPATH": str(REPO)}


def _meshrun(*args: str, **kwargs) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "meshrun", *args], env=ENV,
                            stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, **kwargs)  # fmt: skip


def _wait_ready(ready: Path, n: int, procs) -> None:
    deadline = time.monotonic() + 60
    while not (ready.exists() and len(ready.read_text().split()) == n):
        assert time.monotonic() < deadline, [p.poll() for p in procs]
        time.sleep(0.1)
    # into read_batch / the barrier, and past LIVE_SETTLE_S: a snapshot of ranks that made a
    # call within it names no cause (the job may be moving)
    time.sleep(2.5)


def _check(out: str) -> None:
    assert "likely cause: rank 0 (outside any collective while the others wait)" in out, out
    line = next(i for i, text in enumerate(STALL.read_text().splitlines(), 1) if "sleep(0.05)" in text)
    assert re.search(rf"rank 0 \(.*\): LIKELY CAUSE, running, outside any collective at "
                     rf"\S+stall.py:{line} in read_batch", out), out  # fmt: skip
    assert re.search(r"rank 1 \(.*\): waiting in barrier(?: #\d+)? at \S+stall.py:\d+ in <module>", out), out
    # the collective record: each rank's latest calls, and who never reached the barrier
    assert re.search(r"collectives: rank 0 never reached barrier #1 of group 0 \(ranks 0-1\), "
                     r"where rank 1 waits at \S+stall.py:\d+ in <module>; last call there: "
                     r"rank 0: no call in this group yet", out), out  # fmt: skip
    assert "    last collectives: barrier #1 (in progress)" in out, out


def _finish(procs, stop: Path) -> None:
    stop.touch()
    try:
        codes = [p.wait(60) for p in procs]
        assert codes == [0] * len(procs), [p.stderr.read() for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()


def test_two_node_job_stacks_through_the_store(tmp_path):
    port, stop, ready = free_port(), tmp_path / "stop", tmp_path / "ready"
    common = ["--nnodes", "2", "--nproc-per-node", "1", "--rdzv-backend", "c10d",
              "--rdzv-endpoint", f"127.0.0.1:{port}", "--rdzv-id", "live",
              "--rdzv-conf", "last_call_timeout=0.5"]  # fmt: skip
    procs = [_meshrun(*common, str(STALL), str(stop), str(ready), cwd=tmp_path)]
    time.sleep(1.0)  # the first agent hosts the store
    procs.append(_meshrun(*common, str(STALL), str(stop), str(ready), cwd=tmp_path))
    try:
        _wait_ready(ready, 2, procs)
        done = subprocess.run(
            [sys.executable, "-m", "meshrun", "stacks", "--rdzv-backend", "c10d",
             "--rdzv-endpoint", f"127.0.0.1:{port}", "--rdzv-id", "live"],
            env=ENV, capture_output=True, text=True, timeout=60,
        )  # fmt: skip
        assert done.returncode == 0, done.stderr
        assert "job live: round 0, 2 node(s): 2 rank(s)" in done.stdout, done.stdout
        _check(done.stdout)
        assert all(p.poll() is None for p in procs)  # nothing was stopped
    finally:
        _finish(procs, stop)


def test_one_node_job_stacks_from_its_log_dir(tmp_path):
    stop, ready, logs = tmp_path / "stop", tmp_path / "ready", tmp_path / "logs"
    procs = [_meshrun("--nproc-per-node", "2", "--log-dir", str(logs), str(STALL), str(stop),
                      str(ready), cwd=tmp_path)]  # fmt: skip
    try:
        _wait_ready(ready, 2, procs)
        done = subprocess.run([sys.executable, "-m", "meshrun", "stacks", str(logs)],
                              env=ENV, capture_output=True, text=True, timeout=60)  # fmt: skip
        assert done.returncode == 0, done.stderr
        assert "1 agent log(s): 2 rank(s)" in done.stdout, done.stdout
        _check(done.stdout)
        attempt = next(logs.rglob("attempt_0"))  # the directory the agent prints
        again = subprocess.run([sys.executable, "-m", "meshrun", "stacks", str(attempt)],
                               env=ENV, capture_output=True, text=True, timeout=60)  # fmt: skip
        assert again.returncode == 0 and "1 agent log(s): 2 rank(s)" in again.stdout, again.stderr
    finally:
        _finish(procs, stop)
    gone = subprocess.run([sys.executable, "-m", "meshrun", "stacks", str(logs)],
                          env=ENV, capture_output=True, text=True, timeout=60)  # fmt: skip
    assert gone.returncode == 1 and "no running workers found" in gone.stderr, gone.stderr


def test_stacks_bad_input_is_one_line_exit_2(tmp_path):
    for args in (["--rdzv-backend", "c10d"], [str(tmp_path / "missing")],
                 [str(tmp_path), "--rdzv-id", "x"]):  # fmt: skip
        done = subprocess.run([sys.executable, "-m", "meshrun", "stacks", *args],
                              env=ENV, capture_output=True, text=True, timeout=60)  # fmt: skip
        assert done.returncode == 2, (args, done.stderr)
        assert len(done.stderr.strip().splitlines()) == 1, (args, done.stderr)


def test_a_job_that_is_moving_gets_no_likely_cause(tmp_path):
    """Found by a breaker: the ranks' records are read at different moments, so a healthy job
    showed ranks a few all_reduces apart and a LIKELY CAUSE on every call. A snapshot of ranks
    that made a call within LIVE_SETTLE_S names nobody and says the job is moving."""
    stop, ready, logs = tmp_path / "stop", tmp_path / "ready", tmp_path / "logs"
    script = Path(__file__).parent / "scripts" / "busy_loop.py"
    procs = [_meshrun("--nproc-per-node", "3", "--log-dir", str(logs), str(script), str(stop),
                      str(ready), cwd=tmp_path)]  # fmt: skip
    try:
        _wait_ready(ready, 3, procs)
        for _ in range(3):
            done = subprocess.run([sys.executable, "-m", "meshrun", "stacks", str(logs)],
                                  env=ENV, capture_output=True, text=True, timeout=60)  # fmt: skip
            assert done.returncode == 0, done.stderr
            assert "3 rank(s)" in done.stdout, done.stdout
            assert "likely cause" not in done.stdout and "LIKELY CAUSE" not in done.stdout, done.stdout
            assert "the job is moving" in done.stdout, done.stdout
    finally:
        _finish(procs, stop)
