"""Hang detection: --hang-timeout, progress counters, stacks of every rank, restart or exit 124."""

from __future__ import annotations

import re
import time
from pathlib import Path

import pytest

from meshrun.agent.hang import ProgressWatch
from meshrun.agent.stacks import classify, main_thread

SCRIPTS = Path(__file__).parent / "e2e_scripts"

FAULTHANDLER_DUMP = """\
Thread 0x00007f31a5bff6c0 (most recent call first):
  File "/usr/lib/python3.11/threading.py", line 331 in wait

Current thread 0x00007f31bc1ffb80 (most recent call first):
  File "/venv/lib/python3.11/site-packages/torch/distributed/distributed_c10d.py", line 3252 in all_reduce
  File "/venv/lib/python3.11/site-packages/torch/distributed/c10d_logger.py", line 83 in wrapper
  File "/home/me/train.py", line 41 in train_step
  File "/home/me/train.py", line 60 in <module>
"""

PY_SPY_DUMP = """\
Process 4242: python -u train.py
Python v3.11.7 (/usr/bin/python3.11)

Thread 4242 (idle): "MainThread"
    all_reduce (torch/distributed/distributed_c10d.py:3252)
    train_step (/home/me/train.py:41)
    <module> (/home/me/train.py:60)
"""


def _line_of(text: str) -> int:
    lines = (SCRIPTS / "hang_rank.py").read_text().splitlines()
    return next(i for i, line in enumerate(lines, 1) if text in line)


def test_classify_names_the_users_frame_the_innermost_and_the_collective():
    where = classify(main_thread(FAULTHANDLER_DUMP))
    assert where.at == (
        "/home/me/train.py:41 in train_step (inside distributed_c10d.py:3252 in all_reduce)"
    )
    assert (where.state, where.collective) == ("waiting", "all_reduce")
    where = classify(main_thread(PY_SPY_DUMP))
    assert where.at.startswith("/home/me/train.py:41 in train_step")
    assert (where.state, where.collective) == ("waiting", "all_reduce")
    assert classify(main_thread("garbage")).state == "unknown"


def test_progress_watch_counts_only_ranks_that_beat(tmp_path):
    dirs = [tmp_path / "0", tmp_path / "1"]
    watch = ProgressWatch(dirs, timeout=0.2)
    progress = [d / "progress" for d in dirs]
    progress[0].write_bytes((5).to_bytes(8, "little") + bytes(32))  # rank 0 beat; 1 never does
    assert watch.check() == []
    time.sleep(0.3)
    hung = watch.check()
    assert [h.local_rank for h in hung] == [0] and hung[0].heartbeats == 5
    progress[0].write_bytes((6).to_bytes(8, "little") + bytes(32))  # progress again: not hung
    assert watch.check() == []
    time.sleep(0.3)
    assert watch.check() != []
    progress[0].write_bytes((6).to_bytes(8, "little") + (1).to_bytes(8, "little") + bytes(24))
    assert watch.check() == []  # a busy() beat is progress too


@pytest.mark.timeout(90)
def test_hang_without_restarts_left_reports_every_rank_and_exits_124(launch):
    start = time.monotonic()
    result = launch.run(
        ["--nproc-per-node", "2", "--hang-timeout", "3", "--shutdown-timeout", "2",
         str(SCRIPTS / "hang_rank.py"), "1"], timeout=80,
    )  # fmt: skip
    elapsed = time.monotonic() - start
    assert result.returncode == 124, result.stderr
    err = result.stderr
    assert "hang detection on" in err
    sleep_line, reduce_line = (_line_of("time.sleep(600)"), _line_of("dist.all_reduce"))
    # The culprit is the rank outside any collective, named in the hang line and the report,
    # though the waiting rank may have been idle longer.
    assert re.search(
        rf"hang: likely cause rank 1 at \S+hang_rank.py:{sleep_line} in <module> \(outside "
        r"any collective while the others wait\); waiting: ranks 0", err
    ), err
    report = err[err.index("Root cause") :]
    assert "  rank       : 1 (local rank 1)" in report
    assert "likely     : the cause: outside any collective" in report
    # The waiting rank, with its place and its own stack.
    assert re.search(
        rf"rank 0 \(host .*\): waiting in all_reduce(?: #\d+)? at \S+hang_rank.py:{reduce_line} in "
        r"<module> \(inside distributed_c10d.py", report
    ), report
    assert "full stack: " in report and "attempt_0/0/stack.txt" in report
    assert elapsed < 60


