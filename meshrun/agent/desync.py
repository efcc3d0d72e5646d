"""``--desync-check``: meshrun's own check that every rank makes the same collectives.

**What it finds.** Every process group numbers its collectives; call number n must be the same
op with the same shapes and dtypes on every member (`meshrun.agent.collectives.Call.kind`).
Two kinds of desync follow:

- **a mismatch** (a reordered call, another op, another shape or dtype): some call #n differs
  between members. Named as soon as every member's call #n is known (or `COMPLETE_WAIT_S`
  after the first two disagree), live, while the job runs: "desync in group 0 at call #8:
  rank 2 called barrier() at t.py:12 in step, ranks 0-1 called all_reduce(float[1024]) at
  t.py:10 in step". The smaller side is the likely cause (none on a tie).
- **an offset** (a skipped call followed by identical ones, an extra call): every call #n
  agrees, but the members have issued different numbers of calls. While the ranks run, an
  offset of a call or two is normal (a rank that enters its collective first), so an offset
  is named only when it cannot heal: when the job hangs (``--hang-timeout``), or when a
  member has *finished* (exited 0) with fewer calls than another member made. "desync in
  group 0: rank 0 is 1 call behind: its last call was all_reduce #6 (float[4]) at t.py:9;
  rank 1 called all_reduce #7 (float[4]) at t.py:9". The minority is the likely cause; on a
  tie, the ranks behind (a skip and an extra call look the same with two ranks).

A desync stops the job as a failure of the likely-cause ranks, with the line above as their
message: the agent says it at once, the report's root cause is that rank, and the job exits 1,
what torch's own check (``TORCH_DISTRIBUTED_DEBUG=DETAIL``) gives under torchrun, where the
mismatched call raises a ``RuntimeError`` (exit 124 when it was found at a hang: a hang it is).
A restart of the budget is spent, as for any failure.

**Where the calls come from.** Not from a hook in the workers: from the collective record
(`meshrun.agent.collective_record`), which every worker already writes from torch's flight
recorder every `INTERVAL_S` (group, sequence number, op, shapes, dtypes, and the call site
where the record has one). So the check needs no change to the script, covers calls issued
from C++ that never pass through Python (torch DDP's bucket all-reduces, FSDP2's
all-gathers), adds nothing to a worker's collectives, and keeps the record's groups as the
script named them (torch's DETAIL check wraps every group in a checking one, whose helper
collectives and empty names the record cannot read). The agent reads its ranks' files every
`READ_EVERY_S` and keeps every call it saw in a `Ledger`, bounded to the last `KEEP_CALLS`
numbers per group, so ranks whose files were read at different moments are still compared
on the calls both made.

**Several nodes.** Each agent publishes a digest of its ranks' records
(`meshrun.agent.collectives.summary`, the last few calls and each group's count) to the
rendezvous store under ``r<round>/desync/<node rank>``: at most one write per node per
`PUBLISH_EVERY_S`, and only when it changed. Node rank 0 alone reads the others' digests,
one read per node per `PUBLISH_EVERY_S` (reads grow with the node count, not its square),
and decides for the job; a desync it finds is published as the likely-cause ranks' failures
and a restart request, which every node sees through the rendezvous as it sees any failure.

**What it does not catch.** A mismatch whose calls it never sees: a rank that dies in the
mismatched call before its record is written (gloo aborts at once on a size mismatch: "Is
there a distributed collective mismatch in your code?"; that failure is then the report's
root cause), calls that scroll out of the ring between two reads (more than the record's
32 calls in `INTERVAL_S`: only a one-off mismatch in a fast loop; a persistent one, or one
that stalls the ranks, is seen), point-to-point calls (not in the ring), and an offset in a
job that neither hangs under ``--hang-timeout`` nor ends. Between nodes it compares only
the digests' last calls. Arguments that may differ by design (``all_to_all`` splits,
``scatter``'s list) are not compared (`meshrun.agent.collectives.SAME_ARGS`).

The comparison (`Ledger`, `Finding`) is pure logic; `DesyncCheck` does the reading,
publishing and stopping.
"""

from __future__ import annotations

import json
import os
import time
from collections import Counter
from dataclasses import dataclass, field, replace
from pathlib import Path

