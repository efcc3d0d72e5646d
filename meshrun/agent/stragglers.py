"""Straggler detection: the rank whose peers wait for it, from each rank's steps and waits.

The idea
    In a synchronous job (DDP, FSDP, TP, PP) the collectives tie the ranks together, so every
    rank's *step interval* is the same: the slowest rank sets it. What differs is how a step
    is spent. A rank's **busy time** per step is its step interval minus the time it spent
    waiting for its peers in collectives; a healthy rank computes, then waits for the others,
    while a straggler (a slow GPU, a throttled host, a noisy neighbour, a data loader that lags)
    is busy nearly all the time and its peers wait for it. So the straggler is the rank whose
    busy time stands out against the median of the other ranks' busy times. Step intervals
    alone cannot find it (they are equal); waiting times alone are ambiguous when several
    ranks are slow.

    Large-scale training reports do the same kind of comparison: ByteDance's MegaScale (Jiang
    et al., NSDI 2024) times each rank's computation and compares ranks to find the slow
    machines that hold a whole job back; Meta's Llama 3 report (2024, "Training infrastructure")
    describes tooling that finds stragglers among ranks stuck or slow in collectives. torch's
    NCCL flight recorder (``TORCH_NCCL_TRACE_BUFFER_SIZE``) records each rank's collectives for
    the hang case; meshrun's hang report (`meshrun.agent.hang`) covers that one.

The step interval
    Per local rank the agent samples, every monitor tick, ``heartbeats`` (a u64 the worker
    increments once per training step: ``meshrun.parallel.heartbeat()``, which any script can
    call). `StepTimes` turns consecutive samples into per-step intervals and keeps a median
    over a window of steps (robust to a single slow step: a checkpoint, a GC pause).
    Accuracy: a step is seen when a tick sees its heartbeat, so one interval is known to about
    one monitor interval; when several steps pass between ticks their average is exact, and
    the median over the window smooths the rest.

The time waiting, two sources
    1. **meshrun.parallel's counter** (``wait_ns``: a u64, total nanoseconds the rank spent
       blocked inside meshrun.parallel's collectives). Exact, on the rank's own clock; only
       meshrun.parallel's collectives fill it.
    2. **Arrival times in the collective record**, for every other script (torch's own
       ``DistributedDataParallel``, whose bucket all-reduces torch's C++ reducer issues;
       ``fully_shard``; plain ``dist.all_reduce``). Each rank's record (`meshrun.agent.
       collective_record`) has, per call, its process group, its sequence number in that group
       and the time the rank *issued* it (torch's flight recorder's ``time_created_ns``, wall
       clock). Every member issues call n of a group, and none gets past it before the last
       member issued it, so rank r waited at that call from its own issue to the last
       member's. This is the wait-state analysis of MPI performance tools: Scalasca's "Wait
       at N x N" (Geimer et al., "The Scalasca performance toolset architecture", 2010; Böhme
       et al., "Identifying the root causes of wait states in large-scale parallel
       applications", ICPP 2010) charges each process of a collective the time from its own
       arrival to the last one's. Calls issued while an earlier one's wait still runs (DDP's
       buckets, waited on together at the end of the backward) count only the time no earlier
       call covered; the calls of one step (``per_step``: calls issued per heartbeat, which
       the agent counts) add up, whether they wait in turn (FSDP2's all-gathers, each waited
       on before the next) or together; and the median over every run of ``per_step``
       consecutive calls is the rank's wait per step (`arrival_waits`), so a one-off pause (a
       checkpoint on one rank) is not a steady wait. The straggler is the last to arrive: it
       waits about 0, the others about its extra time. The busy time is then ``step interval
       - that wait`` (`with_arrival_waits`).

What it cannot tell
    - A rank that never calls ``heartbeat()`` has no step interval: it is not timed at all.
    - Arrivals compare wall clocks: on one host they share a clock; across hosts the
      comparison is as good as their clock sync (NTP: usually well under the 5 ms that counts,
      ``min_busy_s``; a host whose clock is off by more than a straggler's excess hides it or
      makes a false one). meshrun.parallel's counter has no such limit.
    - Steps must repeat: ``per_step`` is an average (calls per heartbeat since the round's
      first look), so a script whose steps issue different numbers of calls, or that beats
      at another rate than it steps, gets a blurred wait; until a step has passed it is taken
      as 1 (a median over single calls, which misses waits at one call of many).
    - A wait is known where every member's record has the call: a group one of whose members
      has no record (``MESHRUN_COLLECTIVE_RECORD=0``, ``TORCH_FR_BUFFER_SIZE=0``, a rank
      that is not a worker of this job) is not compared. Point-to-point calls are not in the
      record (pipeline stages' sends and receives).
    - The record is copied every half second and keeps the last 32 calls, so with many calls
      per step the window covers few steps (a run of ``per_step`` calls needs at least that
      many); on NCCL the host issues calls ahead of the device, so issue times show a slow
      host (data loading, Python), less so a slow GPU whose kernels run later than they were
      issued.
    - On gloo torch records no completion time, and none is used here.

Across nodes
    Each agent publishes its ranks' `StepTime`s and recent arrivals (`encode_step_times`),
    reads the others' (`decode_step_times`, `decode_arrivals`, which validate what a store
    returned), and the union over all global ranks goes to `Stragglers.check`. Node rank 0 (or
    the only node) is the one to say so.

Pure logic: no I/O, no clock of its own (times are passed in, seconds).
"""

