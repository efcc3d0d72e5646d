"""The per-node elastic agent: the run loop and the state machine of a round.

One `Agent` runs on every node (docs/design.md §2). Its run loop:

1. ``rendezvous.next_round()`` -> this node's rank and the round's membership;
2. start the local `WorkerGroup` with the torchrun environment contract
   (`meshrun.agent.worker_env`, docs/design.md §3.1);
3. every ``monitor_interval``: the group's outcome, and the rendezvous' news;
   - all workers exited 0 -> exit barrier -> exit 0 (this node's success is recorded in the
     store first: if it is lost while it waits, the others finish without re-running it);
   - a worker failed -> publish the failure, spend one restart of the job's budget (or end
     the job), stop the group, go to 1 (`meshrun.agent.failure_report`);
   - a rank hung (``--hang-timeout``) -> the same, with every rank's place and the culprit;
   - the membership changed (a node waits to join, a node was lost) -> stop, go to 1, free;
     or, when every worker opted in, hand them the new round in place
     (`meshrun.agent.handover`);
   - a handled signal -> forwarded to the workers at once; one grace period; exit 128+N
     (`meshrun.agent.signals`). Signals win over failures: one that arrives at any moment
     ends the agent with 128+N and never spends a restart.
4. on final failure, the job-wide root-cause report, and the root-cause worker's exit code.

Each tick also passes on the schedulers' warnings (`meshrun.agent.signals`), samples step
times (`meshrun.agent.step_times`) and answers ``meshrun stacks`` requests
(`meshrun.agent.stack_requests`). What a restart's reason means is data
(`meshrun.rendezvous.restarts.Cause`), never read from its text.

Every way down stops the group the same way: SIGTERM, ``--shutdown-timeout`` seconds of grace,
then SIGKILL to whole process trees; the agent is a child subreaper, so a worker's
double-forked daemons are part of its tree. The agent never imports torch itself, except on a thread
for the workers' bootstrap store (see `meshrun.agent.bootstrap`) and for multi-node stores.
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import tempfile
import time
import uuid
from dataclasses import replace
from pathlib import Path

from meshrun.agent import addresses, console, handover
from meshrun.agent.bootstrap import BootstrapError, BootstrapStore
from meshrun.agent.config import LaunchConfig
from meshrun.agent.desync import DesyncCheck
from meshrun.agent.errors import WorkerFailure
from meshrun.agent.events import EVENT_FILE, EventLog
from meshrun.agent.failure_report import REPORT_FILE, FailureReport, place
from meshrun.agent.hang import ProgressWatch
from meshrun.agent.logs import UnsafeLogDir, make_private_dir
from meshrun.agent.reaper import Reaper
from meshrun.agent.say import first_line, say
from meshrun.agent.signals import Signals, Stopped, signal_name
from meshrun.agent.stack_requests import StackRequests, placed_by_last_words, take_stacks
from meshrun.agent.step_times import StepWatch
from meshrun.agent.worker_env import worker_spec
from meshrun.agent.workers import WorkerGroup, WorkerSpec, WorkerState, become_subreaper
from meshrun.exits import EXIT_OK, EXIT_RENDEZVOUS, EXIT_USAGE, ConfigError
from meshrun.rendezvous import (
    JobFailed,
    JobFinished,
    NodeDesc,
    Rendezvous,
    RendezvousError,
    RendezvousInfo,
    StoreGoneError,
    check_endpoint,
    open_store,
    settings_from_conf,
    workers_port,
)
from meshrun.rendezvous.restarts import Restart, cause_of


class Agent:
    """Runs this node's share of a job described by a `LaunchConfig`.

    Mirrors torch's ``LocalElasticAgent`` (``torch.distributed.elastic.agent.server``), with
    the restart budget kept in the rendezvous store and a fresh workers' store per round.

    Raises:
        ConfigError: at construction, for settings that cannot work (bad ``--rdzv-conf``
            values, a malformed endpoint); nothing has been started then.
    """

    def __init__(self, config: LaunchConfig):
        self.config = config
        self.host = socket.gethostname()
        self.node_id = f"{self.host}:{os.getpid()}:{uuid.uuid4().hex[:6]}"
        run_id = config.rdzv_id if config.rdzv_id != "none" or config.max_nodes > 1 else ""
        self.run_id = run_id or uuid.uuid4().hex[:12]
        try:
            self.settings = settings_from_conf(
                config.rdzv_conf,
                run_id=self.run_id,
                min_nodes=config.min_nodes,
                max_nodes=config.max_nodes,
                max_restarts=config.max_restarts,
            )
            self.endpoint = self._endpoint()
            check_endpoint(config.rdzv_backend, self.endpoint, self.settings)
        except ValueError as e:
            raise ConfigError(str(e)) from None
        self._events = EventLog(None, self.host)  # the real one once the log dir exists
        self._signals = Signals(tuple(config.signals_to_handle), emit=self._emit)
        self._report = FailureReport(
            self.host, self.settings, config.monitor_interval, config.hang_timeout,
            self._signals, emit=self._emit,
        )  # fmt: skip
        self._steps = StepWatch(self.host, emit=self._emit)
        self._stack_requests = StackRequests()
        self._desync = DesyncCheck(self.host, emit=self._emit) if config.desync_check else None
        # the round that runs: its group, its info, when it started, its progress watch
        self._group: WorkerGroup | None = None
        self._group_info: RendezvousInfo | None = None
        self._group_started_at = 0.0  # monotonic
        self._watch: ProgressWatch | None = None
        self._log_root: Path | None = None
        self._temp_logs = False
        self._subreaper = False
        self._users_master: addresses.UsersMaster | None = None  # set before the first round

    def _emit(self, kind: str, **fields) -> None:
        self._events.emit(kind, **fields)

    # -- setup ---------------------------------------------------------------------------------
    def _endpoint(self) -> str:
        c = self.config
        if c.rdzv_backend == "static":
            return f"{c.master_addr}:{c.master_port or 29500}"
        return c.rdzv_endpoint

    def _log_dir(self) -> Path:
        """This agent's log directory, ``<--log-dir>/<run id>/<host>_<pid>`` (a temp dir's
        ``<host>_<pid>`` without --log-dir), made on the first call (`make_private_dir`: 0700,
        never through a symlink).

        Raises:
            ConfigError: it cannot be made safely (a planted symlink, a file, another user's
                directory) or at all; one line naming the path.
        """
        if self._log_root is None:
            if self.config.log_dir:
                parent, names = Path(self.config.log_dir), (self.run_id,)
            else:
                parent, names = Path(tempfile.mkdtemp(prefix=f"meshrun_{self.run_id}_")), ()
                self._temp_logs = True
            self._log_root = self._private_dir(parent, *names, f"{self.host}_{os.getpid()}")
        return self._log_root

    @staticmethod
    def _private_dir(parent: Path, *names: str) -> Path:
        try:
            return make_private_dir(parent, *names)
        except UnsafeLogDir as e:
            raise ConfigError(str(e)) from None
        except OSError as e:
            raise ConfigError(
                f"cannot make the log directory under {parent}: {e.strerror or e}"
            ) from None

    # -- the run loop ----------------------------------------------------------------------------
    def run(self) -> int:
        """Run until the job succeeds, fails, or a handled signal stops it; return the exit code.

        Exit codes (docs/design.md §3.4): 0 success; the root-cause worker's exit status; 3
        for a rendezvous or store failure; 128+N when stopped by signal N. Every step of the
        way is an event in ``events.jsonl`` in this agent's log directory
        (`meshrun.agent.events`).
        """
        code = 1
        try:
            code = self._run()
            return code
        finally:
            # What is queued for the console is written, as long as the console takes it (a
            # blocked one does not hold the exit); what it never showed is counted here.
            console.finish()
            lines, size = console.dropped_total()
            lost = {"console_dropped_lines": lines, "console_dropped_bytes": size} if size else {}
            self._events.emit("agent_exit", code=code, **lost)
            self._events.close()

    def _run(self) -> int:
        self._signals.install()
        if self.config.hang_timeout is not None:
            say(
                f"hang detection on (--hang-timeout {self.config.hang_timeout:g} s): a rank is "
                "watched from its first meshrun.parallel.heartbeat(); scripts that never call "
                "it are never called hung"
            )
        # Orphans of the workers' trees (double-forked daemons) are re-parented to the agent,
        # so every round's stop finds and ends them (the whole tree is cleaned).
        self._subreaper = become_subreaper()
        reaper = Reaper(also_ignore=tuple(self.config.signals_to_handle))
        reaper.start()
        rdzv: Rendezvous | None = None
        try:
            log_dir = self._log_dir()  # one that cannot be made safely: exit 2, nothing started
            self._report.report_path = log_dir / REPORT_FILE
            self._events = EventLog(
                log_dir / EVENT_FILE, self.host, console=self.config.event_log_handler == "console"
            )
            self._events.emit(
                "agent_start", node=self.node_id, nproc=self.config.nproc_per_node,
                run_id=self.run_id,
            )  # fmt: skip
            self._signals.replay_early()
            store, addr = self._signals.interruptible(
                open_store,
                self.config.rdzv_backend,
                self.endpoint,
                self.settings,
                node_rank=self.config.node_rank,
            )
            addresses.note_loopback_store(self.endpoint, store)
            me = NodeDesc(
                node_id=self.node_id,
                addr=self.config.local_addr or addresses.advertised(self.config, self.endpoint, addr),
                nproc=self.config.nproc_per_node,
                node_rank_hint=self.config.node_rank,
            )
            # --master-port P on one node: the workers' store on P (`addresses.users_master`)
            self._users_master = users = addresses.users_master(self.config, self.settings)
            bind = addresses.bootstrap_bind(self.config, self.settings, me.addr)
            bootstrap = BootstrapStore(
                users.bind if users else bind,
                port=workers_port(self.settings) or (users.port if users else 0),
            )
            rdzv = Rendezvous(
                store, self.settings, me, host_bootstrap=lambda: self._open(bootstrap, me)
            )
            code = self._loop(rdzv, reaper, bootstrap)
            if store.serves_others and self._signals.stop_signal is None:  # exit promptly
                rdzv.wait_for_others_to_leave()
            if code == EXIT_OK and self._temp_logs and self._log_root is not None:
                shutil.rmtree(self._log_root.parent, ignore_errors=True)
            return code
        except Stopped as e:  # no workers ran (during rendezvous)
            say(f"received {signal_name(e.signum)} during rendezvous; exiting")
            return 128 + e.signum
        except RendezvousError as e:
            # etcd: the job's keys gone may mean that the others finished without this node
            if isinstance(e, StoreGoneError) and rdzv is not None and (
                (finished := rdzv.finished_without_this_node()) is not None
            ):
                say(f"the job finished without this node ({finished}): its other nodes "
                    "succeeded in a round this node was not in; exiting")  # fmt: skip
                return EXIT_OK
            say(f"error: rendezvous failed: {e}")
            return EXIT_RENDEZVOUS
        except ConfigError as e:
            say(f"error: {e}")
            return EXIT_USAGE
        finally:
            if self._group is not None:
                self._group.stop(self.config.shutdown_timeout)
            if rdzv is not None:
                rdzv.close()
            reaper.close()
            self._signals.say_unpassed()
            if self._subreaper:
                become_subreaper(False)
            self._signals.restore()

    def _open(self, bootstrap: BootstrapStore, me: NodeDesc) -> tuple[str, int]:
        """Start the round's workers' store (on node rank 0); return its address: the one this
        node advertises, or ``--master-addr`` as given (``localhost`` stays ``localhost``) when
        the store is on the user's ``--master-port`` (`addresses.users_master`)."""
        bootstrap.close()
        users = self._users_master
        addr = users.master_addr if users else me.addr
        try:
            return addr, bootstrap.open()
        except OSError as e:  # a --rdzv-conf workers_port=N or --master-port P already taken
            fixed = workers_port(self.settings)
            option = "--rdzv-conf workers_port" if fixed else "--master-port"
            fixed = fixed or (users.port if users else 0)
            hint = f" (is {option} {fixed} already in use?)" if fixed else ""
            raise RendezvousError(
                f"cannot host the workers' store on {addr} port {fixed or 'a free port'}: "
                f"{e.strerror or e}{hint}"
            ) from None

    def _loop(self, rdzv: Rendezvous, reaper: Reaper, bootstrap: BootstrapStore) -> int:
        c = self.config
        signals = self._signals
        desync = self._desync
        while True:
            try:
                info = signals.interruptible(rdzv.next_round)
            except JobFinished:
                say("the job finished while this node waited as a spare; exiting")
                rdzv.leave()
                return EXIT_OK
            except JobFailed as e:
                return self._report.final(rdzv, e.round, [], self._node_rank())
            self._start_group(info, reaper)
            bootstrap.serve()  # imports torch on a thread, after the workers are registered
            while True:
                result = self._group.wait(c.monitor_interval)
                if signals.stop_signal is not None:
                    return self._stop_by_signal()
                signals.pass_on_warnings(reaper, self._group, self._group_started_at)
                self._group.follow_terminal()
                try:
                    bootstrap.check()  # before a failure it may explain
                    if result is not None and result.state is WorkerState.SUCCEEDED:
                        reason = signals.interruptible(rdzv.exit_barrier, c.monitor_interval)
                        if reason is None:
                            # Say so before stopping what is left (a lingering descendant can
                            # take the whole grace): the store host waits for that, bounded.
                            rdzv.leave()
                            self._end_round(rdzv, bootstrap)
                            return EXIT_OK
                    elif result is not None:
                        reason = (desync and desync.at_failure(
                            rdzv, info, self._group, result, self._take_stacks, self._report)
                        ) or self._report.on_failure(rdzv, info, result)  # fmt: skip
                    elif self._watch is not None and (hung := self._watch.check()):
                        places = self._take_stacks()
                        reason = (desync and desync.at_hang(
                            rdzv, info, self._group, places, self._report)
                        ) or self._report.on_hang(rdzv, self._group_info, hung, places)
                    elif desync and (reason := desync.tick(
                            rdzv, info, self._group, self._take_stacks, self._report)):
                        pass  # a desync (--desync-check) stops the job as a failure
                    else:
                        self._steps.tick(rdzv, info, self._group, self._watch)
                        self._stack_requests.answer(rdzv, info.num_nodes, self._published_stacks)
                        reason = rdzv.poll()
                except Stopped:  # signals win over failures: nothing spent, exit 128+N
                    return self._stop_by_signal()
                except BootstrapError as e:  # the workers cannot meet: the round cannot run
                    say(f"error: {e}")
                    self._end_round(rdzv, bootstrap)
                    return EXIT_RENDEZVOUS
                except JobFailed as e:
                    local = self._end_round(rdzv, bootstrap, fault=True)
                    return self._report.final(rdzv, e.round, local, self._node_rank())
                if reason is not None:
                    try:
                        moved = self._in_place(rdzv, reaper, bootstrap, info, reason)
                    except Stopped:
                        return self._stop_by_signal()
                    except JobFinished:
                        rdzv.leave()
                        self._end_round(rdzv, bootstrap)
                        return EXIT_OK
                    except JobFailed as e:
                        local = self._end_round(rdzv, bootstrap, fault=True)
                        return self._report.final(rdzv, e.round, local, self._node_rank())
                    if moved is not None:
                        info = moved
                        continue
                    say(f"restarting the worker group: {reason}")
                    self._note_restart(info, reason)
                    for f in self._end_round(rdzv, bootstrap, fault=cause_of(reason).fault):
                        if f.stopped:
                            say(f"stopped rank {f.global_rank}: {place(f)}")
                    if signals.stop_signal is not None:  # it came while the group was stopped
                        return self._stop_by_signal()
                    break

    def _in_place(
        self, rdzv: Rendezvous, reaper: Reaper, bootstrap: BootstrapStore,
        info: RendezvousInfo, reason: Restart,
    ) -> RendezvousInfo | None:
        """The membership changed (a node lost, nodes waiting to join) and every local worker
        opted in to in-place recovery (`meshrun.agent.handover.eligible`): join the next round
        while they run, hand each its new environment (a worker whose peers are alive takes it
        at its next step; the joiners' fresh workers get the state from it by broadcast), and
        wait up to `handover.timeout` seconds for every one to confirm. Returns the new round,
        or None when the workers cannot take it in place: then the caller restarts the group
        as usual. A worker that does not confirm in time (or exits meanwhile) gets the usual
        treatment within the new round: the whole local group is stopped and started again
        there, with nothing spent.

        Raises:
            Stopped: a handled signal; JobFinished, JobFailed: the job ended meanwhile.
        """
        if not handover.eligible(self._group, reason):
            return None
        timeout = handover.timeout()
        say(f"{reason}: the workers opted in to in-place recovery; joining the next round "
            "while they run")  # fmt: skip
        self._note_restart(info, reason)
        t0 = time.monotonic()
        new = self._signals.interruptible(rdzv.next_round)
        if new.node_rank != 0:  # node rank 0 of the new round reopened it in next_round
            bootstrap.close()
        bootstrap.serve()
        specs = [self._spec(new, s.local_rank, s.log_dir.parent) for s in self._group.specs]
        self._group.renumber(specs)
        pids = self._group.pids
        why = handover.offer(specs, new.round, timeout)
        ranks = f"ranks {new.rank_offset}..{new.rank_offset + new.local_world_size - 1}"
        say(f"round {new.round}: node rank {new.node_rank} of {new.num_nodes}, {ranks} of "
            f"world size {new.world_size}, restart count {new.restart_count}"
            + ("" if why else f"; handed to the running workers (pids "
               f"{', '.join(map(str, pids))}), {timeout:g} s to confirm"))
        self._group_info = new
        self._report.failed_round = False
        if self._desync is not None:
            self._desync.new_round()
        self._steps.new_round()
        if self._watch is not None:  # the wait for the round was the agent's, not a hang
            self._watch.rearm()
        self._emit_round_start(new, in_place=True)
        if why is None:
            why = handover.await_confirmations(
                self._group, new.round, list(zip(specs, pids, strict=True)), timeout,
                self.config.monitor_interval, self._signals.raise_if_stopped,
            )  # fmt: skip
        if why is None:
            say(f"round {new.round}: every worker confirmed in place "
                f"({time.monotonic() - t0:.2f} s after the restart was decided)")  # fmt: skip
            self._emit("in_place", round=new.round, confirmed=True)
            for spec, pid in zip(specs, pids, strict=True):  # the same process, a new round
                self._emit(
                    "worker_start", round=new.round, rank=spec.global_rank,
                    local_rank=spec.local_rank, worker_pid=pid, in_place=True,
                )  # fmt: skip
            return new
        say(f"round {new.round}: in-place handover failed ({why}); stopping the worker group "
            "and starting it again in this round")  # fmt: skip
        self._emit("in_place", round=new.round, confirmed=False, reason=why)
        self._watch = None
        self._group.stop(self.config.shutdown_timeout)
        self._note_exits()
        self._group = None
        self._signals.raise_if_stopped()
        if new.num_nodes == 1:
            # A worker that confirmed began to meet in the round's store before it was
            # stopped: its address is there, and a fresh worker could read it (gloo: refused,
            # retried, failed). The whole world is here, so it gets a store of its own.
            _, port = self._open(bootstrap, new.nodes[0])
            new = replace(new, master_port=port)
        self._start_group(new, reaper)
        bootstrap.serve()
        return new

    # -- workers ---------------------------------------------------------------------------------
    def _start_group(self, info: RendezvousInfo, reaper: Reaper) -> None:
        c = self.config
        attempt_dir = self._private_dir(self._log_dir(), f"attempt_{info.round}")
        for local_rank in range(c.nproc_per_node):
            self._private_dir(attempt_dir, str(local_rank))
        ranks = f"ranks {info.rank_offset}..{info.rank_offset + info.local_world_size - 1}"
        say(
            f"round {info.round}: node rank {info.node_rank} of {info.num_nodes}, {ranks} of "
            f"world size {info.world_size}, restart count {info.restart_count}; "
            f"logs in {attempt_dir}"
        )
        specs = [
            self._spec(info, local_rank, attempt_dir) for local_rank in range(c.nproc_per_node)
        ]
        self._group_info = info
        self._report.new_round()
        self._group = WorkerGroup(
            specs,
            reaper,
            duplicate_stdout_filters=c.duplicate_stdout_filters,
            duplicate_stderr_filters=c.duplicate_stderr_filters,
            filtered_dir=attempt_dir,
            adopt_orphans=self._subreaper,
        )
        self._watch = None
        try:  # the files exist before any worker can beat
            self._watch = ProgressWatch([s.log_dir for s in specs], c.hang_timeout)
        except OSError as e:  # a full log disk: train on, unwatched (heartbeat copes)
            what = "hang detection" if c.hang_timeout is not None else "progress counters"
            say(f"{what} off for round {info.round}: cannot write a progress "
                f"file ({e.strerror}: {e.filename}); is the log disk full?")
        self._group.start()
        self._group_started_at = time.monotonic()
        self._steps.new_round()
        if self._desync is not None:
            self._desync.new_round()
        self._emit_round_start(info)
        for spec, pid in zip(self._group.specs, self._group.pids, strict=True):
            self._emit(
                "worker_start", round=info.round, rank=spec.global_rank,
                local_rank=spec.local_rank, worker_pid=pid,
            )  # fmt: skip

    def _spec(self, info: RendezvousInfo, local_rank: int, attempt_dir: Path) -> WorkerSpec:
        return worker_spec(self.config, info, local_rank, attempt_dir, self.host)

    def _node_rank(self) -> int | None:
        return self._group_info.node_rank if self._group_info is not None else None

    def _take_stacks(self) -> list[WorkerFailure]:
        return take_stacks(self._group, self._watch, self.host,
                           abort=lambda: self._signals.stop_signal is not None)  # fmt: skip

    def _published_stacks(self) -> list[dict]:
        return [self._report.record(f, self._node_rank()) for f in self._take_stacks()]

    def _end_round(
        self, rdzv: Rendezvous, bootstrap: BootstrapStore, *, fault: bool = False
    ) -> list[WorkerFailure]:
        """Stop the group and close the round's bootstrap store; return the ranks that failed
        on their own this round (`WorkerGroup.failures`) and, after a ``fault`` (a failure, a
        hang or a lost node, here or elsewhere), a ``stopped`` record of every rank that was
        still running: where it was, from the stack taken just before the stop. After a
        failure, the ranks that failed a moment after the first (they were not in its report
        yet) are published too."""
        report = self._report
        stopped = self._take_stacks() if fault and not report.stacks_taken else []
        if stopped:  # at once: a node that reports before this one's stop ends still has them
            try:
                rdzv.publish_failures([report.record(f, self._node_rank()) for f in stopped])
            except RendezvousError:
                pass  # the store is gone: this node's own report still lists them
        self._watch = None
        failures: list[WorkerFailure] = []
        if self._group is not None:  # a signal that came meanwhile is what the workers get
            self._group.stop(self.config.shutdown_timeout,
                             death_sig=self._signals.stop_signal or signal.SIGTERM)  # fmt: skip
            failures = self._group.failures()
            stopped = [placed_by_last_words(f, self._group.stderr_tail(f.local_rank))
                       for f in stopped]  # fmt: skip
            self._note_exits()
            self._group = None
        bootstrap.close()
        failed = {f.global_rank for f in failures}
        stopped = [f for f in stopped if f.global_rank not in failed]  # it failed meanwhile
        if report.failed_round and failures:
            rdzv.publish_failures([report.record(f, self._node_rank()) for f in failures])
        return failures + stopped

    def _stop_by_signal(self) -> int:
        """Forward the handled signal to the workers (once), one grace period, exit 128+N."""
        signum = self._signals.stop_signal
        say(
            f"received {signal_name(signum)}: forwarded to the workers; stopping them "
            f"(grace {self.config.shutdown_timeout:g} s)"
        )
        self._watch = None
        if self._group is not None:
            self._group.stop(self.config.shutdown_timeout, death_sig=signum)
            self._note_exits()
            self._group = None
        return 128 + signum

    # -- what the timeline sees ----------------------------------------------------------------
    def _emit_round_start(self, info: RendezvousInfo, **extra) -> None:
        self._emit(
            "round_start", round=info.round, node_rank=info.node_rank,
            num_nodes=info.num_nodes, world_size=info.world_size, rank_offset=info.rank_offset,
            local_world_size=info.local_world_size, restart_count=info.restart_count, **extra,
        )  # fmt: skip

    def _note_exits(self) -> None:
        """One ``worker_exit`` event per worker of the group just stopped."""
        for spec, code, stopped in self._group.outcomes():
            fields = {"exitcode": code if code is None or code >= 0 else None}
            if code is not None and code < 0:
                fields["signal"] = signal_name(-code)
            self._emit(
                "worker_exit", round=self._group_info.round, rank=spec.global_rank,
                local_rank=spec.local_rank, stopped=stopped, **fields,
            )  # fmt: skip

    def _note_restart(self, info: RendezvousInfo, reason: Restart) -> None:
        """The ``restart`` event, and ``node_lost`` / ``join`` for a membership change."""
        if getattr(reason, "node", ""):
            self._emit("node_lost", node=reason.node, round=info.round)
        if getattr(reason, "joining", 0):
            self._emit("join", nodes=reason.joining, round=info.round + 1)
        self._emit("restart", round=info.round, reason=first_line(reason),
                   spent=cause_of(reason).spent)  # fmt: skip