from meshrun.agent.collective_record import RECORD_ENV, RECORD_FILE, ranges
from meshrun.agent.collectives import (
    Call,
    Record,
    from_summary,
    read_record,
    summary,
    wait_current,
)
from meshrun.agent.errors import WorkerFailure
from meshrun.agent.say import say
from meshrun.exits import EXIT_HUNG
from meshrun.rendezvous.protocol import job_prefix, round_key
from meshrun.rendezvous.restarts import Cause, Restart

#: Seconds between two reads of the local ranks' record files.
READ_EVERY_S = 0.25
#: Seconds between two digests published (and, on node rank 0, two reads of the others').
PUBLISH_EVERY_S = 1.0
#: Seconds a mismatch waits for the members whose call #n is not known yet.
COMPLETE_WAIT_S = 1.5
#: Seconds an offset behind a finished rank must last, its ranks ahead still running, before
#: it is named while the job runs (a rank that ends with ``os._exit`` skips its record's last
#: write, so its last call may be missing; the ranks ahead then go on, and it heals).
OFFSET_WAIT_S = 2.0
#: Call numbers kept per group in a `Ledger` (older ones are forgotten).
KEEP_CALLS = 512
#: The exit status of a desync found while the job runs (torch's check raises: exit 1).
EXIT_DESYNC = 1


# --- the comparison (pure) ---------------------------------------------------------------------


@dataclass(frozen=True)
class Finding:
    """A desync: the line to print, the likely-cause ranks (may be empty: a tie), and what.

    Attributes:
        line: "desync in group 0 at call #8: rank 2 called barrier(), ranks 0-1 called ...".
        culprits: global ranks, sorted.
        group: the process group's name; seq: the call number (for an offset: the call the
            ranks ahead made that the others did not).
        kind: "mismatch" or "offset".
        complete: every member's call is known (a mismatch); always True for an offset.
        ahead: for an offset, the ranks that made the most calls.
    """

    line: str
    culprits: tuple[int, ...]
    group: str
    seq: int
    kind: str
    complete: bool = True
    ahead: tuple[int, ...] = ()


@dataclass
class _GroupCalls:
    ranks: tuple[int, ...] = ()
    issued: dict[int, int] = field(default_factory=dict)  # rank -> calls issued so far
    epoch: dict[int, int] = field(default_factory=dict)  # rank -> times its group was made again
    calls: dict[tuple[int, int], dict[int, Call]] = field(default_factory=dict)
    # (epoch, seq) -> rank -> call