from __future__ import annotations

import json
import math
import statistics
from collections import deque
from collections.abc import Mapping
from dataclasses import dataclass
from typing import NamedTuple

from meshrun.agent.collective_record import parse_ranges


class StepTime(NamedTuple):
    """One rank's recent steps: medians over `StepTimes`' window.

    Attributes:
        step_s: median step interval, seconds.
        busy_s: median busy time per step (the interval less the time waiting in collectives),
            seconds, in [0, step_s].
        steps: the rank's heartbeat count at its latest sample (how far it has got).
    """

    step_s: float
    busy_s: float
    steps: int


class StepTimes:
    """Per-rank step intervals and busy times from sampled progress counters.

    Args:
        window: how many recent steps the medians are taken over (>= 1).

    A rank's first sample (and a sample whose counters went back: a restarted worker) only
    sets its baseline; a sample without a new heartbeat changes nothing (the interval runs
    from the last sample that saw one). ``k`` heartbeats between two samples count as ``k``
    steps of the average interval.
    """

    def __init__(self, window: int = 8):
        if window < 1:
            raise ValueError(f"StepTimes: window must be >= 1 (got {window})")
        self.window = window
        self._last: dict[int, tuple[int, int, float]] = {}  # rank -> heartbeats, wait_ns, now
        self._steps: dict[int, deque[float]] = {}
        self._busy: dict[int, deque[float]] = {}

    def observe(self, rank: int, heartbeats: int, wait_ns: int, now: float) -> None:
        """One sample of ``rank``'s counters at ``now`` (monotonic seconds)."""
        last = self._last.get(rank)
        if last is None or heartbeats < last[0] or wait_ns < last[1] or now < last[2]:
            self._last[rank] = (heartbeats, wait_ns, now)
            self._steps[rank] = deque(maxlen=self.window)
            self._busy[rank] = deque(maxlen=self.window)
            return
        beats = heartbeats - last[0]
        if beats == 0:
            return
        interval = (now - last[2]) / beats
        busy = max(0.0, (now - last[2]) - (wait_ns - last[1]) / 1e9) / beats
        for _ in range(min(beats, self.window)):
            self._steps[rank].append(interval)
            self._busy[rank].append(min(busy, interval))
        self._last[rank] = (heartbeats, wait_ns, now)

    def counted(self, rank: int) -> bool:
        """Whether ``rank``'s wait counter (meshrun.parallel's collectives) has counted any
        wait: its busy times are measured, and arrivals are not needed for it."""
        last = self._last.get(rank)
        return last is not None and last[1] > 0

    def forget(self, rank: int | None = None) -> None:
        """Drop ``rank``'s history (None: every rank's), e.g. when a new round starts."""
        ranks = list(self._last) if rank is None else [rank]
        for r in ranks:
            self._last.pop(r, None)
            self._steps.pop(r, None)
            self._busy.pop(r, None)

    def step_times(self) -> dict[int, StepTime]:
        """Rank -> `StepTime`, for the ranks with at least one step measured."""
        return {
            r: StepTime(statistics.median(s), statistics.median(self._busy[r]), self._last[r][0])
            for r, s in self._steps.items()
            if s
        }


