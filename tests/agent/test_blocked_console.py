"""Nothing the agent writes can block it (issue 50): its own lines and the failure report take
the console's bounded, non-blocking way (docs/design.md §3.6), so a console nobody reads costs
lines, counted, never a restart; the report is also in a file of the agent's log directory.

Real parts only: meshrun's stdout and stderr are pipes of a real subprocess that the test does
not read (they fill at 64 KiB), a real worker floods its stderr and exits 1; what happened is
read from the events log and the log files, never from the blocked pipes.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from meshrun.agent.console import Console

LINES, WIDTH = 4000, 100  # 400 kB on stderr, then exit 1

FLOOD_AND_FAIL = f"""
import sys
sys.stderr.write("".join(f"err {{i:05d}} " + "e" * ({WIDTH} - 11) + "\\n" for i in range({LINES})))
sys.stderr.flush()
sys.exit(1)
"""


def events(logs: Path) -> list[dict]:
    found = list(logs.glob("*/*/events.jsonl"))
    if len(found) != 1:
        return []
    return [json.loads(ln) for ln in found[0].read_text().splitlines() if ln.endswith("}")]


def first(evs: list[dict], kind: str, **match) -> dict | None:
    return next(
        (e for e in evs if e["kind"] == kind and all(e.get(k) == v for k, v in match.items())),
        None,
    )


def start_blocked(launch, tmp_path: Path):
    """meshrun with --max-restarts 1 on the flooding script; its stdout and stderr are pipes
    of their own that the test does not read."""
    script = tmp_path / "flood_and_fail.py"
    script.write_text(FLOOD_AND_FAIL)
    logs = tmp_path / "logs"
    proc = launch.start(
        ["--nproc-per-node", "1", "--max-restarts", "1", "--log-dir", str(logs), str(script)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=False,
    )
    return proc, logs


def wait_restart(launch, logs: Path) -> tuple[dict, dict]:
    """The round-0 failure event, then the restart event: within 5 s of the failure."""
    fail = launch.wait_for(
        lambda: first(events(logs), "failure", round=0), 60, what="round 0's failure event"
    )
    seen = time.monotonic()
    restart = launch.wait_for(
        lambda: first(events(logs), "restart", round=0), 30,
        what="the restart event after round 0's failure (the agent is blocked writing?)",
    )  # fmt: skip
    assert restart["t"] - fail["t"] < 5.0, (fail, restart)
    assert time.monotonic() - seen < 5.5  # as this test saw it too
    return fail, restart


def check_report(logs: Path) -> str:
    [path] = logs.glob("*/*/failure_report.txt")
    report = path.read_text()
    lines = report.splitlines()
    assert lines[1] == f"meshrun: job failed (this report is also in {path})", lines[:3]
    assert "Root cause (first observed failure):" in report
    assert "exit code 1" in report and "attempt_1/0/stderr.log" in report
    return report


@pytest.mark.timeout(120)
def test_a_blocked_console_costs_lines_never_a_restart(launch, tmp_path):
    """Nobody ever reads meshrun's stdout or stderr. The worker writes 400 kB to stderr and
    exits 1: the restart comes within 5 s (before this fix the agent hung writing its
    "worker failure" line), round 1 runs, the job fails with the worker's exit status, the
    agent exits although the console never drained, the log files are complete, the report
    is in its file, and the events log counts what the console never showed."""
    proc, logs = start_blocked(launch, tmp_path)
    wait_restart(launch, logs)
    try:
        code = proc.wait(timeout=60)
    except subprocess.TimeoutExpired:
        raise AssertionError("meshrun never exited with its console blocked") from None
    assert code == 1
    expected = "".join(f"err {i:05d} " + "e" * (WIDTH - 11) + "\n" for i in range(LINES))
    for attempt in (0, 1):
        [log] = logs.glob(f"*/*/attempt_{attempt}/0/stderr.log")
        assert log.read_text() == expected
    check_report(logs)
    evs = events(logs)
    assert first(evs, "worker_start", round=1) is not None
    exit_ = first(evs, "agent_exit")
    assert exit_["code"] == 1 and exit_["console_dropped_lines"] > LINES, exit_


NOTE = re.compile(
    r"meshrun: console too slow, (\d+) lines? \((\d+) bytes\) of "
    r"rank 0's stderr not shown; (\S+) has all of it$"
)


@pytest.mark.timeout(120)
def test_once_the_console_drains_it_shows_the_count_the_agent_s_lines_and_the_report(
    launch, tmp_path
):
    """As above, but once the restart has come the test starts reading meshrun's stderr:
    the console then shows each drop's note (lines shown + lines counted = lines written),
    the agent's "worker failure" lines in order, and the report, the same as in its file."""
    proc, logs = start_blocked(launch, tmp_path)
    wait_restart(launch, logs)
    chunks: list[bytes] = []
    reader = threading.Thread(
        target=lambda: chunks.extend(iter(lambda: proc.stderr.read1(65536), b"")), daemon=True
    )
    reader.start()
    assert proc.wait(timeout=60) == 1
    reader.join(30)
    assert not reader.is_alive()
    text = b"".join(chunks).decode()
    report = check_report(logs)
    assert report in text, text[-3000:]
    lines = text.splitlines()
    said = [ln for ln in lines if ln.startswith("meshrun: worker failure")]
    assert len(said) == 2 and "restart 1 of 1" in said[0] and "no restarts left" in said[1], said
    prefix = ""  # one rank: no rank prefix (torchrun's default)
    notes = [m for m in map(NOTE.match, lines) if m]
    assert notes, [ln[:120] for ln in lines if not ln.startswith("err ")]
    assert {Path(m.group(3)).parent.parent.name for m in notes} <= {"attempt_0", "attempt_1"}
    for attempt in ("attempt_0", "attempt_1"):  # each attempt's lines: shown + counted = all
        shown_at, counted = 0, 0
        for m in notes:
            if Path(m.group(3)).parent.parent.name == attempt:
                counted += int(m.group(1))
        # a whole line is shown once per attempt; attempt boundaries are the agent's lines
        start = lines.index(said[0]) if attempt == "attempt_1" else 0
        end = lines.index(said[0]) if attempt == "attempt_0" else len(lines)
        shown_at = sum(
            1 for ln in lines[start:end]
            if ln.startswith(prefix + "err ") and len(ln) == len(prefix) + WIDTH - 1
        )  # fmt: skip
        assert shown_at + counted == LINES, (attempt, shown_at, counted)


