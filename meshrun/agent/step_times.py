"""The agent's side of straggler detection: sample each rank's step times, publish, warn.

Every monitor tick the agent samples its ranks' progress counters (`meshrun.agent.hang`'s
`ProgressWatch`: heartbeats and time blocked in meshrun.parallel's collectives) into
`StepTimes`. Every `publish_interval` (`STEP_TIMES_EVERY_S`, longer past
`STEP_TIMES_NODES_PER_S` x that many nodes) it reads, for each rank whose waits no counter
measured (a torch-DDP or FSDP script that calls ``heartbeat()``), the arrivals of its recent
collectives from its collective record (`meshrun.agent.collectives`' file); a node of a
multi-node job publishes both to the store (``meshrun status`` shows the step times), and node
rank 0 checks the whole job's for stragglers; a one-node job checks its own. Each straggler is
one warning line and a ``straggler`` event. The rule itself is pure logic in
`meshrun.agent.stragglers`.

Store traffic: one write per node per interval (its own key; the version it wrote is kept,
so no read first), and on node rank 0 one read per node; the interval grows with the node
count so the job's store sees at most about `STEP_TIMES_NODES_PER_S` publications a second
(1024 nodes: every 64 s), whatever the size.
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path

from meshrun.agent.collectives import RECORD_ENV, RECORD_FILE
from meshrun.agent.hang import ProgressWatch
from meshrun.agent.say import say
from meshrun.agent.stragglers import (
    Arrivals,
    StepTimes,
    Stragglers,
    arrival_waits,
    arrivals_from_record,
    decode_arrivals,
    decode_step_times,
    encode_step_times,
    with_arrival_waits,
)
from meshrun.agent.workers import WorkerGroup
from meshrun.rendezvous import RendezvousInfo

#: Seconds between two publications of a node's step times (and straggler checks), for jobs
#: of up to ``STEP_TIMES_EVERY_S * STEP_TIMES_NODES_PER_S`` nodes (`publish_interval`).
STEP_TIMES_EVERY_S = 2.0
#: Publications of step times a second that the whole job sends its store, at most.
STEP_TIMES_NODES_PER_S = 16.0


def publish_interval(num_nodes: int) -> float:
    """Seconds between two publications of one node's step times in a job of ``num_nodes``
    nodes: `STEP_TIMES_EVERY_S`, or ``num_nodes / STEP_TIMES_NODES_PER_S`` where that is
    longer (so the store's load from step times does not grow with the job)."""
    return max(STEP_TIMES_EVERY_S, num_nodes / STEP_TIMES_NODES_PER_S)


def read_arrivals(log_dir: Path) -> Arrivals | None:
    """The recent arrivals in the collective record of the rank logging to ``log_dir``
    (`meshrun.agent.stragglers.arrivals_from_record`); None when there is none, or it cannot
    be read or parsed."""
    try:
        return arrivals_from_record(json.loads((log_dir / RECORD_FILE).read_text()))
    except (OSError, ValueError):
        return None


class StepWatch:
    """Step times of this node's ranks over one round, and the job's stragglers.

    Args:
        host: this node's host name (the warning says where a straggler runs).
        emit: ``emit(kind, **fields)`` writes one event to the agent's event log.
    """

    def __init__(self, host: str, emit: Callable[..., None]):
        self.host = host
        self._emit = emit
        self._steps = StepTimes()
        self._stragglers = Stragglers()
        self._published_at = 0.0  # monotonic time this node last published its step times
        self._calls_base: dict[int, tuple[int, int]] = {}  # rank -> (heartbeats, calls issued)

    def new_round(self) -> None:
        """Forget the last round's times (the ranks and their speeds may have changed)."""
        self._steps.forget()
        self._stragglers.reset()
        self._calls_base.clear()

    def tick(
        self, rdzv, info: RendezvousInfo, group: WorkerGroup | None, watch: ProgressWatch | None
    ) -> None:
        """Sample ``group``'s counters from ``watch``; every `publish_interval`, publish them
        with the ranks' arrivals to ``rdzv`` (multi-node) and, on node rank 0 or alone, warn
        of stragglers."""
        if watch is None or group is None:
            return
        now = time.monotonic()
        for spec in group.specs:
            p = watch.sample(spec.local_rank)
            if p.heartbeats:
                self._steps.observe(spec.global_rank, p.heartbeats, p.blocked_ns, now)
        if now - self._published_at < publish_interval(info.num_nodes):
            return
        mine = self._steps.step_times()
        if not mine:
            return  # nothing to publish yet: the first times go out as soon as there are some
        self._published_at = now
        calls = {}
        if os.environ.get(RECORD_ENV) != "0":
            for spec in group.specs:
                r = spec.global_rank
                if r in mine and not self._steps.counted(r):
                    if (a := read_arrivals(spec.log_dir)) is not None:
                        calls[r] = self._with_per_step(r, a, mine[r].steps)
        merged, arrivals = dict(mine), dict(calls)
        if info.num_nodes > 1:
            rdzv.publish_step_times(encode_step_times(mine, calls).encode())
            if info.node_rank != 0:
                return
            for value in rdzv.step_times():
                try:
                    times, theirs = decode_step_times(value), decode_arrivals(value)
                except ValueError:
                    continue  # a bad value from the store: that node's times are left out
                merged.update(times)
                arrivals.update(theirs)
            merged.update(mine)
            arrivals.update(calls)
        merged = with_arrival_waits(merged, arrival_waits(arrivals))
        for s in self._stragglers.check(merged):
            say(f"warning: {s.describe()} (rank {s.rank} is on {self._host_of(s.rank, info)})")
            self._emit("straggler", round=info.round, rank=s.rank, step_s=s.step_s,
                       busy_s=s.busy_s, median_s=s.median_s, steps=s.steps)  # fmt: skip

    def _with_per_step(self, rank: int, a: Arrivals, beats: int) -> Arrivals:
        """``a`` with its collectives per step: the calls issued per heartbeat since this
        round's first look at the rank's record (0 until a step has passed since)."""
        base = self._calls_base.get(rank)
        if base is None or beats < base[0] or a.issued < base[1]:  # first look, or restarted
            self._calls_base[rank] = base = (beats, a.issued)
        if beats == base[0]:
            return a
        return replace(a, per_step=(a.issued - base[1]) / (beats - base[0]))

    def _host_of(self, rank: int, info: RendezvousInfo) -> str:
        lo, hi = info.rank_offset, info.rank_offset + info.local_world_size
        return self.host if lo <= rank < hi else "another node"