@dataclass(frozen=True)
class Straggler:
    """A rank whose busy time per step stood out for ``steps`` steps.

    Attributes:
        rank: global rank.
        step_s: its median step interval, seconds (about everyone's: they wait for it).
        busy_s: its median busy time per step, seconds.
        median_s: the median of the other ranks' busy times per step, seconds.
        steps: for how many consecutive steps it has been slow.
    """

    rank: int
    step_s: float
    busy_s: float
    median_s: float
    steps: int

    def describe(self) -> str:
        """One line, e.g. ``rank 3 is a straggler: busy 120.0 ms of each 150.0 ms step, the
        other ranks' median 30.0 ms, for 6 steps; the others wait for it``."""
        return (
            f"rank {self.rank} is a straggler: busy {self.busy_s * 1e3:.1f} ms of each "
            f"{self.step_s * 1e3:.1f} ms step, the other ranks' median "
            f"{self.median_s * 1e3:.1f} ms, for {self.steps} steps; the others wait for it"
        )


class Stragglers:
    """Says which ranks are stragglers, once each, from successive `StepTime` snapshots.

    A rank is *slow* in a snapshot when its busy time exceeds ``factor`` times the median busy
    time of the other ranks, and by more than ``min_busy_s`` (tiny steps are noise). A rank
    slow for ``min_steps`` consecutive steps (counted by its heartbeats, from the first
    snapshot that found it slow) is reported once; it is reported again only after a snapshot
    found it not slow (it recovered) and it has been slow for ``min_steps`` steps anew.

    Args:
        factor: how many times the others' median busy time counts as slow (> 1).
        min_steps: consecutive slow steps before a rank is reported (>= 1).
        min_busy_s: the least excess busy time over the median that counts, seconds.
    """

    def __init__(self, factor: float = 1.5, min_steps: int = 5, min_busy_s: float = 0.005):
        if not factor > 1.0:
            raise ValueError(f"Stragglers: factor must be > 1 (got {factor})")
        if min_steps < 1:
            raise ValueError(f"Stragglers: min_steps must be >= 1 (got {min_steps})")
        self.factor = factor
        self.min_steps = min_steps
        self.min_busy_s = min_busy_s
        self._slow_since: dict[int, int] = {}  # rank -> heartbeat count when first seen slow
        self._reported: set[int] = set()

    def check(self, step_times: Mapping[int, StepTime]) -> list[Straggler]:
        """The ranks to report now (newly slow for ``min_steps`` steps), by rank.

        Args:
            step_times: global rank -> `StepTime`, over every rank of the job (or of the
                node, for a node-local check). Needs two ranks or more; ranks missing from
                it are forgotten.
        """
        for rank in set(self._slow_since) - set(step_times):
            del self._slow_since[rank]
        self._reported &= set(step_times)
        found = []
        for rank, st in sorted(step_times.items()):
            others = [o.busy_s for r, o in step_times.items() if r != rank]
            if not others:
                continue
            median = statistics.median(others)
            slow = st.busy_s > self.factor * median and st.busy_s - median > self.min_busy_s
            if not slow:
                self._slow_since.pop(rank, None)
                self._reported.discard(rank)
                continue
            since = self._slow_since.setdefault(rank, st.steps)
            steps = st.steps - since + 1
            if steps >= self.min_steps and rank not in self._reported:
                self._reported.add(rank)
                found.append(Straggler(rank, st.step_s, st.busy_s, median, steps))
        return found

    def reset(self) -> None:
        """Forget every rank (a new round: ranks are renumbered, workers restarted)."""
        self._slow_since.clear()
        self._reported.clear()


#: Calls of each rank's record that `arrivals_from_record` keeps (and a node publishes): all
#: that the record file holds (`meshrun.agent.collective_record` ``FILE_CALLS``).
ARRIVAL_CALLS = 32
#: The fewest calls every member recorded before `arrival_waits` gives a rank a wait.
MIN_ARRIVAL_CALLS = 3


