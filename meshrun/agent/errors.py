"""Worker failures: the record the agent keeps for each failed worker, and the report.

A failed worker is described by a :class:`WorkerFailure`. Its ``message`` and ``traceback``
come from the error file that torch's ``@record`` decorator writes (the path in the worker's
``TORCHELASTIC_ERROR_FILE``); when the script did not use ``@record`` (or died by a signal before
it could write one), the traceback is the tail of the worker's stderr that the agent kept in
memory. So a user always sees *something* useful, never torch's ``error_file: <N/A>``.

"Which failure came first" uses the time at which the agent observed each exit, in
milliseconds on the agent's own clock (``time.time()``), ties broken by global rank. Across
nodes this assumes NTP-synced hosts (docs/design.md §3.3). This mirrors torch's
``ChildFailedError.get_first_failure`` (which uses the worker-written timestamp, in seconds,
and so cannot rank workers killed by a signal).

Failures travel between nodes as JSON (:meth:`WorkerFailure.to_json`), so the agent that
reports can include the failures of other nodes read from the rendezvous store. What travels is
capped (:meth:`WorkerFailure.capped`, a few KB per rank: the head and the tail of the message
and of the traceback, with a note of what was cut): an error file has no size limit, and eight
ranks with 300 KB messages would exceed what one store request may carry (etcd: 1.5 MiB), and
the whole report would be lost.

This module imports nothing heavy (no torch).
"""

from __future__ import annotations

import dataclasses
import json
import os
import signal
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

from meshrun.agent.say import first_line
from meshrun.agent.verdicts import Place, Rule, Verdict, Whereabouts, Why, attribute

__all__ = [
    "PUBLISHED_MAX_BYTES",
    "WorkerFailure",
    "culprits",
    "cut_middle",
    "desync_report",
    "disagreement",
    "format_places",
    "format_report",
    "placed",
    "read_error_file",
    "root_cause",
]

_PLACES = {p.value for p in Place}

#: Bytes of message + traceback one failure record may carry to the rendezvous store.
PUBLISHED_MAX_BYTES = 4096

# Hints for the signals users most often meet; shown after the signal name in the report.
_SIGNAL_HINTS = {
    "SIGKILL": "often the kernel OOM killer, or a kill -9 from outside",
    "SIGSEGV": "a crash in native code (a C/C++/CUDA extension)",
    "SIGABRT": "abort() in native code, e.g. a failed assertion or an NCCL/c10 error",
    "SIGBUS": "a bad memory access, e.g. /dev/shm too small for shared memory",
    "SIGUSR1": "a scheduler's warning (SLURM --signal, scancel -s USR1), which meshrun passes to "
               "the workers: this script has no handler for it; install one to save on the "
               "warning, or list SIGUSR1 in --signals-to-handle to stop the job instead",
    "SIGUSR2": "a scheduler's warning, passed to the workers: this script has no handler for "
               "it; install one, or list SIGUSR2 in --signals-to-handle",
}


