"""`EventLog`: one JSON line per event, appended safely, never raising on I/O."""

from __future__ import annotations

import json
import os
import stat
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from meshrun.agent.events import MAX_FIELD_CHARS, EventLog

pytestmark = pytest.mark.timeout(30)
REPO = Path(__file__).resolve().parents[2]


def lines(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_lines_carry_time_host_pid_kind_and_fields(tmp_path):
    path = tmp_path / "events.jsonl"
    with EventLog(path, "node7") as log:
        log.emit("agent_start", node="node7:1:abc", nproc=2, run_id="job")
        log.emit("worker_exit", round=0, rank=1, local_rank=1, exitcode=None, signal="SIGKILL")
    first, second = lines(path)
    assert first["kind"] == "agent_start" and first["host"] == "node7"
    assert first["pid"] == os.getpid() and first["nproc"] == 2 and first["run_id"] == "job"
    assert isinstance(first["t"], float) and first["t"] <= second["t"]
    assert second["exitcode"] is None and second["signal"] == "SIGKILL"
    assert stat.S_IMODE(path.stat().st_mode) == 0o600


def test_appends_to_an_existing_file_and_writes_at_once(tmp_path):
    path = tmp_path / "events.jsonl"
    EventLog(path, "a").emit("agent_start")  # never closed: nothing may sit in a buffer
    log = EventLog(path, "b")
    log.emit("agent_exit", code=0)
    assert [e["host"] for e in lines(path)] == ["a", "b"]
    log.close()
    log.emit("agent_exit", code=1)  # after close: a no-op
    assert len(lines(path)) == 2


def test_odd_values_and_long_strings(tmp_path):
    path = tmp_path / "events.jsonl"
    EventLog(path, "h").emit("failure", message="x" * 10_000, where=Path("/a/b"), culprits=[1, 2])
    (event,) = lines(path)
    assert len(event["message"]) == MAX_FIELD_CHARS and event["message"].endswith("...")
    assert event["where"] == "/a/b" and event["culprits"] == [1, 2]


def test_reserved_field_names_are_a_callers_bug(tmp_path):
    with pytest.raises(ValueError, match="reserved"):
        EventLog(tmp_path / "e.jsonl", "h").emit("failure", host="other")


def test_no_path_writes_nothing(tmp_path, capsys):
    log = EventLog(None, "h")
    log.emit("agent_start", nproc=1)
    assert log.dropped and capsys.readouterr().err == ""


def test_console_copy_is_one_line_on_stderr(tmp_path, capsys):
    EventLog(tmp_path / "e.jsonl", "h", console=True).emit("restart", round=0, reason="a\nb")
    err = capsys.readouterr().err
    assert err.startswith("meshrun: event {") and err.count("\n") == 1
    assert json.loads(err.removeprefix("meshrun: event "))["reason"] == "a\nb"
    EventLog(None, "h", console=True).emit("agent_exit", code=0)
    assert '"agent_exit"' in capsys.readouterr().err


def test_a_full_disk_is_said_once_and_the_log_dropped():
    said = []
    log = EventLog("/dev/full", "h", on_error=said.append)
    log.emit("agent_start")
    log.emit("agent_exit", code=0)
    assert log.dropped and len(said) == 1
    assert "/dev/full" in said[0] and "ENOSPC" in said[0] and "job goes on" in said[0]


def test_a_symlink_is_never_followed(tmp_path):
    target = tmp_path / "target"
    target.write_text("")
    (tmp_path / "events.jsonl").symlink_to(target)
    said = []
    log = EventLog(tmp_path / "events.jsonl", "h", on_error=said.append)
    log.emit("agent_start")
    assert log.dropped and len(said) == 1 and "ELOOP" in said[0]
    assert target.read_text() == ""


def test_two_processes_appending_never_interleave(tmp_path):
    path = tmp_path / "events.jsonl"
    writer = textwrap.dedent(
        """
        import sys
        from meshrun.agent.events import EventLog
        log = EventLog(sys.argv[1], sys.argv[2])
        for i in range(1500):
            log.emit("worker_exit", i=i, pad="p" * (i % 700))
        """
    )
    procs = [
        subprocess.Popen([sys.executable, "-c", writer, str(path), host], cwd=REPO)
        for host in ("a", "b")
    ]
    assert [p.wait(timeout=25) for p in procs] == [0, 0]
    events = lines(path)  # every line is whole JSON
    for host in ("a", "b"):
        assert [e["i"] for e in events if e["host"] == host] == list(range(1500))