@dataclass(frozen=True)
class Arrivals:
    """When one rank issued its recent collectives (from its collective record).

    Attributes:
        groups: process group name -> its member ranks (global ranks).
        calls: (group name, sequence number in the group) -> the time the rank issued the
            call, seconds (wall clock: torch's flight recorder's ``time_created_ns``).
        issued: the calls the rank had issued in all, over its groups (the record's last
            sequence numbers), for `per_step`.
        per_step: collectives per step (per heartbeat), 0 where not known yet.
    """

    groups: Mapping[str, tuple[int, ...]]
    calls: Mapping[tuple[str, int], float]
    issued: int = 0
    per_step: float = 0.0


def arrivals_from_record(raw: object, last: int = ARRIVAL_CALLS) -> Arrivals | None:
    """The `Arrivals` in a collective record file's JSON (`meshrun.agent.collective_record`
    `make_record`: ``{"groups": {name: {"ranks": "0-3", "issued": n, ...}}, "calls":
    [{"group", "seq", "issued_ms", ...}, ...]}``), its ``last`` calls; None when it is not that
    shape or has no call with an issue time."""
    try:
        groups = {str(n): tuple(parse_ranges(str(g["ranks"]))) for n, g in raw["groups"].items()}
        issued = sum(max(0, int(g.get("issued", 0))) for g in raw["groups"].values())
        calls = {}
        for c in raw["calls"][-last:] if last > 0 else []:
            when = c["issued_ms"]
            if isinstance(when, int) and not isinstance(when, bool) and when > 0:
                calls[(str(c["group"]), int(c["seq"]))] = when / 1000.0
    except (TypeError, KeyError, ValueError, AttributeError):
        return None
    return Arrivals(groups, calls, issued) if calls else None


def arrival_waits(arrivals: Mapping[int, Arrivals]) -> dict[int, float]:
    """Rank -> the time it waited for late peers per step, seconds, from the calls that every
    member of their group has in ``arrivals`` (at least `MIN_ARRIVAL_CALLS`).

    At each call rank r waits from its own issue to the last member's (the interval
    ``[issued_r, last]``). Calls issued while an earlier call's wait still runs (DDP's bucket
    all-reduces, issued one after another and waited on together) overlap it, so each call
    counts only the part of its interval that no earlier call of the rank covered (the
    union of the intervals, call by call). A step of ``per_step`` calls then waits the sum
    over its calls; the result is the median of that sum over every run of ``per_step``
    consecutive calls (round ``per_step``, 1 when unknown): each such run holds one step's
    calls, whatever the step's first call is, and a one-off pause (a checkpoint on one rank)
    is in a few runs only, so it does not make a straggler. A group some member of which has
    no `Arrivals` here is left out (its last arrival is not known).

    Args:
        arrivals: global rank -> its `Arrivals` (every rank of the job that has a record).
    """
    spans: dict[int, list[tuple[float, float]]] = {}
    names = {name for a in arrivals.values() for name in a.groups}
    for name in sorted(names):
        members = next(a.groups[name] for a in arrivals.values() if name in a.groups)
        if len(members) < 2 or any(r not in arrivals for r in members):
            continue
        seqs = None
        for r in members:
            mine = {seq for (g, seq) in arrivals[r].calls if g == name}
            seqs = mine if seqs is None else seqs & mine
        for seq in sorted(seqs or ()):
            issued = {r: arrivals[r].calls[(name, seq)] for r in members}
            last_in = max(issued.values())
            for r, t in issued.items():
                spans.setdefault(r, []).append((t, last_in))
    out = {}
    for r, intervals in spans.items():
        if len(intervals) < MIN_ARRIVAL_CALLS:
            continue
        own: list[float] = []
        covered = -math.inf
        for start, end in sorted(intervals):
            own.append(max(0.0, end - max(start, covered)))
            covered = max(covered, end)
        per_step = max(1, min(len(own), round(arrivals[r].per_step or 1)))
        runs = [sum(own[i : i + per_step]) for i in range(len(own) - per_step + 1)]
        out[r] = statistics.median(runs)
    return out


def with_arrival_waits(
    step_times: Mapping[int, StepTime], waits: Mapping[int, float]
) -> dict[int, StepTime]:
    """``step_times`` with the busy time of each rank in ``waits`` (`arrival_waits`) set to
    its step interval less that wait (within [0, step_s]); the other ranks as they are."""
    out = dict(step_times)
    for rank, wait in waits.items():
        st = out.get(rank)
        if st is not None:
            out[rank] = StepTime(st.step_s, min(st.step_s, max(0.0, st.step_s - wait)), st.steps)
    return out


