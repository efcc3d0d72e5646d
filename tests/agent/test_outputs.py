"""End to end: worker output on the console and in the per-rank log files. Prefixes after
``\\r`` (progress bars), partial lines forwarded at once, ``-r 3`` and ``--local-ranks-filter``."""

from __future__ import annotations

import os
import select
import socket
import time
from pathlib import Path

import pytest

SCRIPTS = Path(__file__).resolve().parent / "e2e_scripts"
HOST = socket.gethostname()


def prefix(rank: int) -> bytes:
    return f"[{HOST}:{rank}]: ".encode()


@pytest.mark.timeout(60)
def test_carriage_returns_and_partial_lines_reach_the_console(launch):
    """With -t 3 a tqdm-style bar redrawn with \\r shows the rank prefix after every \\r, and a
    flushed partial line (no newline) reaches meshrun's stdout while the worker still runs."""
    go = launch.cwd / "go"
    proc = launch.start(
        ["--nproc-per-node", "1", "-t", "3", str(SCRIPTS / "progress.py"), str(go)], text=False
    )
    fd = proc.stdout.fileno()
    seen = b""
    deadline = time.monotonic() + 40
    while b"partial-no-newline" not in seen:
        left = deadline - time.monotonic()
        assert left > 0, f"the partial line never arrived; stdout so far: {seen!r}"
        ready, _, _ = select.select([fd], [], [], left)
        if ready:
            chunk = os.read(fd, 65536)
            assert chunk, f"meshrun's stdout closed early: {seen!r}"
            seen += chunk
    assert proc.poll() is None and not go.exists()  # the worker is still waiting
    p = prefix(0)
    assert p + b"bar 1/3\r" + p + b"bar 2/3\r" + p + b"bar 3/3\n" in seen, seen
    assert seen.endswith(p + b"partial-no-newline"), seen

    go.touch()
    rest, err = proc.communicate(timeout=30)
    assert proc.returncode == 0, err
    assert (seen + rest).endswith(p + b"partial-no-newline finished\n"), seen + rest


@pytest.mark.timeout(60)
def test_redirect_all_to_log_dir(launch):
    """-r 3 with --log-dir: no worker output on the console; each rank's stdout and stderr
    are in <log-dir>/<run-id>/<node>/attempt_0/<local_rank>/{stdout,stderr}.log."""
    logs = launch.cwd / "logs"
    res = launch.run(
        ["--nproc-per-node", "2", "-r", "3", "--log-dir", str(logs), str(SCRIPTS / "say_rank.py")]
    )
    assert res.returncode == 0, res.stderr
    assert "from rank" not in res.stdout + res.stderr
    for rank in (0, 1):
        out = list(logs.glob(f"*/*/attempt_0/{rank}/stdout.log"))
        err = list(logs.glob(f"*/*/attempt_0/{rank}/stderr.log"))
        assert len(out) == len(err) == 1, sorted(map(str, logs.rglob("*")))
        assert f"out-line from rank {rank}\n" in out[0].read_text()
        assert err[0].read_text() == f"err-line from rank {rank}\n"


@pytest.mark.timeout(60)
def test_local_ranks_filter_shows_only_rank_1(launch):
    """--local-ranks-filter 1 -t 3: only rank 1's lines (prefixed) reach the console, while
    rank 0's output still goes to its log file."""
    logs = launch.cwd / "logs"
    res = launch.run(
        [
            "--nproc-per-node",
            "2",
            "--local-ranks-filter",
            "1",
            "-t",
            "3",
            "--log-dir",
            str(logs),
            str(SCRIPTS / "say_rank.py"),
        ]
    )
    assert res.returncode == 0, res.stderr
    assert f"[{HOST}:1]: out-line from rank 1\n" in res.stdout
    assert f"[{HOST}:1]: err-line from rank 1\n" in res.stderr
    assert "rank 0" not in res.stdout and "rank=0" not in res.stdout
    assert "from rank 0" not in res.stderr
    rank0 = next(logs.glob("*/*/attempt_0/0/stdout.log")).read_text()
    assert "out-line from rank 0" in rank0
