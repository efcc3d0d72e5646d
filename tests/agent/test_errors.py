"""Failure records and the report: torch's error file, the stderr fallback, ordering."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from meshrun.agent.errors import WorkerFailure, format_report, read_error_file, root_cause
from meshrun.agent.workers import WorkerGroup, WorkerSpec, WorkerState

pytestmark = pytest.mark.timeout(60)

REPO = Path(__file__).resolve().parents[2]
SCRIPTS = Path(__file__).resolve().parent / "scripts"


def failure(rank: int, ts: int, **kw) -> WorkerFailure:
    kw.setdefault("exitcode", 1)
    return WorkerFailure(
        local_rank=rank % 2, global_rank=rank, pid=1000 + rank, timestamp_ms=ts, host="node-a", **kw
    )


def run_group(tmp_path: Path, argv: tuple[str, ...]) -> WorkerFailure:
    env = {
        **os.environ,
        "PYTHONPATH": str(REPO),
        "TORCHELASTIC_ERROR_FILE": str(tmp_path / "rank0" / "error.json"),
    }
    spec = WorkerSpec(0, 0, argv, env, tmp_path / "rank0", False, False, node_rank=2)
    group = WorkerGroup([spec], None)
    group.start()
    try:
        result = group.wait(40)
    finally:
        group.stop(grace=1)
    assert result is not None and result.state is WorkerState.FAILED
    return result.failures[0]


def test_real_torch_record_error_file_is_read_and_reported(tmp_path):
    f = run_group(tmp_path, (sys.executable, "-u", str(SCRIPTS / "record_fail.py")))
    record = read_error_file(tmp_path / "rank0" / "error.json")
    assert record is not None
    message, tb, ts = record
    assert message == "ValueError: loss is nan at step 42"
    assert "Traceback (most recent call last)" in tb and 'raise ValueError("loss is nan' in tb
    assert isinstance(ts, int) and ts > 1_600_000_000
    assert (f.message, f.traceback, f.source, f.exitcode) == (message, tb, "error.json", 1)
    assert (f.node_rank, f.host) == (2, os.uname().nodename)
    report = format_report([f])
    assert "ValueError: loss is nan at step 42" in report
    assert 'raise ValueError("loss is nan at step 42")' in report
    assert "exit code 1" in report and str(f.stderr_path) in report
    assert "N/A" not in report


def test_stderr_tail_is_the_fallback_and_signal_is_named(tmp_path):
    code = (
        "import os, sys\n"
        "for i in range(100): print(f'log line {i}', file=sys.stderr)\n"
        "sys.stderr.flush(); os.kill(os.getpid(), 9)\n"
    )
    f = run_group(tmp_path, (sys.executable, "-u", "-c", code))
    assert (f.exitcode, f.signal_name, f.exit_status, f.source) == (-9, "SIGKILL", 137, "stderr")
    lines = f.traceback.splitlines()
    assert len(lines) == 50 and lines[0] == "log line 50" and lines[-1] == "log line 99"
    report = format_report([f])
    assert "signal SIGKILL (exit status 137)" in report
    assert "log line 99" in report and "stderr (last lines)" in report
    assert "node rank 2" in report


def test_read_error_file_tolerates_other_shapes(tmp_path):
    p = tmp_path / "e.json"
    assert read_error_file(p) is None  # missing
    assert read_error_file(None) is None
    p.write_text("{not json")
    assert read_error_file(p) is None
    p.write_text("[1, 2]")
    assert read_error_file(p) is None
    p.write_text('{"message": "plain text", "timestamp": 12}')
    assert read_error_file(p) == ("plain text", "", 12)
    p.write_text('{"message": {"message": "m", "extraInfo": {"timestamp": "x"}}}')
    assert read_error_file(p) == ("m", "", None)


def test_root_cause_is_the_earliest_then_the_lowest_rank():
    fs = [failure(3, 200), failure(2, 100), failure(1, 100), failure(0, 300)]
    assert root_cause(fs).global_rank == 1
    assert root_cause(reversed(fs)).global_rank == 1
    with pytest.raises(ValueError):
        root_cause([])


def test_report_lists_the_root_cause_first_then_each_other_rank():
    fs = [
        failure(3, 1_000_250, exitcode=-int(signal.SIGTERM), stderr_path="/l/3/stderr.log"),
        failure(
            1,
            1_000_000,
            exitcode=7,
            message="RuntimeError: NCCL timeout",
            traceback="Traceback (most recent call last):\n  boom\nRuntimeError: x\n",
            source="error.json",
            stderr_path="/l/1/stderr.log",
            stdout_path="/l/1/stdout.log",
        ),
    ]
    report = format_report(fs, title="meshrun: job failed (round 4)")
    assert report.splitlines()[1] == "meshrun: job failed (round 4)"
    root = report.index("Root cause")
    assert root < report.index("rank       : 1 (local rank 1)") < report.index("Other failures (1)")
    assert "exit code 7" in report and "RuntimeError: NCCL timeout" in report
    assert "traceback (error.json)" in report and "    RuntimeError: x" in report
    assert "/l/1/stderr.log" in report and "/l/1/stdout.log" in report
    [other] = [line for line in report.splitlines() if line.startswith("  rank 3")]
    assert "signal SIGTERM (exit status 143)" in other and "+250 ms" in other
    assert "/l/3/stderr.log" in other


def test_report_without_any_output_says_how_to_get_a_traceback():
    report = format_report([failure(0, 5, exitcode=2)])
    assert "@record" in report and "N/A" not in report


def test_failure_json_round_trip_and_exit_status():
    f = failure(5, 123, exitcode=-11, message="m", traceback="t", node_rank=1)
    assert WorkerFailure.from_json(f.to_json()) == f
    assert (f.signal_name, f.exit_status, f.describe_exit()) == (
        "SIGSEGV",
        139,
        "signal SIGSEGV (exit status 139)",
    )
    assert (
        WorkerFailure.from_json(
            '{"local_rank": 0, "global_rank": 0, "pid": 1, '
            '"exitcode": 3, "timestamp_ms": 0, "future": 1}'
        ).exitcode
        == 3
    )
    with pytest.raises(ValueError):
        WorkerFailure.from_json("[]")
    assert failure(0, 0, exitcode=0).signal_name is None


def test_agent_modules_do_not_import_torch():
    code = (
        "import sys, meshrun.agent.workers, meshrun.agent.reaper, meshrun.agent.errors, "
        "meshrun.agent.logs; assert 'torch' not in sys.modules, 'torch imported'"
    )
    subprocess.run(
        [sys.executable, "-c", code],
        env={**os.environ, "PYTHONPATH": str(REPO)},
        check=True,
        timeout=30,
    )


def test_an_abort_in_torchs_teardown_is_named_in_the_report():
    from meshrun.agent.errors import WorkerFailure, format_report

    f = WorkerFailure(0, 0, 10, -6, 1000, traceback="done\nterminate called without an active "
                      "exception\n", source="stderr")  # fmt: skip
    report = format_report([f])
    assert "signal SIGABRT (exit status 134) - torch's C++ teardown at interpreter exit" in report
    other = WorkerFailure(0, 0, 10, -6, 1000, traceback="assert failed\n", source="stderr")
    assert "abort() in native code" in format_report([other])


def test_a_rank_published_by_two_nodes_is_reported_once_as_its_failure():
    """A desync's likely cause on another node is published by node rank 0 as a failure while
    its own node stops it: the report lists it once, as the failure, with the desync's words."""
    from meshrun.agent.errors import WorkerFailure, format_report, placed

    line = "desync in group 0 at call #3: rank 3 called barrier(), ranks 0-2 called all_reduce(float[4])"
    cause = WorkerFailure(1, 3, 33, 1, 2000, host="b", node_rank=1, message=line, source="desync")
    stopped = WorkerFailure(1, 3, 33, -15, 2001, host="b", node_rank=1, stopped=True,
                            source="stack", state="waiting", collective="barrier", at="t.py:3 in f")
    other = WorkerFailure(0, 2, 22, -15, 2002, host="b", node_rank=1, stopped=True,
                          source="stack", state="waiting", collective="all_reduce", at="t.py:2 in f")
    for records in ([stopped, other, cause], [cause, other, stopped]):
        assert [f.global_rank for f in placed(records)].count(3) == 1
        report = format_report(records)
        assert report.count("rank 3 (") == 0 and "  rank       : 3 (local rank 1)" in report, report
        assert "exit       : stopped by the agent: a desync (--desync-check), exit status 1" in report
        assert "decorate main" not in report, report


def test_the_reports_stack_leaves_out_meshruns_own_threads():
    """The collective record's thread is in every worker's dump; the report's stack shows the
    script's threads only (the stack file keeps everything)."""
    from meshrun.agent.errors import WorkerFailure, format_report

    dump = ('Current thread 0x1 "MainThread" (most recent call first):\n'
            '  File "/job/train.py", line 24 in <module>\n'
            "Thread 0x2 (most recent call first):\n"
            '  File "/usr/lib/python3.11/threading.py", line 331 in wait\n'
            '  File "/site/meshrun/agent/collective_record.py", line 111 in _run\n'
            "Thread 0x3 (most recent call first):\n"
            '  File "/job/loader.py", line 5 in run\n')  # fmt: skip
    hung = WorkerFailure(0, 0, 10, 124, 1000, traceback=dump, source="stack", state="running",
                         at="/job/train.py:24 in <module>")  # fmt: skip
    report = format_report([hung])
    assert "train.py\", line 24" in report and "loader.py" in report, report
    assert "collective_record.py" not in report and "Thread 0x2" not in report, report
