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
from meshrun.agent.say import say
from meshrun.agent.stacks import (
    STACKS_TIMEOUT_S,
    Target,
    classify,
    collect_stacks,
    traceback_frames,
)
from meshrun.agent.verdicts import Place
from meshrun.agent.workers import WorkerGroup
from meshrun.rendezvous import RendezvousError, StoreLostError

__all__ = ["STACKS_POLL_S", "STACKS_POLLS_PER_S", "STACKS_TIMEOUT_S", "StackRequests",
           "placed_by_last_words", "poll_interval", "take_stacks"]  # fmt: skip

#: Seconds between two reads of the ``meshrun stacks`` request key where no watch runs, for
#: jobs of up to `STACKS_POLLS_PER_S` nodes (`poll_interval`).
STACKS_POLL_S = 1.0
#: Reads of the request key a second that a whole job sends its store, at most, when polling.
STACKS_POLLS_PER_S = 16.0


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
    directly); each request is answered once, on the caller's thread (the agent's loop).

    The request key is followed by a `meshrun.rendezvous.store.KeyWatch` (a watch on etcd, a
    blocking wait on a TCPStore connection of its own, on a thread: `Rendezvous.
    watch_stacks_requests`), so a request is seen at the first tick after it was written and
    a quiet job costs a wait and a read per node every `WATCH_PIECE_S`; `answer` itself does no store
    operation until there is a request. Where the watch cannot run (its connection failed)
    the key is read every `poll_interval` instead, which grows with the node count.
    """

    def __init__(self) -> None:
        self._polled_at = 0.0  # monotonic time of the last look (without a watch)
        self._answered: str | None = None  # the id of the last request answered
        self._watch = None  # the rendezvous' KeyWatch, once started
        self._fell_back = False  # the watch failed: poll

    def answer(self, rdzv, num_nodes: int, take: Callable[[], list[dict]]) -> None:
        """Look for a new request (the watch's latest value, or a read every
        `poll_interval`) and answer it in ``rdzv`` with ``take()``: this node's ranks'
        published records (places and stacks, taken as for a failure report)."""
        if rdzv.settings.max_nodes == 1:  # an in-process store (`open_store`): nobody asks
            return  # (a one-node round of an elastic job, --nnodes 1:N, is asked: answer it)
        request = self._latest(rdzv, num_nodes)
        if request is None or request == self._answered:
            return
        self._answered = request
        rdzv.publish_stacks(request, json.dumps(take()).encode())

    def _latest(self, rdzv, num_nodes: int) -> str | None:
        if not self._fell_back:
            if self._watch is None:
                self._watch = rdzv.watch_stacks_requests()
            if self._watch.error is None:
                if not self._watch.ready:
                    return None
                try:
                    return rdzv.stacks_request_id(self._watch.latest)
                except RendezvousError:
                    return None  # not a request meshrun wrote: nothing to answer
            self._fell_back = True
            if not isinstance(self._watch.error, StoreLostError):  # a lost store: poll says so
                say(f"stacks requests: the watch of the store stopped ({self._watch.error}); "
                    f"reading it every {poll_interval(num_nodes):g} s instead")  # fmt: skip
        now = time.monotonic()
        if now - self._polled_at < poll_interval(num_nodes):
            return None
        self._polled_at = now
        return rdzv.stacks_request()


def poll_interval(num_nodes: int) -> float:
    """Seconds between two reads of the stacks request key by one node where no watch runs:
    `STACKS_POLL_S`, or ``num_nodes / STACKS_POLLS_PER_S`` where that is longer (the job's
    store then gets about `STACKS_POLLS_PER_S` reads a second, whatever the node count)."""
    return max(STACKS_POLL_S, num_nodes / STACKS_POLLS_PER_S)


def _comparable_count(progress, frames) -> int:
    """The rank's count of meshrun.parallel collectives issued, or -1 where it cannot be
    compared with other ranks' (no counters; a pipeline stage, whose sends, receives and
    bucket counts differ from other stages' by design)."""
    if progress is None or any("meshrun/parallel/pipelining" in f.file for f in frames):
        return -1
    return progress.collectives
