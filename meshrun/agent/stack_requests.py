"""Where each local rank is: its stack and its place, taken while the job runs or stops.

Three callers want the same picture of the running group: a hang (``--hang-timeout``: the
culprit rule needs every rank's place), a fault (the stopped-rank list of the failure report,
taken just before the stop), and a ``meshrun stacks`` request that a user wrote into the
store (`StackRequests`; the job goes on). `take_stacks` takes every running worker's stack at
once (faulthandler, else py-spy: `meshrun.agent.stacks.collect_stacks`, at most
`STACKS_TIMEOUT_S` in all), waits for each rank's collective record to be current, and places
each rank (`meshrun.agent.stacks.classify`: waiting in a collective, running outside any, or
unknown) as a ``stopped`` `WorkerFailure` record.
"""

from __future__ import annotations

import json
import os
import signal
import time
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path

from meshrun.agent.collectives import RECORD_ENV, RECORD_FILE, read_record, summary, wait_current
from meshrun.agent.errors import WorkerFailure
from meshrun.agent.hang import ProgressWatch, progress_env
from meshrun.agent.stacks import (
    STACKS_TIMEOUT_S,
    Target,
    classify,
    collect_stacks,
    traceback_frames,
)
from meshrun.agent.verdicts import Place
from meshrun.agent.workers import WorkerGroup

__all__ = ["STACKS_POLL_S", "STACKS_TIMEOUT_S", "StackRequests", "placed_by_last_words",
           "take_stacks"]  # fmt: skip

#: Seconds between two looks for a ``meshrun stacks`` request (one store read each).
STACKS_POLL_S = 1.0


def take_stacks(
    group: WorkerGroup | None, watch: ProgressWatch | None, host: str, abort: Callable[[], bool]
) -> list[WorkerFailure]:
    """Where each running worker of ``group`` is: its stack (all at once, at most
    `STACKS_TIMEOUT_S` in all), classified (`meshrun.agent.stacks.classify`) with its
    progress counters from ``watch``, as a ``stopped`` record per rank on ``host``. [] when
    none runs. ``abort()`` true (a handled signal) cuts the waits short."""
    if group is None:
        return []
    running = group.running()
    targets = [
        Target(
            key=spec.local_rank,
            pid=pid,
            stack_file=Path(progress_env(spec.log_dir)["MESHRUN_STACK_FILE"]),
            save_to=spec.log_dir / "stack-py-spy.txt",
        )
        for spec, pid in running
    ]
    since = time.time()
    stacks = collect_stacks(targets, abort=abort)
    if os.environ.get(RECORD_ENV) != "0":
        wait_current([spec.log_dir / RECORD_FILE for spec, _ in running], since, abort=abort)
    records = []
    for spec, pid in running:
        stack = stacks[spec.local_rank]
        progress = watch.sample(spec.local_rank) if watch is not None else None
        where = classify(stack.main, progress.blocked if progress else None)
        records.append(WorkerFailure(
            local_rank=spec.local_rank,
            global_rank=spec.global_rank,
            pid=pid,
            exitcode=-signal.SIGTERM,
            timestamp_ms=int(time.time() * 1000),
            host=host,
            node_rank=spec.node_rank,
            traceback=stack.text,
            source="stack",
            stdout_path=str(spec.log_dir / "stdout.log"),
            stderr_path=str(spec.log_dir / "stderr.log"),
            stopped=True,
            state=where.state,
            collective=where.collective,
            at=where.at,
            collectives=_comparable_count(progress, stack.main),
            stack_path=stack.path,
            stack_problem=stack.problem,
            calls=summary(read_record(spec.log_dir / RECORD_FILE)),
        ))  # fmt: skip
    return records


def placed_by_last_words(f: WorkerFailure, stderr_tail: str) -> WorkerFailure:
    """A stopped rank whose stack did not place it (none taken, or no main thread in it: it
    was exiting) but whose last stderr lines (``stderr_tail``) are a Python traceback (it was
    raising when the stop came: its own gloo timeout, torch's desync check) is placed by that
    traceback instead; any other record is returned as it is."""
    if f.state not in (Place.UNKNOWN, ""):
        return f
    if "Traceback (most recent call last)" not in stderr_tail:
        return f
    where = classify(traceback_frames(stderr_tail))
    if where.state == Place.UNKNOWN:
        return f
    return replace(f, traceback=stderr_tail, source="stderr", state=where.state,
                   collective=where.collective, at=where.at,
                   stack_problem="; ".join(filter(None, [f.stack_problem, "placed by its "
                                                         "last stderr lines"])))  # fmt: skip


class StackRequests:
    """Answers ``meshrun stacks`` requests found in the store (multi-node jobs: a one-node
    job's store is in the agent's process, and ``meshrun stacks LOGDIR`` reads the workers
    directly). One store read every `STACKS_POLL_S`; each request is answered once."""

    def __init__(self) -> None:
        self._polled_at = 0.0  # monotonic time of the last look
        self._answered: str | None = None  # the id of the last request answered

    def answer(self, rdzv, num_nodes: int, take: Callable[[], list[dict]]) -> None:
        """Look for a new request in ``rdzv`` (not more often than every `STACKS_POLL_S`) and
        answer it with ``take()``: this node's ranks' published records (places and stacks,
        taken as for a failure report)."""
        now = time.monotonic()
        if rdzv.settings.max_nodes == 1:  # an in-process store (`open_store`): nobody asks
            return  # (a one-node round of an elastic job, --nnodes 1:N, is asked: answer it)
        if now - self._polled_at < STACKS_POLL_S:
            return
        self._polled_at = now
        request = rdzv.stacks_request()
        if request is None or request == self._answered:
            return
        self._answered = request
        rdzv.publish_stacks(request, json.dumps(take()).encode())


def _comparable_count(progress, frames) -> int:
    """The rank's count of meshrun.parallel collectives issued, or -1 where it cannot be
    compared with other ranks' (no counters; a pipeline stage, whose sends, receives and
    bucket counts differ from other stages' by design)."""
    if progress is None or any("meshrun/parallel/pipelining" in f.file for f in frames):
        return -1
    return progress.collectives
