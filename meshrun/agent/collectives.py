"""The collective record, the agent's side: read each rank's record, find the first call the
ranks disagree on.

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

Cost (measured with the worker's side on): the thread dumps the ring at most every `INTERVAL_S`, in the background; a DDP step measured 1.03-1.08x with the record on, within the
run-to-run noise (``benchmarks/ddp.py --record``). ``MESHRUN_COLLECTIVE_RECORD=0`` turns the
record off.

The worker's side (what is recorded, and how) is `meshrun.agent.collective_record`.
"""

from __future__ import annotations

import functools
import json
import os
import re
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

from meshrun.agent.collective_record import (
    INTERVAL_S,
    RECORD_ENV,
    RECORD_FILE,
    RING_ENTRIES,
    parse_ranges,
    ranges,
)

#: Calls kept in the summary published with a failure record.
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


# --- the agent's side ------------------------------------------------------------------------


@dataclass(frozen=True)
class Call:
    """One collective a rank issued: its group's name, its number in that group (from 1), op,
    arguments ("float[4, 3]"), whether the group has completed it on this rank (as far as
    torch's ring knows: see `Group.tracks_done`), and its call site ("train.py:42 in step";
    "" where the record has none)."""

    group: str
    seq: int
    op: str
    args: str
    done: bool
    at: str = ""
    #: when the rank issued it, ms since the epoch on its host's clock (0: unknown)
    issued_ms: int = 0

    @property
    def kind(self) -> tuple[str, str]:
        """What every rank must agree on for this call: the op, and the arguments' shapes and
        dtypes for ops that need them equal on every rank (``SAME_ARGS``), else their dtypes
        (an uneven ``all_gather`` or the root's list in ``scatter`` differ in shapes, never
        in dtypes: an int32 gathered where the others gather float32 is garbage on gloo)."""
        if self.op in SAME_ARGS:
            return (self.op, self.args)
        return (self.op, ",".join(sorted(set(_DTYPE.findall(self.args)))))


_DTYPE = re.compile(r"([A-Za-z0-9_]+)\[")

#: Ops whose arguments have the same shapes and dtypes on every rank (as torch's flight
#: recorder writes them). Others may differ by design: the root's list in ``scatter`` and
#: ``gather``, the splits of ``all_to_all``, an uneven ``all_gather`` or ``reduce_scatter``
#: of lists (NCCL allows them; the ring names the flat variants the same).
SAME_ARGS = frozenset({"all_reduce", "broadcast", "reduce", "barrier"})


@dataclass(frozen=True)
class Group:
    """A process group as one rank sees it: members, last call numbers issued and completed,
    and its backend as torch's ring names it ("gloo", "nccl"; "" when unknown)."""

    ranks: tuple[int, ...]
    issued: int
    done: int
    backend: str = ""

    @property
    def tracks_done(self) -> bool:
        """Whether ``done`` is a completion the backend reports, on every backend of the group
        (a group of both, "cpu:gloo,cuda:nccl", included). NCCL's watchdog marks a call
        completed when its kernel has finished. gloo's (torch 2.13) moves when the call's work
        finishes, a moment after the call returned (read at once, 3 of 20 async and 7 of 20
        sync calls were still unmarked; after 50 ms none), and never while the call is blocked
        (`tests/agent/test_collective_record.py`): a record read a hang-timeout after the
        ranks stopped moving has it. A timed-out call counts as completed on both. Any other
        backend's (or an unknown one's) ``done`` is not trusted."""
        parts = [b.split(":")[-1] for b in self.backend.split(",") if b]
        return bool(parts) and all(b in ("nccl", "gloo") for b in parts)


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
        "groups": {n: {"ranks": ranges(g.ranks), "issued": g.issued, "done": g.done,
                       "backend": g.backend} for n, g in record.groups.items()},
        "calls": [[c.group, c.seq, c.op, c.args, c.at, c.issued_ms] for c in calls],
    }  # fmt: skip


def from_summary(data: object) -> Record | None:
    """Inverse of `summary` (a record published by another node); None when empty or malformed."""
    if not isinstance(data, dict) or not data:
        return None
    try:
        calls = [{"group": c[0], "seq": c[1], "op": c[2], "args": c[3],
                  "at": c[4] if len(c) > 4 else "", "issued_ms": c[5] if len(c) > 5 else 0}
                 for c in data["calls"]]  # fmt: skip
        return _parse({"groups": data["groups"], "calls": calls})
    except (ValueError, TypeError, KeyError, AttributeError, IndexError):
        return None


