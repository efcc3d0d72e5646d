"""The agent's failure path: a worker failed or a rank hung, and the job's final report.

Three moments (docs/design.md §3.3):

- **A worker failed** (`FailureReport.on_failure`). Its failure is published to the store and
  one restart of the job's budget is spent (or the job ends). When the failure reads like a
  peer's connection closing (`peer_lost`) in a multi-node round, the agent first waits, bounded,
  for the rendezvous to confirm a membership change, which spends nothing: the worker usually
  sees the peer's sockets close well before the heartbeats can prove the node dead.
- **A rank hung** (`FailureReport.on_hang`, ``--hang-timeout``). Every local rank's place is
  taken (`meshrun.agent.stack_requests.take_stacks`), the likely culprit named
  (`meshrun.agent.errors.culprits`), the hung ranks published as failures (exit status 124)
  and the others as stopped, and one restart spent.
- **The job failed** (`FailureReport.final`). The job-wide root-cause report: the first
  failure in time across nodes, with every stopped rank's place; the agent exits with that
  worker's exit status. When the store is gone, the report is made of what this node saw.
  The report goes to the console the way the agent's lines go (never blocking) and to
  `REPORT_FILE` in the agent's log directory, which its title line names.

Signals win over failures: a handled signal that arrives at any of these moments ends the
agent with 128+N, and nothing more is published or spent (`meshrun.agent.signals.Stopped`).
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path

from meshrun.agent.collective_record import ranges
from meshrun.agent.errors import (
    WorkerFailure,
    culprits,
    describe_place,
    disagreement,
    format_report,
    placed,
    root_cause,
)
from meshrun.agent.hang import Hang
from meshrun.agent.say import first_line, say, say_text
from meshrun.agent.signals import Signals, Stopped, signal_name
from meshrun.agent.verdicts import waiting_ranks
from meshrun.agent.workers import GroupResult
from meshrun.exits import EXIT_HUNG
from meshrun.peer_lost import connection_closed
from meshrun.rendezvous import RendezvousError, RendezvousInfo, RendezvousSettings
from meshrun.rendezvous.restarts import Cause, Restart

# Message + traceback kept per failure in this node's own report (what the store gets is less).
_LOCAL_REPORT_MAX_BYTES = 32 * 1024
#: The job's final report, also written to this file in the agent's log directory.
REPORT_FILE = "failure_report.txt"

def peer_lost(failure: WorkerFailure) -> bool:
    """Whether ``failure``'s message or traceback reads like a peer's connection closing
    (`meshrun.peer_lost.connection_closed`): then it is likely a consequence of a membership
    change, not its cause."""
    return connection_closed(failure.message, failure.traceback)


class FailureReport:
    """This node's failures of the running round, published and reported.

    Args:
        host: this node's host name.
        settings: the rendezvous settings (the restart budget, the dead-node bound).
        monitor_interval: the agent's tick, seconds (the wait to tell a lost node).
        hang_timeout: ``--hang-timeout`` in seconds, or None.
        signals: the agent's `Signals` (a handled signal ends every wait here).
        emit: ``emit(kind, **fields)`` writes one event to the agent's event log.
    """

    def __init__(
        self,
        host: str,
        settings: RendezvousSettings,
        monitor_interval: float,
        hang_timeout: float | None,
        signals: Signals,
        emit: Callable[..., None],
    ):
        self.host = host
        self.settings = settings
        self.monitor_interval = monitor_interval
        self.hang_timeout = hang_timeout
        self.signals = signals
        self._emit = emit
        #: this round's group failed (or hung) and published its failures
        self.failed_round = False
        #: this round's stacks are in (a hang's report took them)
        self.stacks_taken = False
        #: where `final` also writes the job's report (the agent's log directory's
        #: `REPORT_FILE`, set once that exists), or None: the console only
        self.report_path: Path | None = None

    def new_round(self) -> None:
        """A new group starts: nothing of it has failed or been taken yet."""
        self.failed_round = False
        self.stacks_taken = False

    def record(self, failure: WorkerFailure, node_rank: int | None) -> dict:
        """The failure as published to the store: this node's host and node rank, message and
        traceback capped (`WorkerFailure.capped`: a few KB per rank, so a whole round's
        records fit in one store request)."""
        return json.loads(self._here(failure, node_rank).capped().to_json())

    def _here(self, failure: WorkerFailure, node_rank: int | None) -> WorkerFailure:
        return replace(failure, host=self.host, node_rank=node_rank)

    # -- a worker failed -----------------------------------------------------------------------
    def on_failure(self, rdzv, info: RendezvousInfo, result: GroupResult) -> Restart:
        """Publish ``result``'s failures and spend a restart; return the restart. A failure
        that reads like a lost peer in a multi-node round waits first (`_settle`) for a
        membership change, which is returned instead and spends nothing.

        Raises:
            Stopped: a handled signal (nothing published or spent).
            JobFailed: the job's restart budget is spent.
        """
        first = result.failures[0]
        what = f"rank {first.global_rank} (local rank {first.local_rank}) {first.describe_exit()}"
        if info.num_nodes > 1 and any(peer_lost(f) for f in result.failures):
            reason = self._settle(rdzv, what)
            if reason is not None:
                return reason  # a membership change: no restart spent, no failure published
        self.signals.raise_if_stopped()
        self.failed_round = True
        rdzv.publish_failures([self.record(f, info.node_rank) for f in result.failures])
        for f in result.failures:
            self._emit(
                "failure", round=info.round, rank=f.global_rank, exitcode=f.exitcode,
                message=first_line(f.message) or f.describe_exit(),
            )  # fmt: skip
        state, _ = rdzv.read_state()
        budget = self.settings.max_restarts
        if state.restarts >= budget and state.round == info.round:
            say(f"worker failure: {what}; no restarts left (--max-restarts {budget})")
        else:
            say(f"worker failure: {what}; restart {state.restarts + 1} of {budget}")
        return rdzv.request_restart(
            Restart(f"worker failure on {self.host}: {what}", Cause.FAILURE)
        )

    def _settle(self, rdzv, what: str) -> Restart | None:
        """A worker failed the way workers fail when a peer vanished (its connection closed):
        wait for the rendezvous to tell a membership change (a lost node, a node joining,
        another node moving the round on). Returns its reason, or None when none came within
        twice the dead-node bound (plus one keep-alive interval): a real failure. Raises
        `Stopped` when a handled signal arrives meanwhile (a scheduler cancelling the job
        kills peers first): the signal wins, the failure is neither published nor spent.

        Without this wait a lost node would spend a restart of the job's budget on every
        survivor's first failure. A failure elsewhere moves the round on at once, so the whole
        bound is waited only for a connection failure nobody else explains."""
        bound = 2 * self.settings.dead_after + self.settings.keep_alive_interval
        say(
            f"worker failure: {what} (a peer's connection closed); waiting up to {bound:g} s "
            f"for the rendezvous to tell a lost node from a failure"
        )
        deadline = time.monotonic() + bound
        while time.monotonic() < deadline:
            self.signals.raise_if_stopped()
            reason = self.signals.interruptible(rdzv.poll)
            if reason is not None:
                return reason
            time.sleep(min(self.monitor_interval, self.settings.keep_alive_interval))
        return None

    # -- a rank hung ---------------------------------------------------------------------------
    def on_hang(
        self, rdzv, info: RendezvousInfo, hung: list[Hang], places: list[WorkerFailure]
    ) -> Restart:
        """Some rank made no progress for --hang-timeout; ``places`` is every local rank's
        place (`take_stacks`). Name the likely culprit, publish the hung ranks as failures
        (exit status 124) and the others as stopped, spend one restart; return it.

        Raises:
            Stopped: a handled signal (nothing published or spent).
            JobFailed: the job's restart budget is spent.
        """
        timeout = self.hang_timeout
        idle = {h.local_rank: h for h in hung}
        records = []
        for r in places:  # every rank of a hung group is part of the hang
            h = idle.get(r.local_rank)
            message = (
                f"hung: no progress for {h.idle_s:.1f} s (--hang-timeout {timeout:g}) after "
                f"{h.heartbeats} heartbeat(s); stuck at {r.at}"
                if h is not None
                else f"stopped with the hung group; was at {r.at}"
            )
            stamp = h.last_progress_ms if h is not None else r.timestamp_ms
            records.append(
                replace(r, stopped=False, exitcode=EXIT_HUNG, timestamp_ms=stamp, message=message)
            )
        if not records:  # the hung ranks exited meanwhile: their exit is the news
            return rdzv.poll() or Restart(
                "the hung ranks exited while their stacks were taken", Cause.MOVED_ON
            )
        records = placed(records)
        blamed, why = culprits(records)
        first = root_cause(records)
        if blamed:
            waiting = waiting_ranks(records, but=blamed)
            by_rank = {f.global_rank: f for f in records}
            named = "; ".join(f"rank {g} at {by_rank[g].at}" for g in blamed)
            say(f"hang: likely cause {named} ({why}); waiting: ranks {ranges(waiting, sep=', ') or 'none'}")
        else:
            say(f"rank {first.global_rank} {first.message}" + (f" ({why})" if why else ""))
        found = disagreement(records)
        if found is not None:
            say(f"hang: collectives: {found.line}")
        self.signals.raise_if_stopped()  # collecting stacks takes up to seconds
        self.failed_round = True
        self.stacks_taken = True
        self._emit(
            "hang", round=info.round, culprits=blamed or [first.global_rank],
            waiting=waiting_ranks(records),
        )  # fmt: skip
        rdzv.publish_failures([self.record(f, info.node_rank) for f in records])
        culprit = f"rank {blamed[0]}" if blamed else f"rank {first.global_rank}"
        text = (f"hang on {self.host}: {culprit} made no progress for {timeout:g} s"
                + (f" ({why})" if blamed else ""))  # fmt: skip
        return rdzv.request_restart(Restart(text, Cause.HANG))

    # -- the job failed ------------------------------------------------------------------------
    def final(
        self, rdzv, round: int, local: list[WorkerFailure], node_rank: int | None
    ) -> int:
        """Print the job-wide root-cause report of ``round`` (also written to `report_path`,
        named in its title line); ``local`` are this node's own
        failures and stopped ranks (node rank ``node_rank``). Returns the root-cause worker's
        exit status, or 128+N when a handled signal N arrived meanwhile (signals win)."""
        try:
            if local and rdzv.info is not None and rdzv.info.round == round:
                rdzv.publish_failures([self.record(f, node_rank) for f in local])
            records = self.signals.interruptible(rdzv.collect_failures, round)
            rdzv.leave()
        except Stopped as e:
            say(
                f"received {signal_name(e.signum)} while the job's failure was being "
                "reported; exiting"
            )
            return 128 + e.signum
        except RendezvousError:  # the store is gone: report what this node saw
            records = [self.record(f, node_rank) for f in local]
        failures = [WorkerFailure.from_json(json.dumps(r)) for r in records]
        if local:  # this node's own failures are reported with more than was published
            mine = {
                f.global_rank: self._here(f, node_rank).capped(_LOCAL_REPORT_MAX_BYTES)
                for f in local
            }
            failures = [_with_longer_text(f, mine.get(f.global_rank)) if f.node_rank == node_rank
                        else f for f in failures]  # fmt: skip
        if all(f.stopped for f in failures):
            say("error: the job failed on another node, which published no failure record")
            if failures:
                self._print(failures)
            return 1
        self._print(failures)
        stop = self.signals.stop_signal
        if stop is not None:  # it came while the group was being stopped
            say(f"received {signal_name(stop)}; exiting")
            return 128 + stop
        return root_cause(failures).exit_status

    def _print(self, failures: list[WorkerFailure]) -> None:
        """The report on the console (`say_text`: queued, never blocking) and in
        `report_path`, which its title line names; a file that cannot be written is said."""
        path = self.report_path
        text = None
        if path is not None:
            title = f"meshrun: job failed (this report is also in {path})"
            text = format_report(failures, title=title)
            try:
                _write_private(path, text + "\n")
            except OSError as e:
                say(f"cannot write the failure report to {path}: {e.strerror or e}")
                text = None
        say_text((text or format_report(failures)) + "\n")


def _write_private(path, text: str) -> None:
    """Write ``text`` to ``path`` (made 0600, replaced if there, never through a symlink);
    on an OSError (a full disk) the partial file is removed and the error raised."""
    flags = os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW | os.O_CLOEXEC
    fd = os.open(path, flags, 0o600)
    try:
        view = memoryview(text.encode("utf-8", "replace"))
        while view:
            view = view[os.write(fd, view) :]
    except OSError:
        os.unlink(path)
        raise
    finally:
        os.close(fd)


def _with_longer_text(published: WorkerFailure, local: WorkerFailure | None) -> WorkerFailure:
    """A rank of this node as the job's report shows it: the record the store holds (what
    every node reads, so every node files the rank the same way: a failure, or stopped, and
    where) with this node's longer message and traceback where both describe the same end
    (a rank first published as stopped may have exited non-zero while it was being stopped;
    the store keeps its first record)."""
    if local is None or (local.stopped, local.source) != (published.stopped, published.source):
        return published
    return replace(published, message=local.message, traceback=local.traceback)


def place(f: WorkerFailure) -> str:
    """Where a stopped rank was, in one line: "waiting in barrier at x.py:3 in f; stack: P"."""
    found = f"; stack: {f.stack_path}" if f.stack_path else f" ({f.stack_problem})"
    return f"{describe_place(f)} at {f.at}{found}"