class Ledger:
    """Every call each rank was seen to make, per process group (the last `KEEP_CALLS`).

    Feed it records with `add` (a rank's record may be read many times: calls already seen
    are kept, new ones added); ask `mismatch` and `offset`. Ranks are global ranks.
    """

    def __init__(self, keep: int = KEEP_CALLS) -> None:
        self.keep = keep
        self._groups: dict[str, _GroupCalls] = {}
        self._conflicts: dict[tuple[str, int, int], float] = {}  # (group, epoch, seq) -> since

    def add(self, rank: int, record: Record | None, now: float = 0.0) -> None:
        """Take in ``rank``'s record (read at ``now``, a monotonic time, for `COMPLETE_WAIT_S`).
        A group whose count went down on a rank was made again under the same name (destroyed,
        then a new ``init_process_group``): that rank's calls from then on are compared only
        with the calls of members that made it again as often (an epoch per rank)."""
        if record is None:
            return
        for name, g in record.groups.items():
            calls = self._groups.setdefault(name, _GroupCalls())
            calls.ranks = g.ranks or calls.ranks
            if g.issued < calls.issued.get(rank, 0):
                calls.epoch[rank] = calls.epoch.get(rank, 0) + 1
            calls.issued[rank] = g.issued
        for c in record.calls:
            calls = self._groups.setdefault(c.group, _GroupCalls())
            epoch = calls.epoch.get(rank, 0)
            calls.issued[rank] = max(calls.issued.get(rank, 0), c.seq)
            by_rank = calls.calls.setdefault((epoch, c.seq), {})
            by_rank[rank] = c
            if len({x.kind for x in by_rank.values()}) > 1:
                self._conflicts.setdefault((c.group, epoch, c.seq), now)
        for name, calls in self._groups.items():
            if len(calls.calls) > self.keep:
                for key in sorted(calls.calls)[: len(calls.calls) - self.keep]:
                    del calls.calls[key]
                    self._conflicts.pop((name, *key), None)

    def mismatch(self, now: float = 0.0, wait: float = COMPLETE_WAIT_S) -> Finding | None:
        """The first call number, in the first group, where members made different calls; None
        when none, or when the members whose call is not known yet may still show within
        ``wait`` seconds of the disagreement first seen (then ``complete`` is False)."""
        order = sorted(self._conflicts.items(), key=lambda kv: _order(kv[0][0], kv[0][2]))
        for (name, epoch, seq), since in order:
            calls = self._groups[name]
            by_rank = calls.calls.get((epoch, seq), {})
            members = tuple(r for r in calls.ranks if calls.epoch.get(r, 0) == epoch)
            complete = all(r in by_rank for r in members)
            if not complete and now - since < wait:
                continue
            return _mismatch_finding(name, seq, by_rank, members, complete)
        return None

    def offset(self, among: set[int] | None = None, finished: set[int] | None = None
               ) -> Finding | None:
        """The first group whose members issued different numbers of calls, as a `Finding`,
        or None. ``among``: only these ranks are compared (None: all). ``finished``: ranks
        that exited 0; given, an offset counts only where some finished rank is behind a
        member that made more calls (a finished rank makes no more: the offset cannot heal).
        Only the members that made the group as often as the most are compared."""
        for name in sorted(self._groups, key=lambda n: _order(n, 0)):
            calls = self._groups[name]
            latest = max(calls.epoch.values(), default=0)
            issued = {r: n for r, n in calls.issued.items() if (among is None or r in among)
                      and calls.epoch.get(r, 0) == latest}  # fmt: skip
            if len(set(issued.values())) < 2:
                continue
            front = max(issued.values())
            behind = {r for r, n in issued.items() if n < front}
            if finished is not None and not (behind & finished):
                continue
            return _offset_finding(name, calls, issued, latest)
        return None

    def ranks(self) -> set[int]:
        """Every rank seen."""
        return {r for g in self._groups.values() for r in g.issued}


def _mismatch_finding(name: str, seq: int, by_rank: dict[int, Call], members: tuple[int, ...],
                      complete: bool) -> Finding:
    kinds = Counter(c.kind for c in by_rank.values())
    lowest = {k: min(r for r, c in by_rank.items() if c.kind == k) for k in kinds}
    # the smaller side first; on a tie, the side of the lowest rank
    sides = sorted(kinds.items(), key=lambda kv: (kv[1], lowest[kv[0]]))
    parts = []
    for kind, _ in sides:
        ranks = sorted(r for r, c in by_rank.items() if c.kind == kind)
        parts.append(f"{_ranks_word(ranks)} called {_call_text(by_rank, ranks)}")
    unknown = [r for r in members if r not in by_rank]
    if unknown:
        parts.append(f"{_ranks_word(unknown)}: call #{seq} not seen")
    culprits: tuple[int, ...] = ()
    if len(sides) > 1 and sides[0][1] < sides[1][1]:
        culprits = tuple(sorted(r for r, c in by_rank.items() if c.kind == sides[0][0]))
    line = f"desync in group {name} at call #{seq}: " + ", ".join(parts)
    return Finding(line, culprits, name, seq, "mismatch", complete)


def _offset_finding(name: str, calls: _GroupCalls, issued: dict[int, int], epoch: int
                    ) -> Finding:
    front = max(issued.values())
    ahead = sorted(r for r, n in issued.items() if n == front)
    behind = sorted(r for r, n in issued.items() if n < front)
    lag = {r: front - issued[r] for r in behind}
    if len(ahead) < len(behind):  # the minority made more calls
        culprits = tuple(ahead)
        most = max(lag.values())
        amount = str(most) if len(set(lag.values())) == 1 else f"up to {most}"
        head = (f"{_ranks_word(ahead)} made {amount} call{'s' if most > 1 else ''} more than "
                f"{_ranks_word(behind)}")
    else:
        culprits = tuple(behind)
        if len(set(lag.values())) == 1:
            n = lag[behind[0]]
            head = (f"{_ranks_word(behind)} {'is' if len(behind) == 1 else 'are'} {n} "
                    f"call{'s' if n > 1 else ''} behind")
        else:
            head = "ranks behind: " + ", ".join(
                f"rank {r} by {lag[r]} call{'s' if lag[r] > 1 else ''}" for r in behind)
    last = []
    for side in (behind, ahead):
        for n in sorted({issued[r] for r in side}):
            ranks = [r for r in side if issued[r] == n]
            by_rank = calls.calls.get((epoch, n), {})
            known = [r for r in ranks if r in by_rank]
            what = _call_text(by_rank, known, numbered=n) if known else (
                f"call #{n}" if n else "no call in this group")
            last.append(f"{_ranks_word(ranks)} last called {what}")
    line = f"desync in group {name}: {head}: " + "; ".join(last)
    return Finding(line, culprits, name, front, "offset", ahead=tuple(ahead))