def _parse(raw: dict) -> Record:
    groups = {
        str(name): Group(_members(str(g["ranks"])), int(g["issued"]), int(g["done"]),
                         str(g.get("backend", "")))
        for name, g in raw["groups"].items()
    }  # fmt: skip
    calls = []
    for c in raw["calls"]:
        name, seq = str(c["group"]), int(c["seq"])
        done = name in groups and seq <= groups[name].done
        calls.append(Call(name, seq, str(c["op"]), str(c["args"]), done, str(c.get("at") or ""),
                          int(c.get("issued_ms") or 0)))
    return Record(groups, tuple(calls))


@functools.lru_cache(maxsize=256)
def _members(text: str) -> tuple[int, ...]:
    """A group's member ranks from their `ranges` text: every rank's record of a group names the
    same members, so a job's thousands of records parse each text once."""
    return tuple(parse_ranges(text))


def describe_recent(record: Record | None, n: int = 3, pending: Call | None = None) -> str:
    """A rank's last ``n`` calls in a few words: "all_reduce #39, broadcast #40 (in progress)",
    each call outside the default group "0" followed by its group; "" when none is recorded.
    The call marked in progress is ``pending`` (`pending_calls`: the record's evidence that it
    has not completed), not every call the ring left "scheduled"."""
    if record is None:
        return ""
    parts = []
    for c in record.calls[-n:]:
        group = "" if c.group == "0" else f" of group {c.group}"
        mark = " (in progress)" if pending is not None and c == pending else ""
        parts.append(f"{c.op} #{c.seq}{group}{mark}")
    return ", ".join(parts)


def pending_calls(records: dict[int, Record]) -> dict[int, Call]:
    """Each rank's collective it waits in, in progress or queued, by its record and its
    peers'; ranks whose records show none (a rank in its own code) are left out. One pass over
    the records per group, so a job of thousands of ranks is placed in linear time.

    Call n of a group is pending on a rank that issued it when the record proves that it
    cannot have completed: the backend tracks completion and has not marked it
    (`Group.tracks_done`: gloo and NCCL), or a member of the group has not issued call n yet, or
    issued another call as number n (a mismatch: gloo and NCCL then wait until their
    timeout). Where none holds (a completed call, or a backend whose completion is not
    trusted with every member at the same call), None leaves the rank's place to its stack.
    The rank's Python frame does not matter: DDP's reducer issues its all-reduces from
    autograd's threads while the main thread sits in ``backward``.
    """
    low: dict[str, int] = {}  # group -> the fewest calls a member with a record issued
    for name in {n for rec in records.values() for n in rec.groups}:
        members = next(rec.groups[name].ranks for rec in records.values() if name in rec.groups)
        low[name] = min(records[m].groups[name].issued if name in records[m].groups else 0
                        for m in set(members) if m in records)  # fmt: skip
    kinds: dict[tuple[str, int], set[tuple[str, str]]] = {}
    for rec in records.values():
        for c in rec.calls:
            kinds.setdefault((c.group, c.seq), set()).add(c.kind)
    pending: dict[int, Call] = {}
    for rank, mine in records.items():
        for name in sorted(mine.groups, key=_group_order):
            group = mine.groups[name]
            n = group.issued
            if n <= 0:
                continue
            call = mine.call(name, n) or Call(name, n, "a collective", "", False)
            not_done = group.tracks_done and group.done < n
            behind = low[name] < n  # a member has not issued call n yet
            other = bool(kinds.get((name, n), set()) - {call.kind})  # another call as number n
            if not_done or behind or other:
                pending[rank] = call
                break
    return pending
    for name in sorted(mine.groups, key=_group_order):
        group = mine.groups[name]
        n = group.issued
        if n <= 0:
            continue
        call = mine.call(name, n) or Call(name, n, "a collective", "", False)
        peers = [rec for r, rec in records.items() if r != rank and r in group.ranks]
        not_done = group.tracks_done and group.done < n
        behind = any(rec.groups[name].issued < n if name in rec.groups else True for rec in peers)
        other = any((c := rec.call(name, n)) is not None and c.kind != call.kind for rec in peers)
        if not_done or behind or other:
            return call
    return None


@dataclass(frozen=True)
class Disagreement:
    """The first point where the ranks' collectives disagree: one line to print, the ranks
    that most likely caused it (the smaller side of a mismatch, or the ranks behind), and
    which: ``behind`` when they never reached the call the others wait in, else a mismatch
    (different calls at the same call number)."""

    line: str
    culprits: tuple[int, ...]
    behind: bool = False
    #: the op of the call the others made (a mismatch's larger side) or wait in (behind)
    against: str = ""


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
    return _waits(names, records, sites, died)


