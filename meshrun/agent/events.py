"""The event log: what each agent did and saw, one JSON object per line, for ``meshrun timeline``.

Every agent appends its events to one file (the agent passes the path, e.g.
``<log dir>/<run id>/<host>_<pid>/events.jsonl``); ``meshrun timeline`` finds the files of
every node, merges them by time and draws the job (`meshrun.launcher.timeline`). A line is::

    {"t": 1718000000.123, "host": "node7", "pid": 4242, "kind": "worker_exit", "round": 0, ...}

``t`` is wall-clock seconds (``time.time()``: the nodes' lines are merged by it, so hosts are
assumed NTP-synced, as the failure report assumes, docs/design.md §3.3); ``host`` and ``pid`` are
the agent's, so two agents on one host stay apart. The kinds and their fields (rank = global
rank; a field that does not apply is left out, never written as null):

=============  ===================================================================================
kind           fields
=============  ===================================================================================
agent_start    node (node id), nproc, run_id
round_start    round, node_rank, num_nodes, world_size, rank_offset, local_world_size,
               restart_count, in_place (true when the running workers took the round in place)
worker_start   round, rank, local_rank, worker_pid (``pid`` is the agent's, on every line),
               in_place (true: the same process took this round in place, with this rank)
worker_exit    round, rank, local_rank, exitcode (int; None when killed by a signal), signal
               (name, e.g. "SIGKILL", when killed by one), stopped (true when the agent stopped
               it: the group ended for another reason)
join           node (the node id waiting to join), round (the round it waits for)
node_lost      node (the node id lost), round (the round it was lost from)
failure        round, rank, exitcode, message (one line)
restart        round (the round that ends), reason (one line), spent (true: a failure restart
               of the job's budget; false: a membership change, free)
hang           round, culprits (ranks that made no progress), waiting (ranks stopped with them)
straggler      round, rank, step_s, busy_s, median_s, steps (`meshrun.agent.stragglers`)
desync         round, group, seq, what ("mismatch" or "offset"), culprits, line
               (``--desync-check``, `meshrun.agent.desync`)
in_place       round, confirmed (every worker took the round in place; false: the group was
               restarted in it), reason (why not, when false)
agent_exit     code (the agent's exit code); console_dropped_lines, console_dropped_bytes
               (what the console never showed: it could not keep up; left out when 0)
=============  ===================================================================================

Other kinds may be added; readers skip kinds they do not know. Times in fields are seconds.

Writing: the file is opened once with ``O_APPEND | O_CREAT | O_NOFOLLOW | O_CLOEXEC`` (mode
0600, never through a symlink), and each event is one ``os.write`` of one whole line, so
lines of two processes appending to one file (a shared log directory) never interleave on a
local file system, and nothing is buffered in the agent: a line is on disk (in the page cache)
as soon as `EventLog.emit` returns, even if the agent is killed the next moment. String
fields are cut at `MAX_FIELD_CHARS`. A write error (a full disk: ENOSPC, EDQUOT, EIO...) is
said once, through ``on_error``, and the log is dropped: training never stops for it
(docs/design.md §3.6, as for the per-rank log files).

``--event-log-handler`` names torchrun's event-log plugin (``null``, the default, or
``console``). meshrun writes the JSON-lines file whatever it says (it is cheap: a dozen lines
per round); with ``console`` (`EventLog` ``console=True``) each event is also printed on
stderr as one line, ``meshrun: event {...}``, the same JSON, the way the agent's own lines go
(`meshrun.agent.say`: queued, never blocking). torchrun's handlers send
``torch.distributed.elastic.events.Event`` records to a ``logging`` handler; the event names
and fields here are meshrun's own.
"""

from __future__ import annotations

import errno
import json
import os
import threading
import time
from collections.abc import Callable
from pathlib import Path

from meshrun.agent.say import say

EVENT_FILE = "events.jsonl"
MAX_FIELD_CHARS = 2000  # a string field (a failure's message) is cut here, with "..."

KINDS = (
    "agent_start", "round_start", "worker_start", "worker_exit", "join", "node_lost",
    "failure", "restart", "hang", "straggler", "desync", "in_place", "agent_exit",
)  # fmt: skip
_RESERVED = frozenset({"t", "host", "pid", "kind"})


class EventLog:
    """Appends this agent's events to a JSON-lines file (see the module docstring).

    Args:
        path: the file, created if missing (mode 0600) and appended to; None: no file (only
            the console copy, when asked). Its directory must exist.
        host: this agent's host name, written on every line.
        console: also print each event as one line on stderr (``--event-log-handler console``).
        on_error: called once, with one line, when the file cannot be opened or written
            (``OSError``: ENOSPC, EDQUOT, EIO, ELOOP for a symlink, ...); the file is dropped
            then and later events go only to the console copy. Default: a ``meshrun:`` line
            on stderr.

    Nothing is raised for I/O; `emit` raises ValueError only for a field named ``t``,
    ``host``, ``pid`` or ``kind`` (a caller's bug). Thread-safe.
    """

    def __init__(
        self,
        path: os.PathLike | str | None,
        host: str,
        *,
        console: bool = False,
        on_error: Callable[[str], None] | None = None,
    ) -> None:
        self.path = Path(path) if path is not None else None
        self.host = host
        self.console = console
        self._on_error = on_error or say
        self._lock = threading.Lock()
        self._fd: int | None = None
        if self.path is not None:
            flags = os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC
            try:
                self._fd = os.open(self.path, flags, 0o600)
            except OSError as e:
                self._fail(e)

    @property
    def dropped(self) -> bool:
        """True when there is no file to write (none given, an error, or after `close`)."""
        return self._fd is None

    def emit(self, kind: str, **fields) -> None:
        """Append one event ``{"t", "host", "pid", "kind", **fields}`` (``t`` = now, wall clock).

        Values must be JSON types (others are written as ``str(value)``); strings longer
        than `MAX_FIELD_CHARS` are cut. Raises ValueError for a reserved field name.
        """
        clash = _RESERVED.intersection(fields)
        if clash:
            raise ValueError(f"EventLog.emit: field names {sorted(clash)} are reserved")
        record = {"t": time.time(), "host": self.host, "pid": os.getpid(), "kind": kind}
        record.update((k, _cut(v)) for k, v in fields.items())
        line = json.dumps(record, default=str, separators=(",", ":")) + "\n"
        with self._lock:
            if self._fd is not None:
                self._write(line.encode())
            if self.console:  # queued, never blocking (a closed console: the file has it)
                say(f"event {line[:-1]}")

    def close(self) -> None:
        with self._lock:
            self._drop()

    def _drop(self) -> None:
        """Close the file (once); later events go to the console only, if at all."""
        if self._fd is not None:
            fd, self._fd = self._fd, None
            try:
                os.close(fd)
            except OSError:
                pass

    def __enter__(self) -> EventLog:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _write(self, data: bytes) -> None:
        view = memoryview(data)
        try:
            while view:  # one write; a short one only when the disk is full (then ENOSPC)
                n = os.write(self._fd, view)
                view = view[n:]
        except OSError as e:
            self._fail(e)

    def _fail(self, e: OSError) -> None:
        self._drop()
        code = errno.errorcode.get(e.errno or 0, "error")
        self._on_error(
            f"cannot write the event log {self.path}: {e.strerror or e} ({code}); no more "
            "events are written to it, the job goes on"
        )


def _cut(value):
    if isinstance(value, str) and len(value) > MAX_FIELD_CHARS:
        return value[: MAX_FIELD_CHARS - 3] + "..."
    return value