# --- the console itself, on a real pipe ----------------------------------------------------------


def _full_pipe() -> tuple[int, int]:
    """A pipe whose buffer is full: the next blocking write to ``w`` blocks."""
    r, w = os.pipe()
    os.set_blocking(w, False)
    try:
        while True:
            os.write(w, b"f" * 4096)
    except BlockingIOError:
        pass
    os.set_blocking(w, True)
    return r, w


def _drain(r: int, into: bytearray) -> threading.Thread:
    def run() -> None:
        while chunk := os.read(r, 65536):
            into.extend(chunk)

    t = threading.Thread(target=run, daemon=True)
    t.start()
    return t


@pytest.mark.timeout(30)
def test_the_agent_s_own_lines_never_block_and_a_drop_is_counted_in_one_note():
    """The console's pipe is full and nobody reads it. 300 of meshrun's own lines (18 bytes
    each, beyond a 4 KiB bound) never wait longer than ``say_wait_s`` in all; once the pipe
    is read, the lines shown (whole, in order) + the count in one note = 300, and a line said
    afterwards comes last."""
    r, w = _full_pipe()
    out = os.fdopen(w, "wb", buffering=0)
    con = Console(lambda: out, max_queued_bytes=4096, say_wait_s=0.25)
    t0 = time.monotonic()
    for i in range(300):
        con.say(f"line {i:03d}")
    assert time.monotonic() - t0 < 0.25 + 0.5, "the agent waited for a blocked console"
    got = bytearray()
    reader = _drain(r, got)
    assert con.finish(stall_s=5.0)
    con.say("after")
    assert con.finish(stall_s=5.0)
    out.close()
    reader.join(10)
    lines = bytes(got).lstrip(b"f").decode().splitlines()
    [note] = [ln for ln in lines if "not shown" in ln]
    m = re.fullmatch(r"meshrun: console too slow, (\d+) lines \((\d+) bytes\) of meshrun's own "
                     r"lines not shown", note)  # fmt: skip
    assert m, note
    shown = [ln for ln in lines if ln.startswith("meshrun: line ")]
    assert shown == [f"meshrun: line {i:03d}" for i in range(len(shown))]
    assert len(shown) + int(m.group(1)) == 300 and int(m.group(2)) == 18 * int(m.group(1))
    assert con.dropped_lines == int(m.group(1))
    assert lines[-1] == "meshrun: after" and lines[-2] == note


