"""The collective record: each rank's recent collectives, and the first call the ranks disagree on.

The classic distributed mistakes (a rank that skips a collective under ``if rank == 0:``, one
that calls ``broadcast`` where the others call ``all_reduce``, a data-dependent branch) leave
every rank waiting until a timeout, and each rank's stack alone shows only "waiting". What
names the mistake is the *sequence* of collectives: every process group numbers its
collectives, and all members must issue the same op with the same shapes as call number n.

**What is recorded.** torch's flight recorder keeps, per process, a ring of the last
``TORCH_FR_BUFFER_SIZE`` collectives it issued on any backend (gloo included, since torch 2.6):
process group, sequence number in that group, op, input shapes and dtypes, time issued; and,
per group, the last number issued ("enqueued") and the last one completed. The agent turns it
on through the worker's environment (`record_env`), so a plain torch script records with no
change. torch keeps the ring in the worker's memory, where a blocked or dead rank cannot be
asked for it, so a thread in the worker (`Recorder`, started by meshrun's ``sitecustomize``)
writes a compact copy to a file in the rank's log directory whenever it changed, checking
every `INTERVAL_S`, and once more at exit. The copy adds what the ring lacks: each group's
member ranks. A rank blocked in gloo or NCCL releases the GIL, so its file stays current; a
rank killed with SIGKILL leaves the copy of at most `INTERVAL_S` before. Point-to-point calls
(``send``/``recv``) are not in the ring for gloo and are left out for every backend.

**What is read.** The agent reads every rank's file when it reports a hang or a failure
(`read_record`) and publishes a summary with the rank's failure record (`summary`), so every
node can compare every rank. `first_disagreement` finds, group by group:

- **a mismatch**: call number n is not the same call on every rank that made it (op, and the
  shapes and dtypes where they must agree): "in group 0, rank 1 is at broadcast #4
  (float[4]) at train.py:13 in step while rank 0 is at all_reduce #4 (float[4]) at
  train.py:15 in step". The ranks of the smaller side are the likely cause.
- **a rank behind**: some members issued call n and wait in it while others never reached it:
  "rank 0 never reached all_reduce #40 (float[8]) of group 0 (ranks 0-3), where ranks 1-3
  wait at train.py:15 in step; last call there: rank 0: all_reduce #39". The ranks behind
  are the likely cause.

Cost: the thread dumps the ring at most every `INTERVAL_S`, in the background; a DDP step measured 1.03-1.08x with the record on, within the
run-to-run noise (``benchmarks/ddp.py --record``). ``MESHRUN_COLLECTIVE_RECORD=0`` turns the
record off.

This module imports only the standard library: workers load it by path at start-up (see
``worker_site/sitecustomize.py``), before the script imports torch.
"""

from __future__ import annotations

import atexit
import contextlib
import json
import os
import re
import sys
import threading
import time
import weakref
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

#: Set in a worker's environment to the path its record goes to; "0" in the agent's own
#: environment turns the record off.
RECORD_ENV = "MESHRUN_COLLECTIVE_RECORD"
RECORD_FILE = "collectives.json"
#: Entries of torch's flight recorder ring, unless the user set ``TORCH_FR_BUFFER_SIZE``.
RING_ENTRIES = 64
#: Seconds between the recorder thread's looks at the ring.
INTERVAL_S = 0.5
#: Calls kept in the file, and in the summary published with a failure record.
FILE_CALLS = 32
SUMMARY_CALLS = 8


def record_env(log_dir: Path) -> dict[str, str]:
    """The environment that makes a worker record its collectives into ``log_dir``; empty when
    ``MESHRUN_COLLECTIVE_RECORD=0`` is set for the agent. torch's ``TORCH_FR_BUFFER_SIZE`` is
    kept when the user set it (0 leaves the ring off; the record then lists no calls)."""
    if os.environ.get(RECORD_ENV) == "0":
        return {}
    env = {RECORD_ENV: str(log_dir / RECORD_FILE)}
    if "TORCH_FR_BUFFER_SIZE" not in os.environ and "TORCH_NCCL_TRACE_BUFFER_SIZE" not in os.environ:
        env["TORCH_FR_BUFFER_SIZE"] = str(RING_ENTRIES)
    return env


# --- the worker's side -----------------------------------------------------------------------