@pytest.mark.timeout(120)
def test_hang_spends_a_restart_and_the_job_recovers(launch):
    result = launch.run(
        ["--nproc-per-node", "2", "--hang-timeout", "3", "--max-restarts", "1",
         "--shutdown-timeout", "2", str(SCRIPTS / "hang_rank.py"), "0"], timeout=110,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    assert "restarting the worker group: hang" in result.stderr
    assert result.stdout.count("finished on attempt 1") == 2


@pytest.mark.timeout(60)
def test_a_script_that_never_beats_is_never_called_hung(launch):
    result = launch.run(
        ["--nproc-per-node", "1", "--hang-timeout", "1", str(SCRIPTS / "slow_plain.py")], timeout=50
    )
    assert result.returncode == 0, result.stderr
    assert "slow but fine" in result.stdout and "no progress" not in result.stderr


@pytest.mark.timeout(60)
def test_long_work_inside_busy_is_progress_not_a_hang(launch):
    args = ["--nproc-per-node", "2", "--hang-timeout", "2", "--shutdown-timeout", "2"]
    result = launch.run([*args, str(SCRIPTS / "long_eval.py"), "busy"], timeout=50)
    assert result.returncode == 0, result.stderr
    assert result.stdout.count("done") == 2 and "no progress" not in result.stderr


@pytest.mark.timeout(60)
@pytest.mark.parametrize("mode", ["bare", "busy-timeout"])
def test_long_work_outside_busy_or_past_its_timeout_is_a_hang(launch, mode):
    args = ["--nproc-per-node", "2", "--hang-timeout", "2", "--shutdown-timeout", "2"]
    result = launch.run([*args, str(SCRIPTS / "long_eval.py"), mode], timeout=50)
    assert result.returncode == 124, result.stderr
    assert "no progress" in result.stderr


@pytest.mark.timeout(90)
@pytest.mark.parametrize("slow", [1, -1])
def test_a_straggler_gets_one_warning_line_and_equal_ranks_none(launch, slow):
    result = launch.run(["--nproc-per-node", "2", str(SCRIPTS / "straggler.py"), str(slow)],
                        timeout=80)  # fmt: skip
    assert result.returncode == 0, result.stderr
    warnings = [line for line in result.stderr.splitlines() if "is a straggler" in line]
    if slow < 0:
        assert warnings == [], result.stderr
        return
    assert len(warnings) == 1, result.stderr
    m = re.search(r"rank 1 is a straggler: busy ([\d.]+) ms of each ([\d.]+) ms step, the other "
                  r"ranks' median ([\d.]+) ms", warnings[0])  # fmt: skip
    assert m, warnings
    busy, step, median = map(float, m.groups())
    assert busy >= 90 and median < busy / 2 and step >= busy, warnings


@pytest.mark.timeout(90)
def test_a_rank_in_a_different_collective_is_named_the_culprit(launch):
    """Ranks 0 and 2 wait in all_reduce, rank 1 in broadcast: every rank is inside a
    collective, and the odd one out is the likely cause."""
    result = launch.run(
        ["--nproc-per-node", "3", "--hang-timeout", "3", "--shutdown-timeout", "2",
         str(SCRIPTS / "mismatch.py"), "1"], timeout=80,
    )  # fmt: skip
    err = result.stderr
    assert result.returncode == 124, err
    assert re.search(r"hang: likely cause rank 1 at \S+mismatch.py:\d+ in <module> \(inside "
                     r"distributed_c10d.py:\d+ in broadcast\) \(in a different collective from "
                     r"the others' all_reduce\); waiting: ranks 0, 2", err), err  # fmt: skip
    report = err[err.index("Root cause") :]
    assert "  rank       : 1 (local rank 1)" in report
    assert report.count("waiting in all_reduce") == 2
    # the collective record (issue 27): the call number both sides are at
    calls = re.search(r"hang: collectives: in group 0, rank 1 is at broadcast #(\d+) \(float\[1\]\) "
                      r"at \S+mismatch.py:\d+ in <module> while ranks 0, 2 are at all_reduce "
                      r"#(\d+) \(float\[1\]\)", err)  # fmt: skip
    assert calls and calls[1] == calls[2], err
    assert re.search(r"last collectives: .*all_reduce #\d+ \(in progress\)", report), report