def encode_step_times(
    step_times: Mapping[int, StepTime], arrivals: Mapping[int, Arrivals] | None = None
) -> str:
    """``step_times`` as JSON for the store: ``{"<rank>": [step_s, busy_s, steps], ...}``,
    and with ``arrivals`` a key ``"calls"``: ``{"<rank>": {"g": {name: [ranks]}, "c":
    [[name, seq, issued_ms], ...], "s": per_step}}`` (what `decode_arrivals` reads)."""
    out: dict = {str(r): [st.step_s, st.busy_s, st.steps] for r, st in step_times.items()}
    if arrivals:
        out["calls"] = {
            str(r): {"g": {n: list(m) for n, m in a.groups.items()},
                     "c": [[g, seq, round(t * 1000)] for (g, seq), t in a.calls.items()],
                     "s": a.per_step}
            for r, a in arrivals.items()
        }  # fmt: skip
    return json.dumps(out)


def decode_arrivals(text: str | bytes) -> dict[int, Arrivals]:
    """The ``"calls"`` part of an `encode_step_times` value ({} when it has none).

    Raises:
        ValueError: not JSON, or a rank, group or call that is not of that shape.
    """
    try:
        raw = json.loads(text)
    except (ValueError, UnicodeDecodeError) as e:
        raise ValueError(f"step times: not JSON ({e})") from None
    calls = raw.get("calls", {}) if isinstance(raw, dict) else None
    if not isinstance(calls, dict):
        raise ValueError('step times: expected an object with "calls" of rank -> arrivals')
    out = {}
    for key, value in calls.items():
        try:
            if not (isinstance(key, str) and key.isdigit()):
                raise TypeError
            groups = {}
            for name, members in value["g"].items():
                if not all(isinstance(m, int) and not isinstance(m, bool) and m >= 0
                           for m in members):  # fmt: skip
                    raise TypeError
                groups[str(name)] = tuple(members)
            issued = {}
            for g, seq, ms in value["c"]:
                if not (isinstance(seq, int) and isinstance(ms, int) and seq >= 0 and ms > 0):
                    raise TypeError
                issued[(str(g), seq)] = ms / 1000.0
            per_step = value.get("s", 0.0)
            if not (isinstance(per_step, (int, float)) and not isinstance(per_step, bool)
                    and math.isfinite(per_step) and 0 <= per_step <= 1e6):  # fmt: skip
                raise TypeError
        except (TypeError, KeyError, ValueError, AttributeError):
            raise ValueError(f"step times: rank {key}: bad arrivals") from None
        out[int(key)] = Arrivals(groups, issued, per_step=float(per_step))
    return out


def decode_step_times(text: str | bytes) -> dict[int, StepTime]:
    """The inverse of `encode_step_times` without its arrivals, validated (a value read from
    a store).

    Raises:
        ValueError: not that JSON shape, a negative rank or count, or a time that is negative,
            not finite, or a busy time above its step time.
    """
    try:
        raw = json.loads(text)
    except (ValueError, UnicodeDecodeError) as e:
        raise ValueError(f"step times: not JSON ({e})") from None
    if not isinstance(raw, dict):
        raise ValueError("step times: expected an object of rank -> [step_s, busy_s, steps]")
    out = {}
    for key, value in raw.items():
        if key == "calls":
            continue  # the arrivals: `decode_arrivals`
        if not (isinstance(key, str) and key.isdigit()):
            raise ValueError(f"step times: bad rank {key!r}")
        if not (isinstance(value, list) and len(value) == 3):
            raise ValueError(f"step times: rank {key}: expected [step_s, busy_s, steps]")
        step_s, busy_s, steps = value
        times_ok = all(
            isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x) and x >= 0
            for x in (step_s, busy_s)
        )
        if not times_ok or busy_s > step_s or not isinstance(steps, int) or steps < 0:
            raise ValueError(f"step times: rank {key}: bad value {value!r}")
        out[int(key)] = StepTime(float(step_s), float(busy_s), steps)
    return out