class Recorder:
    """The thread in a worker that keeps its record file current (see the module docstring).

    It does nothing until the script has initialized ``torch.distributed`` (it only looks in
    ``sys.modules``: torch is never imported for it), then writes the file whenever the ring
    changed. `stop` (registered with ``atexit``) ends the thread before the interpreter
    finalizes, so it is never inside torch when the interpreter goes away, and writes the
    last state.

    Args:
        path: the record file (written by rename, so a reader never sees half of it).
        interval: seconds between looks.
    """

    def __init__(self, path: str, interval: float = INTERVAL_S) -> None:
        self.path = path
        self.interval = interval
        self._done = threading.Event()
        self._last = b""
        self._names: dict[str, str] = {}  # group name -> its member ranks ("0-3")
        self._live: list[tuple[weakref.ref, str]] = []  # the groups at the last look
        self._seen = -1  # the newest ring entry (record_id) at the last look
        self._cutoff: dict[str, int] = {}  # group name -> its entries up to here: destroyed
        self._thread = threading.Thread(target=self._run, name="meshrun-collective-record",
                                        daemon=True)  # fmt: skip

    def start(self) -> Recorder:
        self._thread.start()
        atexit.register(self.stop)
        return self

    def stop(self) -> None:
        """End the thread and write the last state (called at exit)."""
        self._done.set()
        if self._thread.is_alive() and self._thread is not threading.current_thread():
            self._thread.join(2 * self.interval + 1)
        self.write_once()

    def _run(self) -> None:
        while not self._done.wait(self.interval):
            self.write_once()

    def write_once(self) -> bool:
        """Write the record when the ring changed; True when written. Never raises: a record
        that cannot be made or written is skipped (the worker must not notice)."""
        try:
            dist = sys.modules.get("torch.distributed")
            if dist is None or not dist.is_available() or not dist.is_initialized():
                return False
            from torch._C._distributed_c10d import _dump_fr_trace_json

            dump = _dump_fr_trace_json(True, False)
            if dump == self._last:
                self._touch()
                return False
            ring = json.loads(dump)
            record = make_record(ring, self._group_ranks(dist, ring), self._cutoff)
        except Exception:  # noqa: BLE001 - no record then (the report goes without its line)
            return False
        tmp = f"{self.path}.{os.getpid()}.tmp"
        try:
            with open(tmp, "w") as f:
                json.dump(record, f, separators=(",", ":"))
            os.replace(tmp, self.path)
        except OSError:  # a full log disk: the worker must not notice; tried again later
            with contextlib.suppress(OSError):
                os.unlink(tmp)
            return False
        self._last = dump
        return True

    def _touch(self) -> None:
        """Mark the unchanged record as current (its mtime): the agent waits for that before it
        reads a rank it is about to stop (`wait_current`)."""
        with contextlib.suppress(OSError):
            os.utime(self.path)

    def _group_ranks(self, dist, ring: dict) -> dict[str, str]:
        """Each live process group's name (as torch's ring names it) -> its member ranks.

        A group destroyed since the last look (``destroy_process_group()``, then perhaps a new
        ``init_process_group``, whose default group is named "0" again) ends its calls: the
        ring outlives the groups, so that group's entries up to the last look are left out
        from then on (``self._cutoff``, per group name: the other groups keep theirs), and
        its member list is found again; calls it made after the last look are told by
        `make_record` (a new group's sequence numbers start again). The groups are
        remembered by weak reference: a new group may take a destroyed one's address, so an
        ``id()`` would call it the same group (a flake in CI: the old calls stayed)."""
        world = dist.distributed_c10d._world
        groups = list(world.pg_names.items())
        now = {id(pg) for pg, _ in groups}  # ids of live objects: unique while they live
        for ref, name in self._live:
            if (pg := ref()) is None or id(pg) not in now:
                self._cutoff[name] = self._seen
                self._names.pop(name, None)
        self._live = [(weakref.ref(pg), name) for pg, name in groups]
        self._seen = max((int(e.get("record_id", -1)) for e in ring.get("entries", [])),
                         default=self._seen)  # fmt: skip
        for pg, name in groups:
            if name not in self._names:
                try:
                    self._names[name] = ranges(dist.get_process_group_ranks(pg))
                except Exception:  # noqa: BLE001 - a group being destroyed
                    continue
        return self._names


