"""On a terminal, each worker's stdout and stderr are pseudo-terminals of the console's size
(progress bars and colour behave as under torchrun), a resize reaches them, and the per-rank
log files stay byte for byte what the worker wrote; without a terminal, pipes as before."""

from __future__ import annotations

import fcntl
import os
import pty
import select
import struct
import sys
import termios
import time
from pathlib import Path

import pytest

PROBE = Path(__file__).parent / "e2e_scripts" / "tty_probe.py"
REPO = Path(__file__).resolve().parents[2]


def _winsize(fd: int, rows: int, cols: int) -> None:
    fcntl.ioctl(fd, termios.TIOCSWINSZ, struct.pack("HHHH", rows, cols, 0, 0))


@pytest.mark.timeout(60)
def test_workers_get_terminals_of_the_consoles_size_and_follow_a_resize(tmp_path):
    argv = [sys.executable, "-m", "meshrun", "--nproc-per-node", "2", "--log-dir",
            str(tmp_path / "logs"), str(PROBE), "3"]  # fmt: skip
    pid, fd = pty.fork()
    if pid == 0:  # the child: meshrun with a terminal as its console
        os.environ["PYTHONPATH"] = str(REPO)
        os.execv(sys.executable, argv)
    _winsize(fd, 40, 132)
    out, start, resized = b"", time.monotonic(), False
    while True:
        if not resized and b"a\r\n" in out and out.count(b"isatty") == 2:
            _winsize(fd, 50, 100)  # while the workers sleep
            resized = True
        assert time.monotonic() - start < 50, out
        ready, _, _ = select.select([fd], [], [], 0.1)
        if not ready:
            continue
        try:
            data = os.read(fd, 4096)
        except OSError:  # EIO: meshrun exited, the terminal is closed
            break
        if not data:
            break
        out += data
    _, status = os.waitpid(pid, 0)
    text = out.decode(errors="replace")
    assert os.waitstatus_to_exitcode(status) == 0, text
    assert text.count("isatty out=True err=True size=(132, 40)") == 2, text
    assert text.count("size after=(100, 50)") == 2, text
    for log in (tmp_path / "logs").rglob("stdout.log"):  # what the worker wrote, no \r added
        assert b"\na\nb\r\nc\n" in log.read_bytes(), log.read_bytes()


@pytest.mark.timeout(60)
def test_without_a_terminal_workers_keep_pipes(launch):
    result = launch.run(["--nproc-per-node", "1", str(PROBE), "0"], timeout=50)
    assert result.returncode == 0, result.stderr
    assert "isatty out=False err=False size=None" in result.stdout
