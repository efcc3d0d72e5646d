"""Pseudo-terminals for workers whose output goes to a terminal.

torchrun's workers inherit the terminal; meshrun's write into pipes (each line must reach a log
file and, prefixed, the console), so a script that asks ``isatty()`` (tqdm, Lightning's progress
bar, colour in logging) saw a pipe: bars shrank to 10 characters and colour went off. When the
agent's stdout (or stderr) is a terminal, each worker's stdout (or stderr) is the slave end of
a pseudo-terminal of its own instead, of the console's size; the agent reads the master end as
it reads a pipe. Output post-processing is off on the slave (``OPOST``: no ``\\n`` turned into
``\\r\\n``), so the log files stay byte for byte what the worker wrote. `resize` gives every
worker's terminal the console's new size (the agent checks once per monitor tick, so a resize
reaches the workers within one tick). A worker's exit reads as EIO on the master, which the
forwarder takes as the end of the stream.
"""

from __future__ import annotations

import fcntl
import os
import struct
import sys
import termios


def terminal_size(stream_name: str) -> tuple[int, int] | None:
    """``(rows, columns)`` of the agent's ``"stdout"`` or ``"stderr"`` when it is a terminal,
    else None."""
    stream = sys.stdout if stream_name == "stdout" else sys.stderr
    try:
        fd = stream.fileno()
        if not os.isatty(fd):
            return None
        size = os.get_terminal_size(fd)
    except (AttributeError, OSError, ValueError):
        return None
    return size.lines, size.columns


def open_pty(size: tuple[int, int]) -> tuple[int, int]:
    """A new pseudo-terminal of ``size`` (rows, columns) with output post-processing off;
    returns ``(master, slave)`` file descriptors (the master close-on-exec)."""
    master, slave = os.openpty()
    try:
        attrs = termios.tcgetattr(slave)
        attrs[1] &= ~termios.OPOST  # oflag: bytes pass as written (no ONLCR)
        termios.tcsetattr(slave, termios.TCSANOW, attrs)
        set_size(master, size)
    except BaseException:
        os.close(master)
        os.close(slave)
        raise
    return master, slave


def set_size(fd: int, size: tuple[int, int]) -> None:
    """Give the terminal of ``fd`` (a master or slave end) ``size`` (rows, columns)."""
    rows, cols = size
    fcntl.ioctl(fd, termios.TIOCSWINSZ, struct.pack("HHHH", rows, cols, 0, 0))