def wait_current(paths: list[Path], since: float, abort=lambda: False) -> None:
    """Wait until each record in ``paths`` was looked at by its rank's thread after ``since``
    (a `time.time`), at most `INTERVAL_S` and a margin after it. A rank that entered its last
    collective less than `INTERVAL_S` before the agent stops it would otherwise be read
    without that call; a rank that cannot look (stopped, not yet in ``init_process_group``)
    only costs the wait. ``abort()`` true ends the wait (a signal for the agent)."""
    deadline = since + INTERVAL_S + 0.3
    pending = list(paths)
    while pending and time.time() < deadline and not abort():
        pending = [p for p in pending if not _looked_after(p, since)]
        if pending:
            time.sleep(0.02)


def _looked_after(path: Path, since: float) -> bool:
    try:
        return path.stat().st_mtime >= since
    except OSError:
        return False


def make_record(dump: dict, group_ranks: dict[str, str],
                cutoff: int | dict[str, int] = -1) -> dict:
    """Turn torch's flight-recorder dump (``_dump_fr_trace_json``) into the record file's shape:
    ``{"pid", "written_ms", "groups": {name: {"ranks", "issued", "done"}}, "calls": [...]}``,
    each call ``{"group", "seq", "op", "args", "issued_ms"}``, oldest first, p2p and the
    entries up to ``cutoff`` (``record_id``, for every group or per group name: calls of
    groups destroyed since) left out, and so are a group name's calls before its sequence
    numbers start again (a group destroyed and made again under the same name).

    ``issued``/``done`` are the last sequence numbers issued and completed in the group (0:
    none). Groups are keyed by their global name (torch's ``pg_id`` is a per-process index and
    differs between ranks that belong to different groups); groups the script did not create
    (a desync check's helper groups) are left out.
    """
    id_to_name: dict[str, str] = {}
    calls = []
    last_seq: dict[str, int] = {}  # group name -> the sequence number of its latest call
    for e in sorted(dump.get("entries", []), key=lambda e: int(e.get("record_id", 0))):
        name = str(e.get("process_group", ["?"])[0])
        if name == "" and str(e.get("pg_id")) == "0":
            name = "0"  # a desync check's wrapper leaves names empty; 0 is the default group
        limit = cutoff.get(name, -1) if isinstance(cutoff, dict) else cutoff
        if int(e.get("record_id", 0)) <= limit:
            continue
        id_to_name[str(e.get("pg_id"))] = name
        if e.get("is_p2p") or name not in group_ranks:
            continue
        seq = int(e.get("collective_seq_id", 0))
        if 0 < seq <= last_seq.get(name, 0):  # numbered from 1 again: a new group
            calls = [c for c in calls if c["group"] != name]
        last_seq[name] = seq
        calls.append({
            "group": name,
            "seq": seq,
            "op": str(e.get("profiling_name", "?")).split(":")[-1],
            "args": _describe_args(e.get("input_sizes", []), e.get("input_dtypes", [])),
            "issued_ms": int(e.get("time_created_ns", 0)) // 1_000_000,
        })  # fmt: skip
    groups = {}
    for pg_id, status in dump.get("pg_status", {}).items():
        name = id_to_name.get(str(pg_id))
        if name is None or name not in group_ranks:
            continue
        groups[name] = {
            "ranks": group_ranks[name],
            "issued": max(0, int(status.get("last_enqueued_collective", 0))),
            "done": max(0, int(status.get("last_completed_collective", 0))),
        }
    return {"pid": os.getpid(), "written_ms": int(time.time() * 1000), "groups": groups,
            "calls": calls[-FILE_CALLS:]}  # fmt: skip


def _describe_args(sizes: list, dtypes: list) -> str:
    """``[[4, 3]], ["Float"]`` -> "float[4, 3]"; several tensors joined with ", "."""
    parts = [f"{str(d).lower()}{list(s)}" for s, d in zip(sizes, dtypes, strict=False)]
    text = ", ".join(parts)
    return text if len(text) <= 80 else text[:77] + "..."


def ranges(ranks) -> str:
    """``[0, 1, 2, 5]`` -> "0-2,5" (a group's members, compact for a large world)."""
    out: list[list[int]] = []
    for r in sorted(int(r) for r in ranks):
        if out and out[-1][1] == r - 1:
            out[-1][1] = r
        else:
            out.append([r, r])
    return ",".join(f"{a}-{b}" if a != b else str(a) for a, b in out)