def _call_text(by_rank: dict[int, Call], ranks: list[int], numbered: int | None = None) -> str:
    """"all_reduce(float[4]) at t.py:9 in step" (the first rank's call site that is known);
    with ``numbered``: "all_reduce #7 (float[4]) at ..."."""
    one = by_rank[ranks[0]]
    text = f"{one.op} #{numbered} ({one.args})" if numbered else f"{one.op}({one.args})"
    if numbered and not one.args:
        text = f"{one.op} #{numbered}"
    at = next((getattr(by_rank[r], "at", "") for r in ranks if getattr(by_rank[r], "at", "")), "")
    return text + (f" at {at}" if at else "")


def _ranks_word(ranks: list[int]) -> str:
    text = ranges(ranks, sep=", ")
    return f"rank {text}" if len(ranks) == 1 else f"ranks {text}"


def _order(name: str, seq: int) -> tuple[int, str, int]:
    return (int(name), "", seq) if name.isdigit() else (1 << 30, name, seq)


# --- the agent's side (I/O) --------------------------------------------------------------------


def desync_key(run_id: str, round: int, node_rank: int) -> str:
    """The store key of node ``node_rank``'s digest in round ``round``: ``r<T>/desync/<n>``
    (deleted with its round, `meshrun.rendezvous.protocol`)."""
    return round_key(job_prefix(run_id), round, "desync", node_rank)


