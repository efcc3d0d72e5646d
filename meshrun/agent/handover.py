"""In-place recovery, the agent's side: hand the running workers a new round (docs/design.md
§3.8).

On a membership change (a node lost, nodes waiting to join) whose every local worker opted in
(`meshrun.in_place`: the worker runs `meshrun.parallel.elastic`), the agent completes the next
round without stopping them, writes each its new environment (`offer`), and waits up to
`timeout` seconds for each to confirm (`await_confirmations`). A worker that does not confirm
in time, or exits meanwhile, gets the usual treatment within the new round: the whole local
group is stopped and started again there, with nothing spent. The run loop
(`meshrun.agent.agent.Agent`) does the round's part; this module the workers'.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable

from meshrun import in_place
from meshrun.agent.workers import WorkerGroup, WorkerSpec
from meshrun.rendezvous.restarts import Restart

#: Seconds a worker that opted in to in-place recovery has to confirm a new round
#: (``MESHRUN_IN_PLACE_TIMEOUT`` in the agent's environment overrides it).
IN_PLACE_TIMEOUT_S = 10.0


def timeout() -> float:
    """The seconds each worker has to confirm: ``MESHRUN_IN_PLACE_TIMEOUT`` when it is a
    positive number, else `IN_PLACE_TIMEOUT_S`."""
    raw = os.environ.get("MESHRUN_IN_PLACE_TIMEOUT", "")
    try:
        value = float(raw)
    except ValueError:
        return IN_PLACE_TIMEOUT_S
    return value if value > 0 else IN_PLACE_TIMEOUT_S


def eligible(group: WorkerGroup | None, reason: Restart) -> bool:
    """Whether ``group`` can take the round after ``reason`` in place: a membership change
    (never a failure or a hang), and every worker still running and opted in."""
    if group is None or not getattr(reason, "cause", None) or not reason.cause.membership_change:
        return False
    running = group.running()
    return len(running) == len(group.specs) and all(
        in_place.opted_in(spec.log_dir, pid) for spec, pid in running
    )


def offer(specs: list[WorkerSpec], round: int, seconds: float) -> str | None:
    """Write each worker its offer of ``round`` (the spec's new environment), ``seconds`` to
    confirm; None when written, else why not (a full log disk: the workers cannot be told)."""
    try:
        for spec in specs:
            in_place.make_offer(spec.log_dir, round, dict(spec.env), seconds)
    except OSError as e:
        return f"the offer could not be written: {e.strerror or e}"
    return None


def await_confirmations(
    group: WorkerGroup,
    round: int,
    workers: list[tuple[WorkerSpec, int]],
    seconds: float,
    tick: float,
    raise_if_stopped: Callable[[], None],
) -> str | None:
    """Wait up to ``seconds`` for each of ``workers`` (spec, pid) of ``group`` to confirm
    ``round``, looking every ``tick`` seconds (at most 0.05); None when all did, else why not
    (a worker exited; the ranks that did not confirm). ``raise_if_stopped`` raises on a
    handled signal."""
    deadline = time.monotonic() + seconds
    while True:
        workers = [(s, p) for s, p in workers if not in_place.confirmed(s.log_dir, round, p)]
        if group.wait(0) is not None:
            return "a worker exited"
        if not workers:
            return None
        if time.monotonic() >= deadline:
            late = ", ".join(str(s.global_rank) for s, _ in workers)
            return f"rank(s) {late} did not confirm within {seconds:g} s"
        group.wait(min(tick, 0.05))
        raise_if_stopped()