def parse_ranges(text: str) -> list[int]:
    """Inverse of `ranges`: "0-2,5" -> ``[0, 1, 2, 5]``; "" -> ``[]``.

    Raises:
        ValueError: not of that form.
    """
    ranks: list[int] = []
    for part in filter(None, text.split(",")):
        first, _, last = part.partition("-")
        ranks.extend(range(int(first), int(last or first) + 1))
    return ranks


def start_recorder_from_env() -> Recorder | None:
    """In a worker: start the `Recorder` when the agent asked for one (`RECORD_ENV`), and take
    the variable out of the environment, so the processes the script starts do not write the
    same file."""
    path = os.environ.pop(RECORD_ENV, "")
    if not path or path == "0":
        return None
    return Recorder(path).start()


# --- the agent's side ------------------------------------------------------------------------


@dataclass(frozen=True)
class Call:
    """One collective a rank issued: its group's name, its number in that group (from 1), op,
    arguments ("float[4, 3]"), and whether the group has completed it on this rank."""

    group: str
    seq: int
    op: str
    args: str
    done: bool

    @property
    def kind(self) -> tuple[str, str]:
        """What every rank must agree on for this call: the op, and the arguments' shapes and
        dtypes for ops that need them equal on every rank (``SAME_ARGS``)."""
        return (self.op, self.args if self.op in SAME_ARGS else "")


#: Ops whose arguments have the same shapes and dtypes on every rank (as torch's flight
#: recorder writes them). Others may differ by design: the root's list in ``scatter`` and
#: ``gather``, the splits of ``all_to_all``, an uneven ``all_gather`` or ``reduce_scatter``
#: of lists (NCCL allows them; the ring names the flat variants the same).
SAME_ARGS = frozenset({"all_reduce", "broadcast", "reduce", "barrier"})


@dataclass(frozen=True)
class Group:
    """A process group as one rank sees it: members, last call numbers issued and completed."""

    ranks: tuple[int, ...]
    issued: int
    done: int


@dataclass(frozen=True)
class Record:
    """One rank's recent collectives (`read_record`, `from_summary`)."""

    groups: dict[str, Group] = field(default_factory=dict)
    calls: tuple[Call, ...] = ()

    def call(self, group: str, seq: int) -> Call | None:
        return next((c for c in self.calls if c.group == group and c.seq == seq), None)

    def last_in(self, group: str) -> Call | None:
        return next((c for c in reversed(self.calls) if c.group == group), None)


def read_record(path: Path) -> Record | None:
    """The record file at ``path``, or None when there is none or it cannot be parsed."""
    try:
        return _parse(json.loads(Path(path).read_text()))
    except (OSError, ValueError, TypeError, KeyError, AttributeError):
        return None


def summary(record: Record | None) -> dict:
    """The record in a few hundred bytes, for the store: the groups, and the last
    `SUMMARY_CALLS` calls (at least the last one of each group, when it is kept at all)."""
    if record is None:
        return {}
    last_of_group = {c.group: c for c in record.calls}
    keep = set(record.calls[-SUMMARY_CALLS:]) | set(last_of_group.values())
    calls = [c for c in record.calls if c in keep]
    return {
        "groups": {n: {"ranks": ranges(g.ranks), "issued": g.issued, "done": g.done}
                   for n, g in record.groups.items()},
        "calls": [[c.group, c.seq, c.op, c.args] for c in calls],
    }  # fmt: skip


def from_summary(data: object) -> Record | None:
    """Inverse of `summary` (a record published by another node); None when empty or malformed."""
    if not isinstance(data, dict) or not data:
        return None
    try:
        calls = [{"group": g, "seq": s, "op": o, "args": a} for g, s, o, a in data["calls"]]
        return _parse({"groups": data["groups"], "calls": calls})
    except (ValueError, TypeError, KeyError, AttributeError):
        return None


def _parse(raw: dict) -> Record:
    groups = {
        str(name): Group(tuple(parse_ranges(str(g["ranks"]))), int(g["issued"]), int(g["done"]))
        for name, g in raw["groups"].items()
    }
    calls = []
    for c in raw["calls"]:
        name, seq = str(c["group"]), int(c["seq"])
        done = name in groups and seq <= groups[name].done
        calls.append(Call(name, seq, str(c["op"]), str(c["args"]), done))
    return Record(groups, tuple(calls))


