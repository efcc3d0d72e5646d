"""``meshrun status``: a running job's membership, read from etcd or the c10d store."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "rendezvous"))
from etcd_fixtures import etcd_server, free_port, needs_etcd  # noqa: E402, F401
from test_c10d_agents import Job, in_round  # noqa: E402

from meshrun.launcher.subcommands import SUBCOMMANDS  # noqa: E402

pytestmark = pytest.mark.timeout(90)
REPO = Path(__file__).resolve().parents[2]

# Runs the subcommand as `meshrun status` would; exit 99 if it imported torch where it must not.
_PROBE = (
    "import sys; from meshrun.launcher.cli import run_subcommand; "
    "rc = run_subcommand('status', sys.argv[2:]); "
    "sys.exit(99 if sys.argv[1] == 'no-torch' and 'torch' in sys.modules else rc)"
)


def status(*args: str, torch_ok: bool = False) -> subprocess.CompletedProcess:
    """``meshrun status ARGS`` in a fresh interpreter (so torch's absence can be checked)."""
    argv = [sys.executable, "-c", _PROBE, "torch-ok" if torch_ok else "no-torch", *args]
    return subprocess.run(argv, capture_output=True, text=True, timeout=60, cwd=REPO)


def test_registered():
    assert "status" in SUBCOMMANDS


def test_usage_error_exits_2():
    done = status("--rdzv-backend", "zookeeper", "--rdzv-endpoint", "h:1", "--rdzv-id", "x")
    assert done.returncode == 2
    assert "meshrun status: error: --rdzv-backend zookeeper" in done.stderr


def test_unreachable_etcd_exits_3():
    endpoint = f"127.0.0.1:{free_port()}"
    done = status("--rdzv-backend", "etcd", "--rdzv-endpoint", endpoint, "--rdzv-id", "x",
                  "--rdzv-conf", "read_timeout=1")  # fmt: skip
    assert done.returncode == 3, done.stderr
    assert endpoint in done.stderr and len(done.stderr.strip().splitlines()) == 1
    assert "store not reached" in done.stderr, done.stderr  # nothing ever answered there


def test_a_conf_key_nobody_reads_is_said_as_the_launcher_says_it():
    endpoint = f"127.0.0.1:{free_port()}"
    done = status("--rdzv-backend", "etcd", "--rdzv-endpoint", endpoint, "--rdzv-id", "x",
                  "--rdzv-conf", "bogus=1,read_timeout=1")  # fmt: skip
    assert done.returncode == 3, done.stderr
    assert "warning: --rdzv-conf bogus is not a key meshrun or torch reads" in done.stderr


@needs_etcd
def test_etcd_job_membership_and_missing_job(etcd_server, tmp_path):  # noqa: F811
    (tmp_path / "job").mkdir()
    job = Job(tmp_path / "job", "1:2", backend="etcd", endpoint=etcd_server.endpoint)
    try:
        job.node(nproc=2)
        job.wait_records(in_round(0, 2))
        done = status("--rdzv-backend", "etcd-v3", "--rdzv-endpoint", etcd_server.endpoint,
                      "--rdzv-id", "test")  # fmt: skip
        assert done.returncode == 0, done.stderr
        out = done.stdout
        assert f"job test at {etcd_server.endpoint} (etcd)" in out, out
        assert "round 0, restart count 0, status running" in out, out
        assert "node rank 0:" in out and "nproc 2" in out and "alive (last seen" in out, out
        assert "waiting: 0 node(s) for round 1" in out, out
        missing = status("--rdzv-backend", "etcd", "--rdzv-endpoint", etcd_server.endpoint,
                         "--rdzv-id", "nope")  # fmt: skip
        assert missing.returncode == 1
        assert missing.stderr.strip() == f"no job nope at {etcd_server.endpoint}"
        assert job.finish() == [0], job.logs()
        assert etcd_server.keys("/meshrun/") == []  # looking kept nothing alive
    finally:
        job.cleanup()


def test_c10d_job_membership(tmp_path):
    (tmp_path / "job").mkdir()
    job = Job(tmp_path / "job", "1:2")
    try:
        job.node()
        job.wait_records(in_round(0, 1))
        endpoint = f"127.0.0.1:{job.port}"
        done = status("--rdzv-backend", "c10d", "--rdzv-endpoint", endpoint, "--rdzv-id", "test",
                      torch_ok=True)  # fmt: skip
        assert done.returncode == 0, done.stderr
        assert "round 0, restart count 0, status running" in done.stdout, done.stdout
        assert "node rank 0:" in done.stdout and " alive" in done.stdout, done.stdout
        missing = status("--rdzv-backend", "c10d", "--rdzv-endpoint", endpoint, "--rdzv-id",
                         "nope", torch_ok=True)  # fmt: skip
        assert missing.returncode == 1 and "no job nope at" in missing.stderr
        assert job.finish() == [0], job.logs()
    finally:
        job.cleanup()


def test_c10d_status_shows_each_ranks_step_times(tmp_path):
    import time

    from support import free_port as port_for

    port, stop, ready = port_for(), tmp_path / "stop", tmp_path / "ready"
    script = Path(__file__).parent / "scripts" / "steady_steps.py"
    procs = []
    try:
        for n in range(2):
            procs.append(subprocess.Popen(
                [sys.executable, "-m", "meshrun", "--nnodes", "2", "--nproc-per-node", "1",
                 "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{port}", "--rdzv-id",
                 "steps", "--rdzv-conf", "last_call_timeout=0.5", "--monitor-interval", "0.1",
                 str(script), str(stop), str(ready)],
                cwd=tmp_path, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                env={**__import__("os").environ, "PYTHONPATH": str(REPO)},
            ))  # fmt: skip
            if n == 0:
                time.sleep(1.0)  # the first agent hosts the store
        deadline = time.monotonic() + 60
        while not (ready.exists() and len(ready.read_text().split()) == 2):
            assert time.monotonic() < deadline, [p.poll() for p in procs]
            time.sleep(0.1)
        while True:  # the agents publish every 2 s
            done = status("--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{port}",
                          "--rdzv-id", "steps", torch_ok=True)  # fmt: skip
            assert done.returncode == 0, done.stderr
            if done.stdout.count(" ms, busy ") == 2 or time.monotonic() > deadline:
                break
            time.sleep(0.5)
        assert "step times" in done.stdout, done.stdout
        for rank in (0, 1):
            assert f"  rank {rank}: step " in done.stdout, done.stdout
        stop.touch()
        assert [p.wait(60) for p in procs] == [0, 0], [p.stderr.read() for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()


def test_nothing_listening_is_said_at_once(tmp_path):
    import time

    from support import free_port as port_for

    start = time.monotonic()
    done = status("--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{port_for()}",
                  "--rdzv-id", "gone", torch_ok=True)  # fmt: skip
    assert done.returncode == 3 and "nothing answers at 127.0.0.1" in done.stderr, done.stderr
    assert time.monotonic() - start < 10  # well below TCPStore's own connect timeout