@pytest.mark.timeout(30)
def test_a_blocked_console_never_holds_the_exit_and_what_it_kept_is_counted():
    """`Console.finish` on a console nobody reads gives up after ``stall_s`` without a write;
    the lines still queued are counted as not shown."""
    r, w = _full_pipe()
    out = os.fdopen(w, "wb", buffering=0)
    try:
        con = Console(lambda: out, say_wait_s=0.05)
        for i in range(10):
            con.say(f"line {i}")
        t0 = time.monotonic()
        assert not con.finish(stall_s=0.3)
        assert time.monotonic() - t0 < 2.0
        assert con.dropped_lines == 9  # the first is in the writer's blocked write
    finally:
        os.close(r)  # the blocked write ends (EPIPE)
        out.close()


@pytest.mark.timeout(30)
def test_the_agent_s_lines_and_a_worker_s_stay_in_order_and_the_report_is_whole():
    """meshrun's own lines are queued with the workers' output: the console shows them in the
    order they came, and a multi-line report (`write_own`) is never cut by a worker line."""
    r, w = os.pipe()
    out = os.fdopen(w, "wb", buffering=0)
    got = bytearray()
    reader = _drain(r, got)
    con = Console(lambda: out)
    s = con.stream("[0]: ", "rank 0's stderr", "/l/0/stderr.log")
    s.put(b"worker line 1\n")
    con.say("agent line")
    s.put(b"worker line 2\n")
    con.write_own("=====\nreport line a\nreport line b\n=====")
    s.put(b"worker line 3\n")
    assert s.close() and con.finish(5.0)
    out.close()
    reader.join(10)
    assert bytes(got).decode() == (
        "[0]: worker line 1\nmeshrun: agent line\n[0]: worker line 2\n"
        "=====\nreport line a\nreport line b\n=====\n[0]: worker line 3\n"
    )


ROUTED = """
import logging, os, sys, time
from meshrun.launcher.stdio import finish_console, route_to_console, survive_closed_console
survive_closed_console()
route_to_console()
t0 = time.monotonic()
for i in range(2000):
    logging.warning("warning %04d %s", i, "w" * 80)
with open(sys.argv[1] + ".tmp", "w") as f:
    f.write(str(time.monotonic() - t0))
os.rename(sys.argv[1] + ".tmp", sys.argv[1])
sys.exit(0 if finish_console(stall_s=30) else 5)
"""


@pytest.mark.timeout(60)
def test_the_agent_s_python_output_never_blocks_it(tmp_path):
    """What agent code writes through Python's streams (the rendezvous' ``logging`` warnings,
    by the last-resort handler) while the agent runs takes the console's queue: a process
    whose stderr is a pipe nobody reads logs 200 kB of warnings in well under a second (a
    blocking write stops at 64 KiB); once the pipe is read, all of them come, in order."""
    took = tmp_path / "took"
    proc = subprocess.Popen(
        [sys.executable, "-c", ROUTED, str(took)],
        stderr=subprocess.PIPE,
        env={**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[2])},
    )
    try:
        deadline = time.monotonic() + 30
        while not took.exists():
            assert proc.poll() is None, proc.stderr.read()[-2000:]
            assert time.monotonic() < deadline, "the warnings blocked on the unread pipe"
            time.sleep(0.02)
        assert float(took.read_text()) < 2.0
        err = proc.stderr.read().decode()
        assert proc.wait(timeout=30) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    lines = err.splitlines()
    assert lines == [f"WARNING:root:warning {i:04d} " + "w" * 80 for i in range(2000)], lines[-3:]