def _waits(
    names: list[str], records: dict[int, Record], sites: dict[int, str], died
) -> Disagreement | None:
    """The ranks the others wait for, following waits across groups.

    A rank in call n of a group (not marked completed there, or waiting inside a collective by
    its stack) waits for every member that has not issued call n: an edge of a wait-for graph
    (a rank that died on its own waits for nobody). The likely cause is then whoever is waited
    for and waits for nobody (the graph's sinks): a rank waiting in a pair group for a partner
    stuck in its own code is a link of the chain, not its cause. With no sink every waiting
    rank waits for another (the ranks made their calls in different orders across groups);
    then the ranks on the smaller side of every group's split are named."""
    waiting: set[int] = set()  # ranks with an edge out: they wait for somebody
    waited: set[int] = set()  # ranks with an edge in
    splits: list[tuple[str, set[int], set[int]]] = []  # group, ahead, behind
    for name in names:  # per group in one pass: r waits for the members below its call n
        group_ranks = next((rec.groups[name].ranks for rec in records.values()
                            if name in rec.groups), ())  # fmt: skip
        issued = {r: records[r].groups[name].issued if name in records[r].groups else 0
                  for r in set(group_ranks) if r in records}  # fmt: skip
        if not issued:
            continue
        low = min(issued.values())
        ahead = set()
        for r, n in issued.items():
            g = records[r].groups.get(name)
            if r in died or g is None or n <= low or not (g.done < n or r in sites):
                continue
            ahead.add(r)
        if ahead:
            front = max(issued[r] for r in ahead)
            behind = {m for m, k in issued.items() if k < front}
            waiting |= ahead
            waited |= behind
            splits.append((name, ahead, behind))
    if not waiting:
        return None
    sinks = sorted(waited - waiting)
    if sinks:
        for name in names:  # the line: a group where the ranks behind are sinks
            found = _behind(name, records, sites, died)
            if found is not None and set(found.culprits) <= set(sinks):
                return Disagreement(found.line, tuple(sinks), behind=True, against=found.against)
        found = next(filter(None, (_behind(n, records, sites, died) for n in names)), None)
        return Disagreement(found.line if found else "", tuple(sinks), behind=True,
                            against=found.against if found else "")  # fmt: skip
    # every waiting rank waits for another: name the smaller side of every split they are in
    smaller: dict[int, list[bool]] = {}
    for _, ahead, behind in splits:
        for side, other in ((ahead, behind), (behind, ahead)):
            for r in side:
                smaller.setdefault(r, []).append(len(side) < len(other))
    odd = tuple(sorted(r for r, seen in smaller.items() if all(seen)))
    parts = []
    for name, ahead, behind in splits:
        call = records[min(ahead)].call(name, records[min(ahead)].groups[name].issued)
        what = _call_text(call) if call else "a call"
        parts.append(f"{_ranks_word(sorted(ahead))} {'waits' if len(ahead) == 1 else 'wait'} "
                     f"at {what} of group {name} for {_ranks_word(sorted(behind))}")  # fmt: skip
    line = "; ".join(parts) + " (each waits for another: the ranks make their calls in different orders)"
    return Disagreement(line, odd, against="")


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
        return Disagreement(line, culprits, against=sides[0][0][0])
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
    # at the front and inside its call: not marked completed (gloo never marks an async
    # call, so that proves nothing either way, but the call cannot complete while a member
    # has not issued it), or waiting or died inside a collective by its stack or traceback
    # (a timed-out call counts as completed in torch's ring); a call marked completed with
    # no such place means the rank behind has a stale record
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
    return Disagreement(line, tuple(behind), behind=True, against=call.op if call else "")


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
    return line + " (torch's fingerprint check, TORCH_DISTRIBUTED_DEBUG=DETAIL)"


def _call_text(c: Call) -> str:
    group = " of its group" if c.group == "?" else ""
    return f"{c.op} #{c.seq}{group}" + (f" ({c.args})" if c.args else "")


def _site(ranks: list[int], sites: dict[int, str], records: dict[int, Record], call: Call) -> str:
    """Where the call was made, as " at train.py:13 in step", or "": the call site the record
    kept for it (the innermost frame of the user's code when the call was issued), else the
    place of the first of ``ranks`` that is (or died) inside a collective (``sites``) and
    whose latest call in the group is this one."""
    for r in ranks:
        mine = records[r].call(call.group, call.seq)
        if mine is not None and mine.at:
            return f" at {mine.at}"
    for r in ranks:
        last = records[r].last_in(call.group)
        if sites.get(r) and last is not None and last.seq == call.seq:
            return f" at {sites[r]}"
    return ""


def _ranks_word(ranks: list[int]) -> str:
    text = ranges(ranks, sep=", ")
    return f"rank {text}" if len(ranks) == 1 else f"ranks {text}"


def _group_order(name: str) -> tuple[int, str]:
    return (int(name), "") if name.isdigit() else (1 << 30, name)
