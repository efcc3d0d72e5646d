"""The agent's side of straggler detection: sample each rank's step times, publish, warn.

Every monitor tick the agent samples its ranks' progress counters (`meshrun.agent.hang`'s
`ProgressWatch`: heartbeats and time blocked in collectives) into `StepTimes`. Every
`STEP_TIMES_EVERY_S` a node of a multi-node job publishes its ranks' step times to the store
(``meshrun status`` shows them), and node rank 0 checks the whole job's for stragglers; a
one-node job checks its own. Each straggler is one warning line and a ``straggler`` event.
The rule itself is pure logic in `meshrun.agent.stragglers`.
"""

from __future__ import annotations

import time
from collections.abc import Callable

from meshrun.agent.hang import ProgressWatch
from meshrun.agent.say import say
from meshrun.agent.stragglers import StepTimes, Stragglers, decode_step_times, encode_step_times
from meshrun.agent.workers import WorkerGroup
from meshrun.rendezvous import RendezvousInfo

#: Seconds between two publications of a node's step times (and straggler checks).
STEP_TIMES_EVERY_S = 2.0


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

    def new_round(self) -> None:
        """Forget the last round's times (the ranks and their speeds may have changed)."""
        self._steps.forget()
        self._stragglers.reset()

    def tick(
        self, rdzv, info: RendezvousInfo, group: WorkerGroup | None, watch: ProgressWatch | None
    ) -> None:
        """Sample ``group``'s counters from ``watch``; every `STEP_TIMES_EVERY_S`, publish
        them to ``rdzv`` (multi-node) and, on node rank 0 or alone, warn of stragglers."""
        if watch is None or group is None:
            return
        now = time.monotonic()
        for spec in group.specs:
            p = watch.sample(spec.local_rank)
            if p.heartbeats:
                self._steps.observe(spec.global_rank, p.heartbeats, p.blocked_ns, now)
        if now - self._published_at < STEP_TIMES_EVERY_S:
            return
        self._published_at = now
        mine = self._steps.step_times()
        if not mine:
            return
        merged = dict(mine)
        if info.num_nodes > 1:
            rdzv.publish_step_times(encode_step_times(mine).encode())
            if info.node_rank != 0:
                return
            for value in rdzv.step_times():
                try:
                    merged.update(decode_step_times(value))
                except ValueError:
                    continue  # a bad value from the store: that node's times are left out
            merged.update(mine)
        for s in self._stragglers.check(merged):
            say(f"warning: {s.describe()} (rank {s.rank} is on {self._host_of(s.rank, info)})")
            self._emit("straggler", round=info.round, rank=s.rank, step_s=s.step_s,
                       busy_s=s.busy_s, median_s=s.median_s, steps=s.steps)  # fmt: skip

    def _host_of(self, rank: int, info: RendezvousInfo) -> str:
        lo, hi = info.rank_offset, info.rank_offset + info.local_world_size
        return self.host if lo <= rank < hi else "another node"
