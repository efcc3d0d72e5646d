"""Hang detection: --hang-timeout, progress counters, stacks of every rank, restart or exit 124."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from meshrun.agent.hang import ProgressWatch, stuck_at

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


def test_stuck_at_names_the_users_frame_and_the_innermost():
    assert stuck_at(FAULTHANDLER_DUMP) == (
        "/home/me/train.py:41 in train_step (inside distributed_c10d.py:3252 in all_reduce)"
    )
    assert stuck_at(PY_SPY_DUMP).startswith("/home/me/train.py:41 in train_step")
    assert stuck_at("garbage").startswith("unknown")


def test_progress_watch_counts_only_ranks_that_beat(tmp_path):
    dirs = [tmp_path / "0", tmp_path / "1"]
    watch = ProgressWatch(dirs, timeout=0.2)
    progress = [d / "progress" for d in dirs]
    progress[0].write_bytes((5).to_bytes(8, "little"))  # rank 0 beat; rank 1 never does
    assert watch.check() == []
    time.sleep(0.3)
    hung = watch.check()
    assert [h.local_rank for h in hung] == [0] and hung[0].heartbeats == 5
    progress[0].write_bytes((6).to_bytes(8, "little"))  # progress again: not hung
    assert watch.check() == []


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
    assert err.count("hung: no progress") >= 2  # both ranks, each with its location
    sleep_line, reduce_line = (_line_of("time.sleep(600)"), _line_of("dist.all_reduce"))
    assert f"hang_rank.py:{sleep_line} in <module>" in err  # the hanging rank, asleep
    assert f"hang_rank.py:{reduce_line} in <module> (inside distributed_c10d.py" in err  # waiter
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
