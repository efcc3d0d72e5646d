"""The collective record end to end (issue 27): plain torch scripts with the classic mistakes
under a real meshrun, and the report line that names the first call the ranks disagree on."""

from __future__ import annotations

import re
from datetime import datetime
from pathlib import Path

import pytest

SCRIPTS = Path(__file__).parent / "e2e_scripts"
SCRIPT = SCRIPTS / "collective_mistakes.py"


def _line(text: str) -> int:
    """The line of collective_mistakes.py that holds ``text``."""
    lines = SCRIPT.read_text().splitlines()
    return next(i for i, line in enumerate(lines, 1) if text in line)


def _mistake(launch, mode: str, nproc: int, timeout_s: float = 3, *extra: str):
    result = launch.run(["--nproc-per-node", str(nproc), "--shutdown-timeout", "2", *extra,
                         str(SCRIPT), mode, str(timeout_s)], timeout=90)  # fmt: skip
    assert result.returncode != 0, result.stderr
    return result.stderr


@pytest.mark.timeout(100)
def test_a_rank_in_another_collective_is_named_with_both_calls_and_call_sites(launch):
    """Rank 1 calls broadcast where ranks 0 and 2 call all_reduce (a plain torch script, gloo
    times out after 3 s): the report names call #2 of group 0, both ops and both call sites,
    and rank 1 as the likely cause."""
    err = _mistake(launch, "odd-op", 3, 3, "--log-dir", str(launch.cwd / "logs"))
    records = sorted((launch.cwd / "logs").rglob("collectives.json"))
    assert len(records) == 3 and '"op":"broadcast"' in records[1].read_text(), records
    site = rf"\S+collective_mistakes.py:{_line('dist.broadcast(x')} in train_step"
    others = rf"\S+collective_mistakes.py:{_line('        dist.all_reduce(x)')} in train_step"
    line = re.search(r"^Collectives: (.*)$", err, re.M)
    assert line, err
    # each side's call site, where its rank's place is known (a rank stopped while it was
    # exiting has no stack)
    assert re.fullmatch(rf"in group 0, rank 1 (is at|called) broadcast #2 \(float\[4\]\)( at "
                        rf"{site})? while ranks 0, 2 (are at|called) all_reduce #2 \(float\[4\]\)"
                        rf"( at {others})?", line[1]), line[1]  # fmt: skip
    assert re.search(site, line[1]) or re.search(others, line[1]), line[1]
    # named the likely cause under the root cause, or as the root cause itself (it failed first)
    assert re.search(r"^Likely cause: rank 1, in a different collective", err, re.M) or (
        "  rank       : 1 (" in err and "likely     : the cause: in a different collective" in err
    ), err


@pytest.mark.timeout(100)
def test_a_rank_that_skipped_a_collective_is_named_as_behind(launch):
    """Rank 0 skips the second all_reduce under a branch and goes on with its own work: the
    report says it never reached all_reduce #2, where rank 1 waits, and names it."""
    err = _mistake(launch, "skip", 2)
    waits = rf"\S+collective_mistakes.py:{_line('        dist.all_reduce(x)')} in train_step"
    assert re.search(rf"^Collectives: rank 0 never reached all_reduce #2 \(float\[4\]\) of group "
                     rf"0 \(ranks 0-1\), where rank 1 waits at {waits}; last call there: rank "
                     rf"0: all_reduce #1$", err, re.M), err  # fmt: skip
    assert re.search(r"^Likely cause: rank 0\b", err, re.M) or (
        "  rank       : 0 (" in err and "likely     : the cause" in err), err


@pytest.mark.timeout(100)
def test_mismatched_shapes_are_named_with_each_sides_arguments(launch):
    err = _mistake(launch, "shapes", 3)
    line = re.search(r"^Collectives: in group 0, (.*)$", err, re.M)
    assert line, err
    assert re.search(r"rank 1 (is at|called) all_reduce #2 \(float\[8\]\)", line[1]), line[1]
    assert re.search(r"ranks? [02](, 2)? (is at|are at|called) all_reduce #2 \(float\[4\]\)",
                     line[1]), line[1]  # fmt: skip


@pytest.mark.timeout(100)
def test_desync_check_stops_the_job_within_5_s_naming_the_calls(launch):
    """With --desync-check, rank 0's barrier where rank 1 makes its all_reduce #2 stops the job
    at once (gloo would wait 60 s here), and the report names each call; meshrun's check reads
    the record (no TORCH_DISTRIBUTED_DEBUG=DETAIL), so the record's line is kept too (more
    cases: tests/agent/test_desync.py)."""
    err = _mistake(launch, "skip-then-barrier", 2, 60, "--desync-check", "--log-dir",
                   str(launch.cwd / "logs"))  # fmt: skip
    line = ("desync in group 0 at call #2: rank 0 called barrier(), rank 1 called "
            "all_reduce(float[4])")
    assert re.search(rf"^meshrun: {re.escape(line)}", err, re.M), err
    assert re.search(r"^Collectives: in group 0, rank \d (is at|called) (barrier|all_reduce) #2",
                     err, re.M), err  # fmt: skip
    for rank in (0, 1):  # torch's own check is not on
        (log,) = (launch.cwd / "logs").rglob(f"attempt_0/{rank}/stderr.log")
        assert "Detected mismatch between collectives" not in log.read_text()
    started = float(re.search(r"collective_mistakes: first collective at ([\d.]+)",
                              err + "".join(p.read_text() for p in
                                            (launch.cwd / "logs").rglob("stdout.log")))[1])
    failed = re.search(r"time       : (\S+ \S+) ", err)[1]
    failed_at = datetime.strptime(failed, "%Y-%m-%d %H:%M:%S.%f").timestamp()
    assert failed_at - started < 5, (failed_at - started, err)


@pytest.mark.timeout(60)
def test_the_record_is_switched_off_by_env(launch):
    """(On by default: the tests above read it.)"""
    off = launch.run(["--log-dir", str(launch.cwd / "off"), str(SCRIPTS / "gloo_then_exit.py")],
                     env={"MESHRUN_COLLECTIVE_RECORD": "0"})  # fmt: skip
    assert off.returncode == 0, off.stderr
    assert not list((launch.cwd / "off").rglob("collectives.json"))


@pytest.mark.timeout(60)
def test_gloo_marks_completion_after_a_call_finishes_and_never_while_it_is_blocked():
    """What the verdict relies on (`Group.tracks_done`): on gloo a blocked call is not marked
    completed; an async call that was waited for and a synchronous one that returned are,
    a moment later; every entry stays "scheduled". A torch that changes this fails here."""
    import json
    import subprocess
    import sys

    from support import meshrun_env

    script = Path(__file__).parent / "scripts" / "gloo_completion.py"
    out = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", str(script)],
        env=meshrun_env(), capture_output=True, text=True, timeout=50,
    )  # fmt: skip
    line = next((x for x in out.stdout.splitlines() if x.startswith("GLOO_COMPLETION ")), None)
    assert line, out.stdout + out.stderr
    seen = json.loads(line.split(" ", 1)[1])
    assert seen["blocked"] == {"done": 1, "issued": 2, "states": ["scheduled"]}, seen
    assert seen["async_waited"] == {"done": 3, "issued": 3, "states": ["scheduled"]}, seen
    assert seen["sync_returned"] == {"done": 4, "issued": 4, "states": ["scheduled"]}, seen