@dataclass(frozen=True)
class WorkerFailure:
    """One worker that exited non-zero or was killed by a signal.

    Mirrors torch's ``ProcessFailure`` (``torch.distributed.elastic.multiprocessing.errors``),
    with the observed time in milliseconds and the stderr tail as a fallback traceback.

    Attributes:
        local_rank, global_rank: the worker's ``LOCAL_RANK`` and ``RANK``.
        pid: the worker's process id.
        exitcode: as ``subprocess.Popen.returncode``: > 0 the exit status, < 0 minus the signal.
        timestamp_ms: when the agent observed the exit, ms since the epoch (agent's clock).
        host, node_rank: where the worker ran.
        message: the error message from the error file, or "" when there was none.
        traceback: the error file's ``py_callstack``, else the last lines of stderr.
        stdout_path, stderr_path: the worker's log files.
    """

    local_rank: int
    global_rank: int
    pid: int
    exitcode: int
    timestamp_ms: int
    host: str = ""
    node_rank: int = 0
    message: str = ""
    traceback: str = ""
    stdout_path: str = ""
    stderr_path: str = ""
    #: "error.json" when message/traceback came from torch's error file, "stderr" when the
    #: traceback is the stderr tail, "stack" when it is the stack of a hung worker (the agent
    #: stopped it), "" when there was none.
    source: str = ""
    #: True for a rank that did not fail: the agent stopped it after another's failure (its
    #: record says where it was; it is never the root cause).
    stopped: bool = False
    #: Where the rank was, a `Place` (`placed`: its collective record's pending call, else
    #: `meshrun.agent.stacks.classify`; a value read back from the store becomes the enum),
    #: or "" when not placed; the collective it waited in; the innermost frame of its own
    #: code; meshrun.parallel collectives issued (-1: unknown).
    state: Place | str = ""
    collective: str = ""
    at: str = ""
    collectives: int = -1
    #: The rank's full stack in its log directory ("" when none was taken), or why not.
    stack_path: str = ""
    stack_problem: str = ""
    #: Its recent collectives (`meshrun.agent.collectives.summary`; {} when not recorded).
    calls: dict = field(default_factory=dict)

    def __post_init__(self) -> None:
        # the place as the enum it is (records read back from the store carry its value);
        # "" stays "" (not placed: a rank that failed on its own)
        if self.state and not isinstance(self.state, Place):
            object.__setattr__(self, "state", Place(self.state) if self.state in _PLACES
                               else Place.UNKNOWN)  # fmt: skip

    @property
    def signal_name(self) -> str | None:
        """The name of the signal that killed the worker ("SIGKILL"), or None for an exit."""
        if self.exitcode >= 0:
            return None
        try:
            return signal.Signals(-self.exitcode).name
        except ValueError:
            return f"signal {-self.exitcode}"

    @property
    def exit_status(self) -> int:
        """What a shell (and the launcher) reports for this failure: the exit code, or
        128+N for a death by signal N (137 for SIGKILL)."""
        return self.exitcode if self.exitcode >= 0 else 128 - self.exitcode

    def describe_exit(self) -> str:
        """Say how it ended: "exit code 7" or "signal SIGKILL (exit status 137)"."""
        if self.exitcode >= 0:
            return f"exit code {self.exitcode}"
        return f"signal {self.signal_name} (exit status {self.exit_status})"

    def capped(self, max_bytes: int = PUBLISHED_MAX_BYTES) -> WorkerFailure:
        """A copy whose message and traceback fit in ``max_bytes`` bytes (UTF-8) together:
        the message gets up to a quarter, the traceback the rest; each keeps its head and its
        tail (where the exception is) around a note of how many bytes were cut
        (`cut_middle`). Returns ``self`` when both fit already."""
        message_b = len(self.message.encode("utf-8", "replace"))
        traceback_b = len(self.traceback.encode("utf-8", "replace"))
        if message_b + traceback_b <= max_bytes:
            return self
        message = cut_middle(self.message, max(max_bytes // 4, max_bytes - traceback_b))
        rest = max_bytes - len(message.encode("utf-8", "replace"))
        return dataclasses.replace(
            self, message=message, traceback=cut_middle(self.traceback, rest)
        )

    def to_json(self) -> str:
        """Serialize to a JSON object (a str), for the rendezvous store."""
        return json.dumps(dataclasses.asdict(self), sort_keys=True)

    @classmethod
    def from_json(cls, data: str | bytes) -> WorkerFailure:
        """Parse what :meth:`to_json` wrote. Unknown keys (a newer agent) are ignored.

        Raises:
            ValueError: ``data`` is not a JSON object with the required fields.
        """
        try:
            obj = json.loads(data)
        except (TypeError, ValueError) as e:
            raise ValueError(f"WorkerFailure.from_json: not JSON: {e}") from None
        if not isinstance(obj, dict):
            raise ValueError(f"WorkerFailure.from_json: expected a JSON object, got {obj!r:.80}")
        names = {f.name for f in dataclasses.fields(cls)}
        try:
            return cls(**{k: v for k, v in obj.items() if k in names})
        except TypeError as e:
            raise ValueError(f"WorkerFailure.from_json: {e}") from None


def read_error_file(path: str | os.PathLike | None) -> tuple[str, str, int | None] | None:
    """Read the error file written by torch's ``@record`` (``ErrorHandler.record_exception``).

    The format is ``{"message": {"message": MSG, "extraInfo": {"py_callstack": TB,
    "timestamp": "SECONDS"}}}``; a plain ``{"message": "MSG"}`` (what some launchers and
    ``ErrorHandler.dump_error_file`` users write) is accepted too.

    Returns:
        ``(message, traceback, timestamp_s)`` (traceback "" and timestamp None when absent), or
        None when ``path`` is None, missing, unreadable or not in either format. Never raises.
    """
    if not path:
        return None
    try:
        with open(path, encoding="utf-8", errors="replace") as f:
            data = json.load(f)
    except (OSError, ValueError):
        return None
    if not isinstance(data, dict) or "message" not in data:
        return None
    msg = data["message"]
    if isinstance(msg, str):
        return msg, "", _int_or_none(data.get("timestamp"))
    if not isinstance(msg, dict):
        return None
    extra = msg.get("extraInfo")
    extra = extra if isinstance(extra, dict) else {}
    text = msg.get("message", "")
    tb = extra.get("py_callstack", "")
    return (
        text if isinstance(text, str) else str(text),
        tb if isinstance(tb, str) else str(tb),
        _int_or_none(extra.get("timestamp")),
    )


def cut_middle(text: str, max_bytes: int) -> str:
    """``text`` if its UTF-8 form fits in ``max_bytes``, else its head (a third) and its tail
    (the rest) around a line ``[... N bytes cut by meshrun ...]``; the result fits in
    ``max_bytes`` (at least the note's ~40 bytes). Never splits a character."""
    data = text.encode("utf-8", "replace")
    if len(data) <= max_bytes:
        return text
    widest = f"\n[... {len(data)} bytes cut by meshrun ...]\n"  # no count has more digits
    room = max(0, max_bytes - len(widest))
    head, tail = room // 3, room - room // 3
    # The note counts the bytes left out, which the room for head and tail decides.
    note = f"\n[... {len(data) - head - tail} bytes cut by meshrun ...]\n"
    return (
        data[:head].decode("utf-8", "ignore")
        + note
        + (data[len(data) - tail :].decode("utf-8", "ignore") if tail else "")
    )


def root_cause(failures: Iterable[WorkerFailure]) -> WorkerFailure:
    """The first failure: earliest ``timestamp_ms``, ties broken by the lower global rank;
    stopped ranks (``stopped``) only when nothing failed. For a hang (every record a stack
    of a hung rank), the first of the likely culprits (`culprits`) when there are any.

    Raises:
        ValueError: ``failures`` is empty.
    """
    failures = list(failures)
    own = sorted((f for f in failures if not f.stopped), key=_order) or sorted(failures, key=_order)
    if not own:
        raise ValueError("root_cause: no failures given")
    if all(f.source == "stack" for f in own):
        blamed, _ = culprits(failures)
        first = next((f for f in own if f.global_rank in blamed), None)
        if first is not None:
            return first
    return own[0]


def placed(failures: Iterable[WorkerFailure]) -> list[WorkerFailure]:
    """``failures`` with each hung or stopped rank's place decided from data: the collective
    record first, then the stack.

    A rank whose record shows a collective pending (`meshrun.agent.collectives.pending_calls`:
    in progress or queued, which the record proves by a peer that has not issued it, a
    different call at its number, or the backend's own completion mark) is waiting in that call, wherever
    its Python frame is: under torch's DDP the main thread waits in autograd's
    ``_engine_run_backward`` while the reducer's all-reduce is what it waits for, and under
    FSDP2 in ``foreach_all_gather_copy_out``. Every other rank keeps the place its stack (or
    its last stderr lines) gave (`meshrun.agent.stacks.classify`). Records of ranks that
    failed on their own (an error file, a stderr tail) are returned as they are: their
    traceback places them.
    Idempotent: every caller (the hang line, the report, ``meshrun stacks``) places the same
    records the same way, on every node.
    """
    from meshrun.agent.collectives import from_summary, pending_calls

    failures = _one_per_rank(failures)
    records = {}
    for f in failures:
        record = from_summary(f.calls)
        if record is not None:
            records.setdefault(f.global_rank, record)
    pending = pending_calls(records)
    out = []
    for f in failures:
        call = pending.get(f.global_rank) if f.stopped or f.source == "stack" else None
        if call is None:
            out.append(f)
            continue
        group = "" if call.group == "0" else f" of group {call.group}"
        at = f.at if f.at and not f.at.startswith("unknown") else (call.at or f.at)
        out.append(dataclasses.replace(
            f, state=Place.WAITING, collective=f"{call.op} #{call.seq}{group}", at=at))
    return out


def _one_per_rank(failures: Iterable[WorkerFailure]) -> list[WorkerFailure]:
    """One record per global rank, in the order given: a rank that two nodes published (a
    desync's likely cause named by node rank 0 while its own node stopped it) keeps the
    record of its failure over a ``stopped`` one, else the first."""
    kept: dict[int, WorkerFailure] = {}
    for f in failures:
        other = kept.get(f.global_rank)
        if other is None or (other.stopped and not f.stopped):
            kept[f.global_rank] = f
    return [f for f in failures if kept.get(f.global_rank) is f]


#: Seconds without a new call on any rank before a live snapshot (``meshrun stacks``) names a
#: likely cause: the ranks' records are read at different moments, so a job that runs shows
#: ranks a few calls apart.
LIVE_SETTLE_S = 2.0


def culprits(failures: Iterable[WorkerFailure], *, live: bool = False) -> Verdict:
    """The global ranks that most likely caused the failure, and why, decided from data in
    this order (docs/hangs.md):

    1. the collective record (`disagreement`): a group whose ranks made different calls as
       the same call number names the smaller side (`Rule.RECORD_MISMATCH`); a group where
       some members never reached the call the others wait in names the ranks behind
       (`Rule.RECORD_BEHIND`);
    2. else each rank's place (`placed`: the record's pending calls, then the stacks) and
       meshrun.parallel's counters (`attribute`): the ranks outside any collective while
       others wait, else those behind in collectives issued, else those in a different
       collective. A rank that failed inside a collective (its traceback has a
       ``torch.distributed`` collective frame) counts as waiting.

    The record comes first because it is the same data on every rank and on every backend: a
    stack shows only where the Python thread is (the wrong place under DDP, FSDP2 and NCCL).

    ``live``: the records are a snapshot of a job that may still run (``meshrun stacks``): a
    rank that issued a call within `LIVE_SETTLE_S` of its snapshot shows the job moving, and
    then nobody is named (a mismatch still is: it never heals).
    """
    from meshrun.agent.collectives import from_summary
    from meshrun.agent.stacks import classify, traceback_frames

    failures = placed(failures)
    if live and _moving(failures):
        found = disagreement(failures)
        if found is None or found.behind or not found.culprits:
            return Verdict([], Why(f"the ranks made calls within the last {LIVE_SETTLE_S:g} s: "
                                   "the job is moving (a live snapshot names no cause)",
                                   Rule.NONE))  # fmt: skip
    desync = sorted({f.global_rank for f in failures if f.source == "desync" and not f.stopped})
    if desync:  # --desync-check compared every call as it came (the summaries keep the last few)
        return Verdict(desync, Why("named by --desync-check", Rule.RECORD_MISMATCH))
    found = disagreement(failures)
    if found is not None and found.culprits:
        state = {f.global_rank: f.state for f in failures if f.state}
        if found.behind and all(state.get(r) == Place.RUNNING for r in found.culprits):
            # behind, and in its own code: the words users know (a slow reader, a branch)
            return Verdict(list(found.culprits), Why(
                "outside any collective while the others wait", Rule.OUTSIDE))
        if found.behind:
            return Verdict(list(found.culprits), Why(
                "behind the others in collectives issued: it never reached the call they wait in",
                Rule.RECORD_BEHIND))
        if not found.against:  # waits across groups in a circle
            return Verdict(list(found.culprits), Why(
                "calls in another order than the others': each waits for another",
                Rule.RECORD_MISMATCH))
        ops = {f.collective.split(" #")[0] for f in failures if f.global_rank in found.culprits}
        if ops == {found.against}:  # the same op, other shapes or dtypes
            return Verdict(list(found.culprits), Why(
                f"in {found.against} with other arguments than the others'", Rule.RECORD_MISMATCH))
        return Verdict(list(found.culprits), Why(
            f"in a different collective from the others' {found.against}", Rule.RECORD_MISMATCH))
    places: dict[int, tuple[Whereabouts, int | None]] = {}
    for f in failures:
        if f.state:
            where = Whereabouts(f.state, f.collective, f.at)
        elif f.source in ("error.json", "stderr"):
            where = classify(traceback_frames(f.traceback))
            if where.state != Place.WAITING:
                continue  # it failed in its own code: a failure, not a place
        else:
            continue
        places.setdefault(f.global_rank, (where, f.collectives if f.collectives >= 0 else None))
    verdict = attribute(places)
    if verdict.why.rule is not Rule.OUTSIDE:
        return verdict
    # a running rank is what the others wait for only if it is behind one of them: with
    # records that show it made every call they made (a call broken under them, say), the
    # others wait for something else (another node, a call the record does not have)
    records = {f.global_rank: r for f in failures if (r := from_summary(f.calls)) is not None}
    waiting = [r for r, (w, _) in places.items() if w.state == Place.WAITING and r in records]
    kept = [r for r in verdict.ranks if r not in records or not waiting
            or any(_behind_of(r, records[r], records[w]) for w in waiting)]  # fmt: skip
    if kept:
        return Verdict(kept, verdict.why)
    return Verdict([], Why("the ranks running here made every call the waiting ranks made: "
                           "the culprit is elsewhere (another node?)", Rule.NONE))


def _moving(failures: list[WorkerFailure]) -> bool:
    """Whether some rank's newest recorded call was issued within `LIVE_SETTLE_S` of the moment
    its place was taken (its record's ``timestamp_ms``)."""
    from meshrun.agent.collectives import from_summary

    for f in failures:
        record = from_summary(f.calls)
        newest = max((c.issued_ms for c in record.calls), default=0) if record else 0
        if newest and f.timestamp_ms - newest < LIVE_SETTLE_S * 1000:
            return True
    return False


def _behind_of(rank: int, mine, theirs) -> bool:
    """Whether ``rank`` (record ``mine``) issued fewer calls than record ``theirs`` in a group
    of ``theirs`` it is a member of (a group it never called counts as none issued)."""
    return any(g.issued > (mine.groups[name].issued if name in mine.groups else 0)
               for name, g in theirs.groups.items() if rank in g.ranks)  # fmt: skip


def disagreement(failures: Iterable[WorkerFailure]):
    """The first collective the ranks of ``failures`` disagree on, from their records
    (`meshrun.agent.collectives.first_disagreement`), or None. The place of a rank that waits
    (or died) inside a collective (its stack's innermost own frame, or its traceback's) is
    shown beside its latest call."""
    from meshrun.agent.collectives import first_disagreement, from_summary
    from meshrun.agent.stacks import classify, traceback_frames

    records, sites, died = {}, {}, set()
    for f in failures:
        record = from_summary(f.calls)
        if record is None or f.global_rank in records:
            continue
        records[f.global_rank] = record
        where = Whereabouts(f.state, f.collective, f.at) if f.state else (
            classify(traceback_frames(f.traceback)))  # fmt: skip
        if where.state == Place.WAITING and where.at:
            sites[f.global_rank] = where.at.split(" (inside ")[0]
        elif not f.stopped and f.source != "stack":  # a signal, or its own code's error
            died.add(f.global_rank)
    return first_disagreement(records, sites, died) if len(records) > 1 else None


def desync_report(failures: Iterable[WorkerFailure]) -> str:
    """The calls the ranks made when torch's fingerprint check (``--desync-check``) failed,
    each with its call site, in one line; "" when no rank failed that check."""
    from meshrun.agent.collectives import desync_call, desync_line
    from meshrun.agent.stacks import classify, traceback_frames

    calls, sites = {}, {}
    for f in failures:
        found = desync_call(f.message) or desync_call(f.traceback)
        if found is None:
            continue
        rank, call = found
        calls[rank] = call
        at = classify(traceback_frames(f.traceback)).at
        if at and not at.startswith("unknown"):
            sites[rank] = at.split(" (inside ")[0]
    return desync_line(calls, sites) if calls else ""


def format_report(failures: Sequence[WorkerFailure], *, title: str = "meshrun: job failed") -> str:
    """Render the failure report: the root cause in full, the likely cause when that is another
    rank, one line per other failure, then every rank the agents stopped and where it was.

    Other failures get one line each (their message's first line, at most 200 characters).
    The root cause shows where it ran (host, node rank, local and global rank, pid), how it
    ended ("exit code 7" / "signal SIGKILL (exit status 137)"), when (local time, ms), the
    message and traceback (from error.json, else the kept stderr tail) and the log paths.
    Each stopped rank (and, in a hang, each other hung rank) gets a line with its place
    ("waiting in barrier", "likely cause: outside any collective"), the innermost frame of
    its own code and where its full stack is, then its main thread's innermost frames.
    The role is that of torch's ``ChildFailedError.format_msg``, without its ``<N/A>`` fields.

    Raises:
        ValueError: ``failures`` is empty.
    """
    if not failures:
        raise ValueError("format_report: no failures given")
    from meshrun.agent.stacks import classify, traceback_frames

    failures = placed(failures)
    first = root_cause(failures)
    blamed, why = culprits(failures)
    own = [f for f in sorted(failures, key=_order) if not f.stopped and f is not first]
    places = [f for f in own if f.source == "stack"]
    others = [f for f in own if f.source != "stack"]
    stopped = [f for f in sorted(failures, key=_rank) if f.stopped] + places
    rule = "=" * 72
    lines = [rule, title, rule, "Root cause (first observed failure):"]
    if first.stopped:
        lines[-1] = "No rank failed on its own; the agents stopped these:"
    lines.append(f"  rank       : {first.global_rank} (local rank {first.local_rank})")
    lines.append(f"  host       : {first.host or '?'} (node rank {first.node_rank})")
    lines.append(f"  pid        : {first.pid}")
    exit_text = first.describe_exit()
    if first.source == "stack":
        exit_text = f"hung, stopped by the agent (exit status {first.exit_status})"
    elif first.source == "desync":
        exit_text = (f"stopped by the agent: a desync (--desync-check), exit status "
                     f"{first.exit_status}")  # fmt: skip
    hint = _exit_hint(first)
    lines.append(f"  exit       : {exit_text}" + (f" - {hint}" if hint else ""))
    lines.append(f"  time       : {_format_time(first.timestamp_ms)}")
    if first.message:
        lines.append(f"  message    : {first.message}")
    if first.global_rank in blamed:
        lines.append(f"  likely     : the cause: {why}")
    if first.traceback:
        what = {
            "error.json": "traceback (error.json)",
            "stderr": "stderr (last lines)",
            "stack": "stack when hung (faulthandler / py-spy)",
        }.get(first.source, "traceback")
        lines.append(f"  {what}:")
        text = _without_meshrun_threads(first.traceback) if first.source == "stack" else first.traceback
        lines.extend("    " + line for line in text.rstrip("\n").splitlines())
    elif first.source != "desync":  # the desync line above is the whole story
        lines.append(
            "  traceback  : none (no error file: decorate main with torch's "
            "@record to get one; stderr was empty)"
        )
    if first.stdout_path or first.stderr_path:
        lines.append(f"  logs       : {first.stderr_path or '-'} (stderr)")
        lines.append(f"               {first.stdout_path or '-'} (stdout)")
    elsewhere = [f for f in stopped + others if f.global_rank in blamed]
    if elsewhere:
        ranks = ", ".join(str(f.global_rank) for f in elsewhere)
        lines.append(f"Likely cause: rank {ranks}, {why}:")
        for f in elsewhere:
            at = f.at or (classify(traceback_frames(f.traceback)).at if f.traceback else "?")
            lines.append(f"  rank {f.global_rank} ({_where(f)}) at {at}")
    if others:
        lines.append(f"Other failures ({len(others)}), in order observed:")
        for f in others:
            delta = f.timestamp_ms - first.timestamp_ms
            log = f", stderr: {f.stderr_path}" if f.stderr_path else ""
            note = f" - {first_line(f.message)}" if f.message else ""
            lines.append(
                f"  rank {f.global_rank} ({_where(f)}, pid {f.pid}): {f.describe_exit()}"
                f" at +{delta} ms{note}{log}"
            )
    # the record's line, also under --desync-check (whose own line, the root cause's message,
    # names the first mismatched call: the summaries keep only each rank's last calls)
    found = disagreement(failures)
    if found is not None and found.line:
        lines.append(f"Collectives: {found.line}")
    desync = desync_report(failures)
    if desync:
        lines.append(f"Desync: {desync}")
    if stopped:
        lines.append(f"Stopped ranks ({len(stopped)}), where each was:")
        lines.extend(format_places(stopped, blamed, among=failures))
    elif blamed == [] and why and found is None and not desync:
        lines.append(f"Note: {why}")
    if found is not None and not found.culprits and not blamed:
        lines.append("Note: as many ranks on each side of the disagreement: the record cannot "
                     "tell which side is wrong, so no rank is named the likely cause (the root "
                     "cause above is only the first to fail)")
    lines.append(rule)
    return "\n".join(lines)


#: Frames that mark one of meshrun's own threads in a worker (the collective record's, a busy()
#: beat, a background checkpoint save): left out of the report's stack, kept in the stack file.
_MESHRUN_THREADS = ("meshrun/agent/collective_record.py", "meshrun-collective-record",
                    "meshrun-busy", "meshrun-checkpoint", "meshrun-elastic")  # fmt: skip


def _without_meshrun_threads(dump: str) -> str:
    """A faulthandler or py-spy dump less the blocks of meshrun's own threads: a thread block
    starts at a "Thread ..." / "Current thread ..." line and runs to the next."""
    blocks: list[list[str]] = []
    for line in dump.splitlines():
        if line.startswith(("Thread ", "Current thread ")) or not blocks:
            blocks.append([])
        blocks[-1].append(line)
    kept = [b for b in blocks if not any(mark in line for line in b for mark in _MESHRUN_THREADS)]
    return "\n".join(line for b in kept for line in b)


def _exit_hint(f: WorkerFailure) -> str | None:
    """A hint for how the worker ended: the signal's usual cause, or, for an abort whose
    stderr ends in C++'s "terminate called without an active exception", torch's teardown at
    interpreter exit (a joinable gloo/TCPStore thread destroyed after the script returned)."""
    if f.signal_name == "SIGABRT" and _TEARDOWN_ABORT in f.traceback[-2000:]:
        return ("torch's C++ teardown at interpreter exit, likely after the script's own code "
                "had finished (a gloo or TCPStore thread still running): end the script with "
                "torch.distributed.destroy_process_group(), as meshrun.parallel.init() "
                "arranges at exit")
    return _SIGNAL_HINTS.get(f.signal_name or "")


_TEARDOWN_ABORT = "terminate called without an active exception"


def format_places(
    records: Sequence[WorkerFailure], blamed: Sequence[int] = (),
    among: Sequence[WorkerFailure] = (),
) -> list[str]:
    """Where each rank of ``records`` was (its place, the innermost frame of its own code,
    where its full stack is, its main thread's innermost frames, its last collectives with the
    pending one marked), the ranks in ``blamed`` marked as the likely cause; two spaces of
    indent. ``among`` are the records the pending calls are judged over (all of the job's;
    default ``records``). Used by the failure report (stopped ranks) and by ``meshrun stacks``
    (every rank, live)."""
    from meshrun.agent.collectives import from_summary, pending_calls

    calls = {f.global_rank: r for f in (among or records)
             if (r := from_summary(f.calls)) is not None}  # fmt: skip
    pending = pending_calls(calls)
    lines: list[str] = []
    for f in records:
        lines.extend(_place_lines(f, f.global_rank in blamed, calls, pending.get(f.global_rank)))
    return lines


def describe_place(f: WorkerFailure) -> str:
    """Where a rank was, in a few words: "waiting in barrier", "running, outside any
    collective", or "place unknown"."""
    if f.state == Place.WAITING:
        return f"waiting in {f.collective or 'a collective'}"
    if f.state == Place.RUNNING:
        return "running, outside any collective"
    return "place unknown"


def _place_lines(f: WorkerFailure, blamed: bool, calls: dict, pending) -> list[str]:
    """One rank: its place, then its main thread's innermost frames."""
    place = describe_place(f)
    if blamed:
        place = f"LIKELY CAUSE, {place}"
    head = f"  rank {f.global_rank} ({_where(f)}, pid {f.pid}): {place}"
    lines = [head + (f" at {f.at}" if f.at else "")]
    from meshrun.agent.collectives import describe_recent

    recent = describe_recent(calls.get(f.global_rank), pending=pending)
    if recent:
        lines.append(f"    last collectives: {recent}")
    if f.stack_path:
        lines.append(f"    full stack: {f.stack_path}")
    elif f.stack_problem:
        lines.append(f"    {f.stack_problem}")
    from meshrun.agent.stacks import main_thread

    for frame in main_thread(f.traceback)[:_STACK_LINES]:
        lines.append(f"      {frame}")
    return lines


# Frames of each stopped rank's main thread shown in the report (the rest are in its stack file).
_STACK_LINES = 6


def _where(f: WorkerFailure) -> str:
    return f"host {f.host or '?'}, node rank {f.node_rank}, local rank {f.local_rank}"


def _rank(f: WorkerFailure) -> int:
    return f.global_rank


# --- helpers ---------------------------------------------------------------------------------


def _order(f: WorkerFailure) -> tuple[int, int]:
    return (f.timestamp_ms, f.global_rank)


def _format_time(ms: int) -> str:
    """Local time with milliseconds and the UTC offset: 2025-11-29 14:12:03.123 +0000."""
    seconds, millis = divmod(int(ms), 1000)
    t = time.localtime(seconds)
    return time.strftime("%Y-%m-%d %H:%M:%S", t) + f".{millis:03d} " + time.strftime("%z", t)


def _int_or_none(value: object) -> int | None:
    try:
        return int(value)  # type: ignore[arg-type]
    except (TypeError, ValueError):
        return None
