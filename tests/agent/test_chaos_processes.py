"""Processes under interleavings: no pid is signalled after it was reaped (a reused pid
belongs to someone else), and a worker's double-forked daemon does not outlive the job.

Pid reuse is made to happen, not hoped for: as root, /proc/sys/kernel/ns_last_pid chooses the
pid the next process gets, so a process can be started with exactly the pid of a worker that
exited (when that pid is free).
"""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import pytest
from support import alive, read_pid
from test_workers import groups, spec  # noqa: F401 - fixture

from meshrun.agent.workers import WorkerState

NS_LAST_PID = Path("/proc/sys/kernel/ns_last_pid")
SCRIPTS = Path(__file__).resolve().parent / "e2e_scripts"


def _can_choose_pids() -> bool:
    try:
        NS_LAST_PID.write_text(NS_LAST_PID.read_text())
        return True
    except OSError:
        return False


def start_with_pid(pid: int, attempts: int = 5) -> subprocess.Popen:
    """A sleeper in its own session (its group id is its pid), with pid ``pid`` if that pid is
    free (a few tries: another process may take it first), else with whatever pid it gets."""
    for _ in range(attempts):
        NS_LAST_PID.write_text(str(pid - 1))
        proc = subprocess.Popen(
            [sys.executable, "-c", "import time; time.sleep(60)"], start_new_session=True
        )
        if proc.pid == pid or _ == attempts - 1:
            return proc
        proc.kill()
        proc.wait()
    raise AssertionError("unreachable")


@pytest.mark.timeout(30)
@pytest.mark.skipif(not _can_choose_pids(), reason="needs root to write ns_last_pid")
def test_stop_never_signals_the_group_of_a_reaped_worker(tmp_path, groups):  # noqa: F811
    """Rank 1 exits 3; a process of someone else's is then started with rank 1's pid if it is
    free (it must not be: the agent keeps an exited worker unreaped until stop() has sent its
    last signal), in its own group; stop() must leave that process alone."""
    g = groups([spec(tmp_path, 0, "import time; time.sleep(60)"),
                spec(tmp_path, 1, "raise SystemExit(3)")], None)  # fmt: skip
    g.start()
    assert g.wait(20).state is WorkerState.FAILED
    exited = g.pids[1]
    other = start_with_pid(exited)
    try:
        g.stop(grace=1.0)
        assert other.poll() is None, (
            f"stop() signalled pid {exited} after it was reaped: it killed someone else's "
            f"process (exit {other.returncode})"
        )
        assert other.pid != exited, "the exited worker's pid was free for reuse before stop()"
        assert not alive(exited) and not alive(g.pids[0])
    finally:
        other.kill()
        other.wait(5)


@pytest.mark.timeout(60)
def test_double_forked_daemon_does_not_outlive_the_job(launch):
    """A worker double-forks a daemon (setsid, parent exits: it leaves the worker's tree) and
    exits 0: once meshrun has exited 0 the daemon is gone too (the agent is a child
    subreaper, so the daemon was re-parented to it and stopped with the group)."""
    out = launch.cwd / "out"
    out.mkdir()
    res = launch.run(["--nproc-per-node", "1", str(SCRIPTS / "proc_tree.py"), str(out), "daemon"])
    daemon = read_pid(out / "pid_0_daemon")
    assert daemon is not None, res.stderr
    launch.extra_pids.add(daemon)
    assert res.returncode == 0, res.stderr
    deadline = time.monotonic() + 2
    while time.monotonic() < deadline and alive(daemon):
        time.sleep(0.05)
    assert not alive(daemon), f"the daemon {daemon} outlived the job"


@pytest.mark.timeout(60)
def test_progress_files_exist_before_the_workers_start(launch):
    """With --hang-timeout each worker's progress file must exist when the worker starts: a
    heartbeat before it exists finds no file and turns hang detection off for that rank for
    good. Four workers that are a shell checking the file at once (the fastest a worker can
    get to a first heartbeat) all find it; meshrun exits 0."""
    res = launch.run(
        ["--nproc-per-node", "4", "--hang-timeout", "30", "--no-python", "sh", "-c",
         'test -s "$MESHRUN_PROGRESS_FILE" || { echo "no progress file yet" >&2; exit 9; }'],
    )  # fmt: skip
    assert res.returncode == 0, res.stderr