def describe_recent(record: Record | None, n: int = 3) -> str:
    """A rank's last ``n`` calls in a few words: "all_reduce #39, broadcast #40 (in progress)",
    each call outside the default group "0" followed by its group; "" when none is recorded."""
    if record is None:
        return ""
    parts = []
    for c in record.calls[-n:]:
        group = "" if c.group == "0" else f" of group {c.group}"
        parts.append(f"{c.op} #{c.seq}{group}" + ("" if c.done else " (in progress)"))
    return ", ".join(parts)


@dataclass(frozen=True)
class Disagreement:
    """The first point where the ranks' collectives disagree: one line to print, the ranks
    that most likely caused it (the smaller side of a mismatch, or the ranks behind), and
    which: ``behind`` when they never reached the call the others wait in, else a mismatch
    (different calls at the same call number)."""

    line: str
    culprits: tuple[int, ...]
    behind: bool = False


def first_disagreement(
    records: dict[int, Record], sites: dict[int, str] | None = None,
    died: frozenset[int] | set[int] = frozenset(),
) -> Disagreement | None:
    """Where the ranks' collectives first disagree (see the module docstring), or None.

    Args:
        records: global rank -> its record (ranks without one are left out of the comparison).
        sites: global rank -> where a rank that waits (or died) inside a collective is
            ("train.py:13 in step"), shown beside its latest call.
        died: ranks that failed on their own outside a collective's error (killed by a
            signal, an exception in their own code): their last call was not a wait for the
            others, so nobody is "behind" them (a rank SIGKILLed inside call n does not make
            the ranks that had not reached n yet the cause).

    A mismatch in any group comes before a rank behind; among several, the lowest call
    number of the group listed first.
    """
    sites = sites or {}
    names = sorted({n for r in records.values() for n in r.groups}, key=_group_order)
    for name in names:
        found = _mismatch(name, records, sites)
        if found is not None:
            return found
    for name in names:
        found = _behind(name, records, sites, died)
        if found is not None:
            return found
    return None


def _mismatch(name: str, records: dict[int, Record], sites: dict[int, str]) -> Disagreement | None:
    members = {r: rec for r, rec in records.items() if name in rec.groups}
    seqs = sorted({c.seq for rec in members.values() for c in rec.calls if c.group == name})
    for seq in seqs:
        calls = {r: rec.call(name, seq) for r, rec in members.items()}
        calls = {r: c for r, c in calls.items() if c is not None}
        kinds = Counter(c.kind for c in calls.values())
        if len(kinds) < 2:
            continue
        sides = sorted(kinds.items(), key=lambda kv: (-kv[1], kv[0]))  # the larger side first
        parts = []
        for kind, _ in sides:
            ranks = sorted(r for r, c in calls.items() if c.kind == kind)
            one = calls[ranks[0]]
            inside = not all(calls[r].done for r in ranks)
            verb = ("is at" if len(ranks) == 1 else "are at") if inside else "called"
            where = _site(ranks, sites, members, one)
            parts.append(f"{_ranks_word(ranks)} {verb} {_call_text(one)}{where}")
        smallest = sides[-1][1]
        culprits: tuple[int, ...] = ()
        if sum(1 for _, n in sides if n == smallest) == 1 and smallest < sides[0][1]:
            odd = sides[-1][0]
            culprits = tuple(sorted(r for r, c in calls.items() if c.kind == odd))
        line = f"in group {name}, " + parts[-1] + " while " + "; ".join(parts[:-1])
        return Disagreement(line, culprits)
    return None