class DesyncCheck:
    """``--desync-check`` in one agent, for one round at a time (see the module docstring).

    Args:
        host: this node's host name (the failure records say where each rank ran).
        emit: ``emit(kind, **fields)`` writes one event to the agent's event log.
    """

    def __init__(self, host: str, emit) -> None:
        self.host = host
        self._emit = emit
        if os.environ.get(RECORD_ENV) == "0":
            say("warning: --desync-check reads the collective record, which "
                "MESHRUN_COLLECTIVE_RECORD=0 turns off: the check sees no call")
        self.new_round()

    def new_round(self) -> None:
        """A new group starts: forget what the last one called."""
        self.ledger = Ledger()
        self._read_at = 0.0
        self._published_at = 0.0
        self._digest = b""
        self._version = 0
        self._where: dict[int, tuple[int, int, str, int]] = {}  # another node's rank ->
        # (local rank, pid, host, node rank), from its digest
        self._finished: set[int] = set()
        self._pids: dict[int, int] = {}
        self._raw: dict[int, bytes] = {}  # each local rank's record file as last read
        self._records: dict[int, Record] = {}  # ... and parsed
        self._offset_since: dict[tuple[str, int], float] = {}
        self._reported = False

    # -- reading -------------------------------------------------------------------------------
    def _read(self, group, now: float, force: bool = False) -> dict[int, Record]:
        """The local ranks' records, into the ledger (every `READ_EVERY_S`, or ``force``)."""
        if not force and now - self._read_at < READ_EVERY_S:
            return {}
        self._read_at = now
        records = {}
        self._pids = dict(zip((s.global_rank for s in group.specs), group.pids, strict=True))
        for spec, code, _ in group.outcomes():
            path = spec.log_dir / RECORD_FILE
            try:
                raw = path.read_bytes()
            except OSError:
                continue
            if raw != self._raw.get(spec.global_rank):  # parsed only when it changed
                self._raw[spec.global_rank] = raw
                record = read_record(path)
                if record is not None:
                    self._records[spec.global_rank] = record
                    self.ledger.add(spec.global_rank, record, now)
            if spec.global_rank in self._records:
                records[spec.global_rank] = self._records[spec.global_rank]
            if code == 0:
                self._finished.add(spec.global_rank)
        return records

    def _exchange(self, rdzv, info, group, records: dict[int, Record], now: float) -> None:
        """Publish this node's digest (multi-node), and on node rank 0 read the others'."""
        if info.num_nodes < 2 or now - self._published_at < PUBLISH_EVERY_S:
            return
        self._published_at = now
        local = {s.global_rank: s.local_rank for s, _, _ in group.outcomes()}
        digest = json.dumps({"ranks": {str(r): summary(rec) for r, rec in records.items()},
                             "finished": sorted(self._finished), "host": self.host,
                             "where": {str(r): [local[r], self._pids.get(r, 0)]
                                       for r in records}}, sort_keys=True).encode()
        store = rdzv.store
        if records and digest != self._digest:
            key = desync_key(rdzv.settings.run_id, info.round, info.node_rank)
            stored, current = store.compare_and_set(key, self._version, digest)
            if not stored and current is not None:  # a retried write, or a stale version
                stored, current = store.compare_and_set(key, current.version, digest)
            if stored and current is not None:
                self._version, self._digest = current.version, digest
        if info.node_rank != 0:
            return
        for n in range(1, info.num_nodes):
            item = store.get(desync_key(rdzv.settings.run_id, info.round, n))
            if item is None:
                continue
            try:
                data = json.loads(item.value)
                for r, s in data["ranks"].items():
                    self.ledger.add(int(r), from_summary(s), now)
                self._finished.update(int(r) for r in data.get("finished", []))
                for r, (local_rank, pid) in data.get("where", {}).items():
                    self._where[int(r)] = (int(local_rank), int(pid), str(data["host"]), n)
            except (ValueError, TypeError, KeyError, AttributeError):
                continue  # a bad digest: that node's ranks are left out this time

    # -- the three moments ---------------------------------------------------------------------
    def tick(self, rdzv, info, group, take_stacks, report) -> Restart | None:
        """Every monitor tick while the group runs: read, exchange, and stop the job on a
        mismatch, or on an offset behind a finished rank. Returns the restart, or None."""
        if group is None or self._reported:
            return None
        now = time.monotonic()
        records = self._read(group, now)
        if not records:
            return None
        self._exchange(rdzv, info, group, records, now)
        if info.num_nodes > 1 and info.node_rank != 0:
            return None  # node rank 0 decides for the job
        found = self.ledger.mismatch(now)
        if found is None and self._finished:
            found = self._lasting_offset(now)
        if found is None:
            return None
        return self.stop(rdzv, info, group, found, take_stacks(), report, EXIT_DESYNC)

    def _lasting_offset(self, now: float) -> Finding | None:
        """An offset behind a finished rank that lasted `OFFSET_WAIT_S` while some rank ahead
        still runs (a rank ahead that finished too: the job ended well as far as its
        collectives go)."""
        found = self.ledger.offset(finished=self._finished)
        if found is None or set(found.ahead) <= self._finished:
            self._offset_since.clear()
            return None
        since = self._offset_since.setdefault((found.group, found.seq), now)
        return found if now - since >= OFFSET_WAIT_S else None

    def at_hang(self, rdzv, info, group, places, report) -> Restart | None:
        """The job hung (``--hang-timeout``): a mismatch or an offset in the records is the
        cause. Returns the restart, or None (then the hang is reported as usual)."""
        if group is None or self._reported:
            return None
        now = time.monotonic()
        self._read(group, now, force=True)
        found = self.ledger.mismatch(now, wait=0.0) or self.ledger.offset()
        if found is None:
            return None
        return self.stop(rdzv, info, group, found, places, report, EXIT_HUNG)

    def at_failure(self, rdzv, info, group, result, take_stacks, report) -> Restart | None:
        """A worker failed: when the records show a mismatch, or an offset behind a rank that
        finished, that is the cause and the failure its consequence. Returns the restart, or
        None (then the failure is reported as usual)."""
        if group is None or self._reported:
            return None
        # the running ranks' last calls first (their threads write every INTERVAL_S)
        wait_current([s.log_dir / RECORD_FILE for s, _ in group.running()], time.time(),
                     abort=lambda: report.signals.stop_signal is not None)  # fmt: skip
        now = time.monotonic()
        self._read(group, now, force=True)
        found = self.ledger.mismatch(now, wait=0.0) or (
            self.ledger.offset(finished=self._finished) if self._finished else None)
        if found is None:
            return None
        failed = {f.global_rank: f for f in result.failures}
        return self.stop(rdzv, info, group, found, take_stacks(), report, EXIT_DESYNC, failed)

    # -- stopping ------------------------------------------------------------------------------
    def stop(self, rdzv, info, group, found: Finding, places: list[WorkerFailure], report,
             exit_status: int, failed: dict[int, WorkerFailure] | None = None) -> Restart:
        """Say ``found``, publish its likely-cause ranks (those of this node) as failures with
        it as their message, the other running ranks as stopped, and request a restart (a
        failure: one restart of the budget). ``places`` is every running local rank's place
        (`meshrun.agent.stack_requests.take_stacks`); ``failed`` the ranks that failed on
        their own meanwhile (published as they are).

        Raises:
            JobFailed: the job's restart budget is spent.
        """
        self._reported = True
        say(f"{found.line} (--desync-check)")
        blamed = set(found.culprits)
        now_ms = int(time.time() * 1000)
        records: list[WorkerFailure] = []
        placed = {f.global_rank: f for f in places}
        for (spec, code, _), pid in zip(group.outcomes(), group.pids, strict=True):
            rank = spec.global_rank
            f = (failed or {}).get(rank)
            if f is not None:
                records.append(replace(f, message=f.message or found.line) if rank in blamed
                               else f)  # fmt: skip
                continue
            base = placed.get(rank) or WorkerFailure(
                local_rank=spec.local_rank, global_rank=rank, pid=pid, exitcode=code or 0,
                timestamp_ms=_finished_ms(spec.log_dir / RECORD_FILE, now_ms), host=self.host,
                node_rank=spec.node_rank, stdout_path=str(spec.log_dir / "stdout.log"),
                stderr_path=str(spec.log_dir / "stderr.log"), stopped=True,
                calls=summary(read_record(spec.log_dir / RECORD_FILE)),
            )  # fmt: skip
            if rank in blamed:
                stamp = base.timestamp_ms if rank in placed else min(base.timestamp_ms, now_ms)
                records.append(replace(base, stopped=False, exitcode=exit_status,
                                       message=found.line, source="desync",
                                       timestamp_ms=stamp))  # fmt: skip
            elif rank in placed:
                records.append(base)
        mine = {s.global_rank for s in group.specs}
        theirs = []
        for rank in sorted(blamed - mine):  # on another node: its digest says where
            if rank in self._where:
                local_rank, pid, host, node_rank = self._where[rank]
                theirs.append(WorkerFailure(
                    local_rank=local_rank, global_rank=rank, pid=pid, exitcode=exit_status,
                    timestamp_ms=now_ms, host=host, node_rank=node_rank, message=found.line,
                    source="desync", stopped=False))  # fmt: skip
        if not theirs and not any(f.global_rank in blamed for f in records) and not failed:
            # the likely cause is on another node, or none (a tie): this node's running ranks
            # are the failures, each with the line, so the report says it
            records = [replace(f, stopped=False, exitcode=exit_status, message=found.line,
                               source="desync") for f in records]  # fmt: skip
        report.failed_round = True
        report.stacks_taken = True
        self._emit("desync", round=info.round, group=found.group, seq=found.seq,
                   what=found.kind, culprits=list(found.culprits), line=found.line)  # fmt: skip
        published = [report.record(f, info.node_rank) for f in records]
        published += [json.loads(f.capped().to_json()) for f in theirs]  # their own host
        if published:
            rdzv.publish_failures(published)
        who = f"rank {ranges(found.culprits, sep=', ')}" if found.culprits else "the ranks"
        return rdzv.request_restart(Restart(
            f"desync on {self.host}: {who} ({found.line})", Cause.FAILURE))


def _finished_ms(path: Path, default: int) -> int:
    """When a rank that exited wrote its record last (its exit), ms; ``default`` if unknown."""
    try:
        return int(os.stat(path).st_mtime * 1000)
    except OSError:
        return default
