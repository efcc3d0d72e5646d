"""End to end: worker failures as a user meets them. Restart after a failure, an exhausted
budget, exit codes passed through, a worker killed with SIGKILL, and the failure report's
traceback with and without torch's ``@record``."""

from __future__ import annotations

import fcntl
import json
import os
import signal
import time
from pathlib import Path

import pytest

SCRIPTS = Path(__file__).resolve().parent / "e2e_scripts"


@pytest.mark.timeout(60)
def test_restart_after_failure_on_first_attempt(launch):
    """--max-restarts 1 and a worker that exits 1 only on attempt 0: the job exits 0, the
    second attempt sees TORCHELASTIC_RESTART_COUNT=1 and MESHRUN_ROUND=1, and both attempts
    have per-rank logs under attempt_0 and attempt_1 of --log-dir."""
    out, logs = launch.cwd / "out", launch.cwd / "logs"
    out.mkdir()
    res = launch.run(
        [
            "--nproc-per-node",
            "2",
            "--max-restarts",
            "1",
            "--log-dir",
            str(logs),
            str(SCRIPTS / "exit_with.py"),
            str(out),
            "1",
            "first",
            "1",
        ]
    )
    assert res.returncode == 0, res.stderr
    for rank in (0, 1):
        second = json.loads((out / f"run_{rank}_1.json").read_text())
        assert second["TORCHELASTIC_RESTART_COUNT"] == "1"
        assert second["MESHRUN_ROUND"] == "1"
        assert second["TORCHELASTIC_MAX_RESTARTS"] == "1"
    for attempt in (0, 1):
        for rank in (0, 1):
            found = list(logs.glob(f"*/*/attempt_{attempt}/{rank}/stdout.log"))
            assert len(found) == 1, (attempt, rank, sorted(map(str, logs.rglob("*"))))
            assert f"hello from rank {rank} restart {attempt}" in found[0].read_text()
    err1 = next(logs.glob("*/*/attempt_0/1/stderr.log")).read_text()
    assert "rank 1 failing on purpose with 1" in err1
    assert "job failed" not in res.stderr


@pytest.mark.timeout(60)
def test_budget_exhausted_reports_root_cause_once(launch):
    """--max-restarts 1, rank 1 always exits 5 (rank 0 would run on): meshrun exits 5 after
    two attempts; the report on stderr, printed once, names rank 1 and "exit code 5"."""
    out = launch.cwd / "out"
    out.mkdir()
    res = launch.run(
        [
            "--nproc-per-node",
            "2",
            "--max-restarts",
            "1",
            "--shutdown-timeout",
            "5",
            str(SCRIPTS / "exit_with.py"),
            str(out),
            "5",
            "always",
            "1",
            "sleep",
        ]
    )
    assert res.returncode == 5, res.stderr
    assert (out / "run_1_0.json").exists() and (out / "run_1_1.json").exists()
    assert res.stderr.count("Root cause") == 1, res.stderr
    assert res.stderr.count("meshrun: job failed") == 1, res.stderr
    report = res.stderr[res.stderr.index("Root cause") :]
    assert "rank       : 1 (local rank 1)" in report
    assert "exit code 5" in report
    assert "rank 1 failing on purpose with 5" in report  # the stderr tail
    assert "job failed" not in res.stdout


@pytest.mark.timeout(60)
def test_exit_code_passes_through(launch):
    """Without restarts, a worker's exit code 7 becomes meshrun's exit code."""
    out = launch.cwd / "out"
    out.mkdir()
    res = launch.run(
        [
            "--nproc-per-node",
            "2",
            str(SCRIPTS / "exit_with.py"),
            str(out),
            "7",
            "always",
            "all",
        ]
    )
    assert res.returncode == 7, res.stderr
    assert "exit code 7" in res.stderr


@pytest.mark.timeout(60)
def test_ranks_failing_together_are_all_in_the_report(launch):
    """Both ranks exit at the same moment (5 and 6): the report names one as the root cause
    and lists the other under "Other failures" (before, a rank that failed a moment after the
    first was often left out); meshrun exits with the root cause's code."""
    out, lock = launch.cwd / "out", launch.cwd / "lock"
    out.mkdir()
    lock.write_text("")
    with open(lock) as held:
        fcntl.flock(held, fcntl.LOCK_EX)
        proc = launch.start(
            ["--nproc-per-node", "2", str(SCRIPTS / "exit_together.py"), str(lock), str(out)]
        )
        launch.wait_for(
            lambda: all((out / f"ready_{r}").exists() for r in (0, 1)), 40, what="both ranks"
        )
        time.sleep(0.2)  # both are now blocked in flock (they write ready just before)
    _, err = proc.communicate(timeout=40)  # the `with` released the lock: both exit at once
    report = err[err.index("Root cause") :]
    root = 0 if "rank       : 0 (local rank 0)" in report else 1
    other = 1 - root
    assert proc.returncode == 5 + root, err
    assert f"exit code {5 + root}" in report
    assert "Other failures (1), in order observed:" in report, report
    assert f"  rank {other} (host " in report and f"exit code {5 + other} at +" in report, report


@pytest.mark.timeout(60)
def test_worker_killed_by_sigkill(launch):
    """kill -9 of one worker: meshrun exits 137 and the report says SIGKILL for that rank."""
    out = launch.cwd / "out"
    out.mkdir()
    proc = launch.start(
        [
            "--nproc-per-node",
            "2",
            "--shutdown-timeout",
            "5",
            str(SCRIPTS / "proc_tree.py"),
            str(out),
            "plain",
        ]
    )
    pids = {
        r: launch.wait_for(
            lambda r=r: _read_pid(out / f"pid_{r}_worker"), 40, what=f"rank {r}'s pid"
        )
        for r in (0, 1)
    }
    launch.extra_pids.update(pids.values())
    os.kill(pids[1], signal.SIGKILL)
    _, err = proc.communicate(timeout=40)
    assert proc.returncode == 137, err
    report = err[err.index("Root cause") :]
    assert "rank       : 1 (local rank 1)" in report
    assert f"pid        : {pids[1]}" in report
    assert "SIGKILL" in report


@pytest.mark.timeout(60)
def test_traceback_without_record(launch):
    """A script without @record that raises: the report shows the stderr tail, with
    "Traceback" and the exception's text; meshrun exits 1."""
    res = launch.run(["--nproc-per-node", "1", str(SCRIPTS / "raise_exc.py")])
    assert res.returncode == 1, res.stderr
    report = res.stderr[res.stderr.index("Root cause") :]
    assert "Traceback (most recent call last)" in report
    assert "ValueError: e2e-boom-without-record" in report
    assert "<N/A>" not in res.stderr


@pytest.mark.timeout(60)
def test_record_error_file_is_read(launch):
    """With torch's @record the worker writes TORCHELASTIC_ERROR_FILE; the report shows the
    message and traceback from error.json."""
    res = launch.run(["--nproc-per-node", "1", str(SCRIPTS / "raise_exc.py"), "--record"])
    assert res.returncode == 1, res.stderr
    report = res.stderr[res.stderr.index("Root cause") :]
    message = [line for line in report.splitlines() if line.strip().startswith("message")]
    assert message and "e2e-boom-with-record" in message[0], report
    assert "traceback (error.json)" in report
    assert "<N/A>" not in res.stderr


def _read_pid(path: Path) -> int | None:
    try:
        return int(path.read_text())
    except (FileNotFoundError, ValueError):
        return None