def _behind(
    name: str, records: dict[int, Record], sites: dict[int, str], died=frozenset()
) -> Disagreement | None:
    members = {r: rec for r, rec in records.items() if name in rec.groups}
    group_ranks = next(iter(members.values())).groups[name].ranks if members else ()
    # members that never issued a call in the group have no status for it: issued 0
    issued = {r: records[r].groups[name].issued if name in records[r].groups else 0
              for r in group_ranks if r in records}  # fmt: skip
    if len(issued) < 2:
        return None
    front = max(issued.values())
    # at the front and inside its call: not completed, or died in a collective (a timed-out
    # call counts as completed in torch's ring)
    waiting = sorted(
        r for r, n in issued.items()
        if n == front and r not in died and (records[r].groups[name].done < front or r in sites)
    )  # fmt: skip
    behind = sorted(r for r, n in issued.items() if n < front)
    if not waiting or not behind:
        return None
    call = records[waiting[0]].call(name, front)
    what = _call_text(call) if call else f"call #{front}"
    where = _site(waiting, sites, records, call) if call else ""
    lasts = []
    for r in behind:
        last = records[r].last_in(name)
        if last is None:
            n = issued[r]
            lasts.append(f"rank {r}: " + (f"call #{n}" if n else "no call in this group yet"))
        else:
            lasts.append(f"rank {r}: {last.op} #{last.seq}")
    line = (f"{_ranks_word(behind)} never reached {what} of group {name} "
            f"(ranks {ranges(group_ranks)}), where {_ranks_word(waiting)} "
            f"{'waits' if len(waiting) == 1 else 'wait'}{where}; "
            f"last call there: {'; '.join(lasts)}")  # fmt: skip
    return Disagreement(line, tuple(behind), behind=True)


# torch's fingerprint check (TORCH_DISTRIBUTED_DEBUG=DETAIL, meshrun --desync-check) raises
# "Detected mismatch between collectives on ranks. Rank 1 is running collective:
# CollectiveFingerPrint(SequenceNumber=1, OpType=ALLREDUCE, TensorShape=[4], TensorDtypes=Float,
# ...), but Rank 0 is running collective: ...". Only the raising rank's own fingerprint is
# read: torch 2.13 decodes the other rank's wrongly when the two differ in their tensors.
_FINGERPRINT = re.compile(
    r"Detected mismatch between collectives on ranks\. Rank (?P<rank>\d+) is running "
    r"collective: CollectiveFingerPrint\(SequenceNumber=(?P<seq>\d+),? ?OpType=(?P<op>\w+)"
    r"(?:, TensorShape=(?P<shape>\[[^\]]*\]))?(?:, TensorDtypes=(?P<dtype>\w+))?"
)
_TORCH_OPS = {"ALLREDUCE": "all_reduce", "ALLGATHER": "all_gather", "REDUCE_SCATTER":
              "reduce_scatter", "ALLTOALL": "all_to_all", "ALLTOALL_BASE": "all_to_all",
              "_ALLGATHER_BASE": "all_gather", "_REDUCE_SCATTER_BASE": "reduce_scatter"}  # fmt: skip


def desync_call(text: str) -> tuple[int, Call] | None:
    """The raising rank and the call it made, from torch's fingerprint-mismatch error in
    ``text`` (a message or traceback), or None. Its number counts from 1, as the record's,
    within its process group, which torch's message does not name (group "?")."""
    m = _FINGERPRINT.search(text)
    if m is None:
        return None
    op = _TORCH_OPS.get(m["op"], m["op"].lower())
    args = f"{m['dtype'].lower()}{m['shape']}" if m["shape"] and m["dtype"] else ""
    return int(m["rank"]), Call("?", int(m["seq"]) + 1, op, args, False)


def desync_line(calls: dict[int, Call], sites: dict[int, str]) -> str:
    """One line naming each raising rank's call and call site, for the report."""
    parts = []
    for rank, c in sorted(calls.items()):
        where = f" at {sites[rank]}" if sites.get(rank) else ""
        parts.append(f"rank {rank} called {_call_text(c)}{where}")
    line = "; ".join(parts)
    if len(calls) == 1:
        line += ", which another rank did not"
    return line + " (torch's fingerprint check, --desync-check)"


def _call_text(c: Call) -> str:
    group = " of its group" if c.group == "?" else ""
    return f"{c.op} #{c.seq}{group}" + (f" ({c.args})" if c.args else "")


def _site(ranks: list[int], sites: dict[int, str], records: dict[int, Record], call: Call) -> str:
    """Where the call was made, as " at train.py:13 in step", or "": the place of the first of
    ``ranks`` that is (or died) inside a collective (``sites``) and whose latest call in the
    group is this one."""
    for r in ranks:
        last = records[r].last_in(call.group)
        if sites.get(r) and last is not None and last.seq == call.seq:
            return f" at {sites[r]}"
    return ""


def _ranks_word(ranks: list[int]) -> str:
    text = ranges(ranks).replace(",", ", ")
    return f"rank {text}" if len(ranks) == 1 else f"ranks {text}"


def _group_order(name: str) -> tuple[int, str]:
    return (int(name), "") if name.isdigit() else (1 << 30, name)
