"""The per-node elastic agent: rendezvous, spawn, monitor, restart, report.

One `Agent` runs on every node (DESIGN.md §2). Its run loop:

1. ``rendezvous.next_round()`` -> this node's rank and the round's membership;
2. start the local `WorkerGroup` with the torchrun environment contract (§3.1);
3. every ``monitor_interval``: the group's outcome, and the rendezvous' news;
   - all workers exited 0 -> exit barrier -> exit 0 (this node's success is recorded in the
     store first: if it is lost while it waits, the others finish without re-running it);
   - a worker failed -> publish the failure, spend one restart of the job's budget (or end
     the job), stop the group, go to 1; but when the failure reads like a peer's connection
     closing (a node vanished under a collective) in a multi-node round, first wait for the
     rendezvous to confirm a membership change, which spends nothing;
   - the membership changed (a node waits to join, a node was lost) -> stop, go to 1, free;
   - a handled signal -> forwarded to the workers at once; one grace period; exit 128+N.
     Signals win over failures: one that arrives at any moment (while waiting to tell a lost
     node from a failure, while stopping, during rendezvous or the exit barrier) ends the
     agent with 128+N and never spends a restart.
4. on final failure, the job-wide root-cause report, and the root-cause worker's exit code.

Every way down stops the group the same way: SIGTERM, ``--shutdown-timeout`` seconds of grace,
then SIGKILL to whole process trees; the agent is a child subreaper, so a worker's
double-forked daemons are part of its tree. The agent never imports torch itself, except on a thread
for the workers' bootstrap store (see `meshrun.agent.bootstrap`) and for multi-node stores.
"""

from __future__ import annotations

import ipaddress
import json
import os
import re
import shutil
import signal
import socket
import sys
import tempfile
import threading
import time
import uuid
from dataclasses import replace
from pathlib import Path

from meshrun import exit_guard, in_place
from meshrun._console import take_early
from meshrun.agent.bootstrap import BootstrapError, BootstrapStore
from meshrun.agent.collectives import (
    RECORD_ENV,
    RECORD_FILE,
    read_record,
    record_env,
    summary,
    wait_current,
)
from meshrun.agent.config import LaunchConfig, Std
from meshrun.agent.errors import (
    WorkerFailure,
    culprits,
    describe_place,
    disagreement,
    format_report,
    root_cause,
)
from meshrun.agent.events import EVENT_FILE, EventLog
from meshrun.agent.hang import Hang, ProgressWatch, progress_env
from meshrun.agent.logs import UnsafeLogDir, make_private_dir
from meshrun.agent.reaper import Reaper
from meshrun.agent.stacks import Target, classify, collect_stacks, traceback_frames
from meshrun.agent.stragglers import StepTimes, Stragglers, decode_step_times, encode_step_times
from meshrun.agent.workers import (
    GroupResult,
    WorkerGroup,
    WorkerSpec,
    WorkerState,
    become_subreaper,
)
from meshrun.exits import EXIT_HUNG, EXIT_OK, EXIT_RENDEZVOUS, EXIT_USAGE, ConfigError
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
from meshrun.rendezvous.c10d import AGENT_ONLY_ENV, bind_address

# Message + traceback kept per failure in this node's own report (what the store gets is less).
_LOCAL_REPORT_MAX_BYTES = 32 * 1024
# Restarts that are not a fault (nodes joining): nobody's stack is worth taking then.
_NOT_A_FAULT = re.compile(r"node\(s\) waiting to join|job finished|succeeded")
# Variables meshrun reads secrets from (an etcd password= in PET_RDZV_CONF; meshrun's own
# *SECRET*/*PASSWORD*/*TOKEN* variables): never copied into a worker's environment. A torchrun
# script needs none of them (DESIGN.md §3.1); the user's own variables pass through untouched.
SECRET_ENV = frozenset({"PET_RDZV_CONF"})
_SECRET_ENV_PATTERN = re.compile(r"MESHRUN_\w*(?:SECRET|PASSWORD|TOKEN)\w*")


class _Stopped(Exception):
    """A handled signal arrived: whatever the agent was doing (a rendezvous call, waiting to
    tell a lost node from a failure, the exit barrier) ends, and the agent exits 128+N.
    Signals win over failures: nothing is published and no restart is spent after one."""

    def __init__(self, signum: int):
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


def say(message: str) -> None:
    """One line from the agent itself, on stderr."""
    print(f"meshrun: {message}", file=sys.stderr, flush=True)


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
        self._group: WorkerGroup | None = None
        self._failed_round = False  # this round's group failed and published its failures
        self._stacks_taken = False  # this round's stacks are in (a hang's report took them)
        self._events = EventLog(None, self.host)  # the real one once the log dir exists
        self._steps = StepTimes()
        self._stragglers = Stragglers()
        self._steps_at = 0.0  # monotonic time this node last published its step times
        self._stacks_polled_at = 0.0  # ... last looked for a `meshrun stacks` request
        self._stacks_answered: str | None = None  # the id of the last request answered
        self._signal: int | None = None
        # pass-through signals: (signum, when the handler ran, when the run loop last looked)
        self._warnings: list[tuple[int, float, float]] = []
        self._warnings_looked_at = 0.0  # monotonic time `_pass_on_warnings` last started
        self._reaper_saw: list[tuple[int, float]] = []  # ... that reached the reaper too
        self._group_started_at = 0.0  # monotonic time the running group was started
        self._watch: ProgressWatch | None = None
        self._log_root: Path | None = None
        self._temp_logs = False
        self._subreaper = False

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

        Exit codes (DESIGN.md §3.4): 0 success; the root-cause worker's exit status; 3 for a
        rendezvous or store failure; 128+N when stopped by signal N. Every step of the way is
        an event in ``events.jsonl`` in this agent's log directory (`meshrun.agent.events`).
        """
        code = 1
        try:
            code = self._run()
            return code
        finally:
            self._events.emit("agent_exit", code=code)
            self._events.close()

    def _run(self) -> int:
        previous = {s: signal.signal(s, self._on_signal) for s in self.config.signals_to_handle}
        for s in PASS_THROUGH:
            if s not in self.config.signals_to_handle:
                previous[s] = signal.signal(s, self._on_warning_signal)
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
            self._events = EventLog(
                log_dir / EVENT_FILE, self.host, console=self.config.event_log_handler == "console"
            )
            self._events.emit(
                "agent_start", node=self.node_id, nproc=self.config.nproc_per_node,
                run_id=self.run_id,
            )  # fmt: skip
            for s in take_early():  # warnings meshrun's entry point caught before our handlers
                if s in self.config.signals_to_handle:
                    self._on_signal(s, None)  # "stop", as if it came now
                else:
                    self._no_worker_warning(s)
            store, addr = self._interruptible(
                open_store,
                self.config.rdzv_backend,
                self.endpoint,
                self.settings,
                node_rank=self.config.node_rank,
            )
            self._note_loopback_store(store)
            me = NodeDesc(
                node_id=self.node_id,
                addr=self.config.local_addr or self._advertised(addr),
                nproc=self.config.nproc_per_node,
                node_rank_hint=self.config.node_rank,
            )
            bootstrap = BootstrapStore(
                self._bootstrap_bind(me.addr), port=workers_port(self.settings)
            )
            rdzv = Rendezvous(
                store, self.settings, me, host_bootstrap=lambda: self._open(bootstrap, me)
            )
            code = self._loop(rdzv, reaper, bootstrap)
            if store.serves_others and self._signal is None:  # a signal exits promptly
                rdzv.wait_for_others_to_leave()
            if code == EXIT_OK and self._temp_logs and self._log_root is not None:
                shutil.rmtree(self._log_root.parent, ignore_errors=True)
            return code
        except _Stopped as e:  # no workers ran (during rendezvous)
            say(f"received {signal.Signals(e.signum).name} during rendezvous; exiting")
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
            self._say_unpassed_warnings()
            if self._subreaper:
                become_subreaper(False)
            for s, handler in previous.items():
                signal.signal(s, handler)

    def _advertised(self, addr: str) -> str:
        """The address other nodes (and their workers, as MASTER_ADDR) reach this node at.

        ``addr`` is the local address on the route to the rendezvous store. In a job that may
        span machines it must not be a loopback address, unless the endpoint itself is one
        (every node then runs on this machine): a host name that maps to 127.0.1.1 (Debian's
        /etc/hosts) gives exactly that. Then the address on this host's default route (or
        its first non-loopback interface address) is advertised instead, with a note.

        Raises:
            ConfigError: a loopback address and no other address to advertise; the message
                names ``--local-addr``.
        """
        if self.config.max_nodes == 1 or not _is_loopback(addr):
            return addr
        endpoint_host = _endpoint_host(self.endpoint)
        if _is_loopback_literal(endpoint_host):
            return addr
        other = _non_loopback_address()
        if other is None:
            raise ConfigError(
                f"this node would tell other nodes to reach it at {addr}, a loopback address "
                f"(the rendezvous endpoint {endpoint_host} resolves to it here), and it has "
                "no other address; give --local-addr ADDR with an address the other nodes "
                "can reach, or fix the host name's entry in /etc/hosts"
            )
        say(
            f"note: the rendezvous endpoint {endpoint_host} resolves to the loopback address "
            f"{addr} here, which other nodes cannot reach; advertising {other} instead "
            "(give --local-addr to choose)"
        )
        return other

    def _note_loopback_store(self, store) -> None:
        """Say so when the rendezvous store this node hosts listens on a loopback address
        although the endpoint is a name (a host name that /etc/hosts maps to 127.0.1.1):
        other machines cannot reach it there."""
        bound = getattr(store, "host", "") if store.serves_others else ""
        endpoint_host = _endpoint_host(self.endpoint)
        if bound and _is_loopback_literal(bound) and not _is_loopback_literal(endpoint_host):
            say(
                f"note: the rendezvous endpoint {endpoint_host} resolves to the loopback address "
                f"{bound} here, so the store listens there only, where other machines cannot "
                "reach it; for nodes on other machines give --rdzv-endpoint an address of this "
                "host (or fix /etc/hosts), or --rdzv-conf bind_all=true"
            )

    def _bootstrap_bind(self, advertised: str) -> str:
        """The address the workers' store listens on when this node hosts it: the one it
        advertises as MASTER_ADDR (resolved here when a name), never the wildcard unless
        ``--rdzv-conf bind_all=true`` asks (""); 127.0.0.1 for a single-node job.

        Raises:
            ConfigError: the advertised address (``--local-addr``) is no address of this host.
        """
        if self.config.max_nodes == 1:
            return "127.0.0.1"
        if self.settings.bind_all:
            return ""
        addr = bind_address(advertised)
        if addr is None:
            given = " (--local-addr)" if self.config.local_addr else ""
            raise ConfigError(
                f"this node advertises {advertised}{given} to the workers as "
                "MASTER_ADDR, which is not an address of this host, so their store cannot "
                "listen on it; give --local-addr an address of this host, or --rdzv-conf "
                "bind_all=true to listen on every interface (e.g. behind NAT)"
            )
        return addr

    def _open(self, bootstrap: BootstrapStore, me: NodeDesc) -> tuple[str, int]:
        """Start the round's workers' store (on node rank 0); return its address."""
        bootstrap.close()
        try:
            return me.addr, bootstrap.open()
        except OSError as e:  # a --rdzv-conf workers_port=N that another process holds
            port = workers_port(self.settings) or "a free port"
            raise RendezvousError(
                f"cannot host the workers' store on {me.addr} port {port}: "
                f"{e.strerror or e} (is --rdzv-conf workers_port already in use?)"
            ) from None

    def _loop(self, rdzv: Rendezvous, reaper: Reaper, bootstrap: BootstrapStore) -> int:
        c = self.config
        while True:
            try:
                info = self._interruptible(rdzv.next_round)
            except JobFinished:
                say("the job finished while this node waited as a spare; exiting")
                rdzv.leave()
                return EXIT_OK
            except JobFailed as e:
                return self._final_failure(rdzv, e.round, [])
            self._start_group(info, reaper)
            bootstrap.serve()  # imports torch on a thread, after the workers are registered
            while True:
                result = self._group.wait(c.monitor_interval)
                if self._signal is not None:
                    return self._stop_by_signal()
                self._pass_on_warnings(reaper)
                self._group.follow_terminal()
                try:
                    bootstrap.check()  # before a failure it may explain
                    if result is not None and result.state is WorkerState.SUCCEEDED:
                        reason = self._interruptible(rdzv.exit_barrier, c.monitor_interval)
                        if reason is None:
                            # Say so before stopping what is left (a lingering descendant can
                            # take the whole grace): the store host waits for that, bounded.
                            rdzv.leave()
                            self._end_round(rdzv, bootstrap)
                            return EXIT_OK
                    elif result is not None:
                        reason = self._on_failure(rdzv, info, result)
                    elif self._watch is not None and (hung := self._watch.check()):
                        reason = self._on_hang(rdzv, hung)
                    else:
                        self._watch_steps(rdzv, info)
                        self._answer_stacks(rdzv, info)
                        reason = rdzv.poll()
                except _Stopped:  # signals win over failures: nothing spent, exit 128+N
                    return self._stop_by_signal()
                except BootstrapError as e:  # the workers cannot meet: the round cannot run
                    say(f"error: {e}")
                    self._end_round(rdzv, bootstrap)
                    return EXIT_RENDEZVOUS
                except JobFailed as e:
                    local = self._end_round(rdzv, bootstrap, fault=True)
                    return self._final_failure(rdzv, e.round, local)
                if reason is not None:
                    try:
                        moved = self._in_place(rdzv, reaper, bootstrap, info, reason)
                    except _Stopped:
                        return self._stop_by_signal()
                    except JobFinished:
                        rdzv.leave()
                        self._end_round(rdzv, bootstrap)
                        return EXIT_OK
                    except JobFailed as e:
                        local = self._end_round(rdzv, bootstrap, fault=True)
                        return self._final_failure(rdzv, e.round, local)
                    if moved is not None:
                        info = moved
                        continue
                    say(f"restarting the worker group: {reason}")
                    self._note_restart(info, reason)
                    fault = _NOT_A_FAULT.search(reason) is None
                    for f in self._end_round(rdzv, bootstrap, fault=fault):
                        if f.stopped:
                            say(f"stopped rank {f.global_rank}: {_place(f)}")
                    if self._signal is not None:  # it came while the group was stopped
                        return self._stop_by_signal()
                    break

    def _in_place(
        self, rdzv: Rendezvous, reaper: Reaper, bootstrap: BootstrapStore,
        info: RendezvousInfo, reason: str,
    ) -> RendezvousInfo | None:
        """The membership changed (a node lost, nodes waiting to join) and every local worker
        opted in to in-place recovery (`meshrun.in_place`): join the next round while they
        run, hand each its new environment (a worker whose peers are alive takes it at its
        next step; the joiners' fresh workers get the state from it by broadcast), and wait
        up to ``MESHRUN_IN_PLACE_TIMEOUT`` seconds (default `IN_PLACE_TIMEOUT_S`) for every
        one to confirm. Returns the new round, or None when the workers cannot take it in
        place (another reason, a worker that did not opt in or has exited): then the caller
        restarts the group as usual. A worker that does not confirm in time (or exits
        meanwhile) gets the usual treatment within the new round: the whole local group is
        stopped and started again there, with nothing spent.

        Raises:
            _Stopped: a handled signal; JobFinished, JobFailed: the job ended meanwhile.
        """
        if self._group is None or _MEMBERSHIP_CHANGE.search(reason) is None:
            return None
        running = self._group.running()
        if len(running) != len(self._group.specs) or not all(
            in_place.opted_in(spec.log_dir, pid) for spec, pid in running
        ):
            return None
        timeout = _in_place_timeout()
        say(f"{reason}: the workers opted in to in-place recovery; joining the next round "
            "while they run")  # fmt: skip
        self._note_restart(info, reason)
        t0 = time.monotonic()
        new = self._interruptible(rdzv.next_round)
        if new.node_rank != 0:  # node rank 0 of the new round reopened it in next_round
            bootstrap.close()
        bootstrap.serve()
        specs = [self._spec(new, s.local_rank, s.log_dir.parent) for s in self._group.specs]
        self._group.renumber(specs)
        pids = self._group.pids
        why = None
        try:
            for spec in specs:
                in_place.make_offer(spec.log_dir, new.round, dict(spec.env), timeout)
        except OSError as e:  # a full log disk: the workers cannot be told
            why = f"the offer could not be written: {e.strerror or e}"
        ranks = f"ranks {new.rank_offset}..{new.rank_offset + new.local_world_size - 1}"
        say(f"round {new.round}: node rank {new.node_rank} of {new.num_nodes}, {ranks} of "
            f"world size {new.world_size}, restart count {new.restart_count}"
            + ("" if why else f"; handed to the running workers (pids "
               f"{', '.join(map(str, pids))}), {timeout:g} s to confirm"))
        self._group_info = new
        self._failed_round = False
        self._steps.forget()
        self._stragglers.reset()
        if self._watch is not None:  # the wait for the round was the agent's, not a hang
            self._watch.rearm()
        self._events.emit(
            "round_start", round=new.round, node_rank=new.node_rank, num_nodes=new.num_nodes,
            world_size=new.world_size, rank_offset=new.rank_offset,
            local_world_size=new.local_world_size, restart_count=new.restart_count,
            in_place=True,
        )  # fmt: skip
        if why is None:
            why = self._await_confirmations(new.round, list(zip(specs, pids, strict=True)),
                                            timeout)
        if why is None:
            say(f"round {new.round}: every worker confirmed in place "
                f"({time.monotonic() - t0:.2f} s after the restart was decided)")  # fmt: skip
            self._events.emit("in_place", round=new.round, confirmed=True)
            for spec, pid in zip(specs, pids, strict=True):  # the same process, a new round
                self._events.emit(
                    "worker_start", round=new.round, rank=spec.global_rank,
                    local_rank=spec.local_rank, worker_pid=pid, in_place=True,
                )  # fmt: skip
            return new
        say(f"round {new.round}: in-place handover failed ({why}); stopping the worker group "
            "and starting it again in this round")  # fmt: skip
        self._events.emit("in_place", round=new.round, confirmed=False, reason=why)
        self._watch = None
        self._group.stop(self.config.shutdown_timeout)
        self._note_exits()
        self._group = None
        self._raise_if_signalled()
        if new.num_nodes == 1:
            # A worker that confirmed began to meet in the round's store before it was
            # stopped: its address is there, and a fresh worker could read it (gloo: refused,
            # retried, failed). The whole world is here, so it gets a store of its own.
            _, port = self._open(bootstrap, new.nodes[0])
            new = replace(new, master_port=port)
        self._start_group(new, reaper)
        bootstrap.serve()
        return new

    def _await_confirmations(
        self, round: int, workers: list[tuple[WorkerSpec, int]], timeout: float
    ) -> str | None:
        """Wait up to ``timeout`` seconds for each of ``workers`` (spec, pid) to confirm
        ``round``; None when all did, else why not (a worker exited; the ranks that did not
        confirm). Raises `_Stopped` on a handled signal."""
        deadline = time.monotonic() + timeout
        while True:
            workers = [(s, p) for s, p in workers if not in_place.confirmed(s.log_dir, round, p)]
            if self._group.wait(0) is not None:
                return "a worker exited"
            if not workers:
                return None
            if time.monotonic() >= deadline:
                late = ", ".join(str(s.global_rank) for s, _ in workers)
                return f"rank(s) {late} did not confirm within {timeout:g} s"
            self._group.wait(min(self.config.monitor_interval, 0.05))
            self._raise_if_signalled()

    def _on_failure(self, rdzv: Rendezvous, info: RendezvousInfo, result: GroupResult) -> str:
        first = result.failures[0]
        what = f"rank {first.global_rank} (local rank {first.local_rank}) {first.describe_exit()}"
        if info.num_nodes > 1 and any(_peer_lost(f) for f in result.failures):
            reason = self._settle(rdzv, what)
            if reason is not None:
                return reason  # a membership change: no restart spent, no failure published
        self._raise_if_signalled()
        self._failed_round = True
        rdzv.publish_failures([self._record(f) for f in result.failures])
        for f in result.failures:
            self._events.emit(
                "failure", round=info.round, rank=f.global_rank, exitcode=f.exitcode,
                message=_first_line(f.message) or f.describe_exit(),
            )  # fmt: skip
        state, _ = rdzv.read_state()
        if state.restarts >= self.settings.max_restarts and state.round == info.round:
            say(
                f"worker failure: {what}; no restarts left (--max-restarts {self.settings.max_restarts})"
            )
        else:
            say(
                f"worker failure: {what}; restart {state.restarts + 1} of "
                f"{self.settings.max_restarts}"
            )
        return rdzv.request_restart(f"worker failure on {self.host}: {what}", failure=True)

    def _settle(self, rdzv: Rendezvous, what: str) -> str | None:
        """A worker failed the way workers fail when a peer vanished (its connection closed):
        wait for the rendezvous to tell a membership change (a lost node, a node joining,
        another node moving the round on). Returns its reason, or None when none came within
        twice the dead-node bound (plus one keep-alive interval): a real failure. Raises
        `_Stopped` when a handled signal arrives meanwhile (a scheduler cancelling the job
        kills peers first): the signal wins, the failure is neither published nor spent.

        The worker usually sees the peer's sockets close well before the heartbeats can prove
        the node dead; without this wait a lost node would spend a restart of the job's budget
        on every survivor's first failure. A failure elsewhere moves the round on at once, so
        the whole bound is waited only for a connection failure nobody else explains."""
        bound = 2 * self.settings.dead_after + self.settings.keep_alive_interval
        say(
            f"worker failure: {what} (a peer's connection closed); waiting up to {bound:g} s "
            f"for the rendezvous to tell a lost node from a failure"
        )
        deadline = time.monotonic() + bound
        while time.monotonic() < deadline:
            self._raise_if_signalled()
            reason = self._interruptible(rdzv.poll)
            if reason is not None:
                return reason
            time.sleep(min(self.config.monitor_interval, self.settings.keep_alive_interval))
        return None

    def _on_hang(self, rdzv: Rendezvous, hung: list[Hang]) -> str:
        """Some rank made no progress for --hang-timeout: take every local rank's stack (in
        parallel, bounded), name the likely culprit, publish the hung ranks as failures (exit
        status 124) and the others as stopped, spend one restart."""
        timeout = self.config.hang_timeout
        idle = {h.local_rank: h for h in hung}
        records = []
        for r in self._take_stacks():  # every rank of a hung group is part of the hang
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
            return rdzv.poll() or "the hung ranks exited while their stacks were taken"
        blamed, why = culprits(records)
        first = root_cause(records)
        if blamed:
            waiting = sorted(
                f.global_rank for f in records if f.state == "waiting" and f.global_rank not in blamed
            )
            by_rank = {f.global_rank: f for f in records}
            named = "; ".join(f"rank {g} at {by_rank[g].at}" for g in blamed)
            say(f"hang: likely cause {named} ({why}); waiting: ranks {_ranges(waiting)}")
        else:
            say(f"rank {first.global_rank} {first.message}" + (f" ({why})" if why else ""))
        found = disagreement(records)
        if found is not None:
            say(f"hang: collectives: {found.line}")
        self._raise_if_signalled()  # collecting stacks takes up to seconds: a signal may come
        self._failed_round = True
        self._stacks_taken = True
        self._events.emit(
            "hang", round=self._group_info.round, culprits=blamed or [first.global_rank],
            waiting=sorted(f.global_rank for f in records if f.state == "waiting"),
        )  # fmt: skip
        rdzv.publish_failures([self._record(f) for f in records])
        culprit = f"rank {blamed[0]}" if blamed else f"rank {first.global_rank}"
        return rdzv.request_restart(
            f"hang on {self.host}: {culprit} made no progress for {timeout:g} s"
            + (f" ({why})" if blamed else ""),
            failure=True,
        )

    def _take_stacks(self) -> list[WorkerFailure]:
        """Where each running worker of the group is: its stack (all at once, at most
        `STACKS_TIMEOUT_S` in all), classified (`meshrun.agent.stacks.classify`) with its
        progress counters, as a ``stopped`` record per rank. [] when none runs."""
        if self._group is None:
            return []
        running = self._group.running()
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
        stacks = collect_stacks(targets, abort=lambda: self._signal is not None)
        if os.environ.get(RECORD_ENV) != "0":
            wait_current([spec.log_dir / RECORD_FILE for spec, _ in running], since,
                         abort=lambda: self._signal is not None)  # fmt: skip
        records = []
        for spec, pid in running:
            stack = stacks[spec.local_rank]
            progress = self._watch.sample(spec.local_rank) if self._watch is not None else None
            where = classify(stack.main, progress.blocked if progress else None)
            records.append(WorkerFailure(
                local_rank=spec.local_rank,
                global_rank=spec.global_rank,
                pid=pid,
                exitcode=-signal.SIGTERM,
                timestamp_ms=int(time.time() * 1000),
                host=self.host,
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

    def _record(self, failure: WorkerFailure) -> dict:
        """The failure as published to the store: this node's host and node rank, message and
        traceback capped (`WorkerFailure.capped`: a few KB per rank, so a whole round's
        records fit in one store request)."""
        return json.loads(self._here(failure).capped().to_json())

    def _here(self, failure: WorkerFailure) -> WorkerFailure:
        return replace(failure, host=self.host, node_rank=self._group_info.node_rank)

    def _final_failure(self, rdzv: Rendezvous, round: int, local: list[WorkerFailure]) -> int:
        """Print the job-wide root-cause report; return the root-cause worker's exit status,
        or 128+N when a handled signal N arrived meanwhile (signals win over failures)."""
        try:
            if local and rdzv.info is not None and rdzv.info.round == round:
                rdzv.publish_failures([self._record(f) for f in local])
            records = self._interruptible(rdzv.collect_failures, round)
            rdzv.leave()
        except _Stopped as e:
            say(
                f"received {signal.Signals(e.signum).name} while the job's failure was being "
                "reported; exiting"
            )
            return 128 + e.signum
        except RendezvousError:  # the store is gone: report what this node saw
            records = [self._record(f) for f in local]
        failures = [WorkerFailure.from_json(json.dumps(r)) for r in records]
        if local:  # this node's own failures are reported with more than was published
            mine = {f.global_rank: self._here(f).capped(_LOCAL_REPORT_MAX_BYTES) for f in local}
            here = self._group_info.node_rank
            failures = [mine.get(f.global_rank, f) if f.node_rank == here else f for f in failures]
        if all(f.stopped for f in failures):
            say("error: the job failed on another node, which published no failure record")
            if failures:
                print(format_report(failures), file=sys.stderr, flush=True)
            return 1
        print(format_report(failures), file=sys.stderr, flush=True)
        if self._signal is not None:  # it came while the group was being stopped
            say(f"received {signal.Signals(self._signal).name}; exiting")
            return 128 + self._signal
        return root_cause(failures).exit_status

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
        self._failed_round = False
        self._group = WorkerGroup(
            specs,
            reaper,
            duplicate_stdout_filters=c.duplicate_stdout_filters,
            duplicate_stderr_filters=c.duplicate_stderr_filters,
            filtered_dir=attempt_dir,
            adopt_orphans=self._subreaper,
        )
        self._stacks_taken = False
        self._watch = None
        try:  # the files exist before any worker can beat
            self._watch = ProgressWatch([s.log_dir for s in specs], c.hang_timeout)
        except OSError as e:  # a full log disk: train on, unwatched (heartbeat copes)
            what = "hang detection" if c.hang_timeout is not None else "progress counters"
            say(f"{what} off for round {info.round}: cannot write a progress "
                f"file ({e.strerror}: {e.filename}); is the log disk full?")
        self._group.start()
        self._group_started_at = time.monotonic()
        self._steps.forget()
        self._stragglers.reset()
        self._events.emit(
            "round_start", round=info.round, node_rank=info.node_rank,
            num_nodes=info.num_nodes, world_size=info.world_size, rank_offset=info.rank_offset,
            local_world_size=info.local_world_size, restart_count=info.restart_count,
        )  # fmt: skip
        for spec, pid in zip(self._group.specs, self._group.pids, strict=True):
            self._events.emit(
                "worker_start", round=info.round, rank=spec.global_rank,
                local_rank=spec.local_rank, worker_pid=pid,
            )  # fmt: skip

    def _spec(self, info: RendezvousInfo, local_rank: int, attempt_dir: Path) -> WorkerSpec:
        c = self.config
        rank = info.rank_offset + local_rank
        log_dir = attempt_dir / str(local_rank)
        env = worker_env(c, info, local_rank, error_file=log_dir / "error.json")
        env.update(progress_env(log_dir))
        env.update(record_env(log_dir))
        env.update(in_place.channel_env(log_dir))
        args = tuple(a.replace("${local_rank}", str(local_rank)) for a in c.args)
        shown = c.local_ranks_filter is None or local_rank in c.local_ranks_filter
        redirect, tee = c.redirects.for_rank(local_rank), c.tee.for_rank(local_rank)
        prefix = ""
        shared = (c.nproc_per_node > 1 or c.max_nodes > 1) and not c.raw_console
        if tee or shared:
            if c.log_line_prefix_template:
                prefix = _template_prefix(c.log_line_prefix_template, c.role, rank, local_rank)
            else:
                prefix = f"[{self.host}:{rank}]: "
        return WorkerSpec(
            local_rank=local_rank,
            global_rank=rank,
            argv=(*c.entrypoint, *args),
            env=env,
            log_dir=log_dir,
            console_out=shown and (not (redirect & Std.OUT) or bool(tee & Std.OUT)),
            console_err=shown and (not (redirect & Std.ERR) or bool(tee & Std.ERR)),
            prefix=prefix,
            host=self.host,
            node_rank=info.node_rank,
            log_max_bytes=c.log_max_bytes,
        )

    def _end_round(
        self, rdzv: Rendezvous, bootstrap: BootstrapStore, *, fault: bool = False
    ) -> list[WorkerFailure]:
        """Stop the group and close the round's bootstrap store; return the ranks that failed
        on their own this round (`WorkerGroup.failures`) and, after a ``fault`` (a failure, a
        hang or a lost node, here or elsewhere), a ``stopped`` record of every rank that was
        still running: where it was, from the stack taken just before the stop. After a
        failure, the ranks that failed a moment after the first (they were not in its report
        yet) are published too."""
        stopped = self._take_stacks() if fault and not self._stacks_taken else []
        if stopped:  # at once: a node that reports before this one's stop ends still has them
            try:
                rdzv.publish_failures([self._record(f) for f in stopped])
            except RendezvousError:
                pass  # the store is gone: this node's own report still lists them
        self._watch = None
        failures: list[WorkerFailure] = []
        if self._group is not None:  # a signal that came meanwhile is what the workers get
            self._group.stop(self.config.shutdown_timeout, death_sig=self._signal or signal.SIGTERM)
            failures = self._group.failures()
            stopped = [self._last_words(f) for f in stopped]
            self._note_exits()
            self._group = None
        bootstrap.close()
        failed = {f.global_rank for f in failures}
        stopped = [f for f in stopped if f.global_rank not in failed]  # it failed meanwhile
        if self._failed_round and failures:
            rdzv.publish_failures([self._record(f) for f in failures])
        return failures + stopped

    def _last_words(self, f: WorkerFailure) -> WorkerFailure:
        """A stopped rank whose stack did not place it (none taken, or no main thread in it:
        it was exiting) but whose last stderr lines are a Python traceback (it was raising
        when the stop came: its own gloo timeout, torch's desync check) is placed by that
        traceback instead."""
        if f.state not in ("unknown", ""):
            return f
        tail = self._group.stderr_tail(f.local_rank)
        if "Traceback (most recent call last)" not in tail:
            return f
        where = classify(traceback_frames(tail))
        if where.state == "unknown":
            return f
        return replace(f, traceback=tail, source="stderr", state=where.state,
                       collective=where.collective, at=where.at,
                       stack_problem="; ".join(filter(None, [f.stack_problem, "placed by its "
                                                             "last stderr lines"])))  # fmt: skip

    # -- what the timeline and the straggler check see -----------------------------------------
    def _note_exits(self) -> None:
        """One ``worker_exit`` event per worker of the group just stopped."""
        for spec, code, stopped in self._group.outcomes():
            fields = {"exitcode": code if code is None or code >= 0 else None}
            if code is not None and code < 0:
                fields["signal"] = _signal_name(-code)
            self._events.emit(
                "worker_exit", round=self._group_info.round, rank=spec.global_rank,
                local_rank=spec.local_rank, stopped=stopped, **fields,
            )  # fmt: skip

    def _note_restart(self, info: RendezvousInfo, reason: str) -> None:
        """The ``restart`` event, and ``node_lost`` / ``join`` when the reason says so."""
        lost = re.search(r"node (\S+) lost", reason)
        if lost:
            self._events.emit("node_lost", node=lost[1], round=info.round)
        joining = re.search(r"(\d+) node\(s\) waiting to join", reason)
        if joining:
            self._events.emit("join", nodes=int(joining[1]), round=info.round + 1)
        spent = reason.startswith(("worker failure", "hang"))
        self._events.emit("restart", round=info.round, reason=_first_line(reason), spent=spent)

    def _watch_steps(self, rdzv: Rendezvous, info: RendezvousInfo) -> None:
        """Per-rank step and busy times from the progress counters (`meshrun.agent.stragglers`):
        sampled every tick; every `STEP_TIMES_EVERY_S` this node publishes its ranks' times, and
        node rank 0 checks the whole job's for stragglers (one warning line per straggler)."""
        if self._watch is None or self._group is None:
            return
        now = time.monotonic()
        for spec in self._group.specs:
            p = self._watch.sample(spec.local_rank)
            if p.heartbeats:
                self._steps.observe(spec.global_rank, p.heartbeats, p.blocked_ns, now)
        if now - self._steps_at < STEP_TIMES_EVERY_S:
            return
        self._steps_at = now
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
            self._events.emit("straggler", round=info.round, rank=s.rank, step_s=s.step_s,
                              busy_s=s.busy_s, median_s=s.median_s, steps=s.steps)  # fmt: skip

    def _answer_stacks(self, rdzv: Rendezvous, info: RendezvousInfo) -> None:
        """Every `STACKS_POLL_S`, look for a ``meshrun stacks`` request in the store (multi-node
        jobs: a one-node job's store is in this process, and ``meshrun stacks LOGDIR`` reads
        the workers directly); answer a new one with this node's ranks' places and stacks
        (taken as for a failure report, at most `STACKS_TIMEOUT_S`; the job goes on)."""
        now = time.monotonic()
        if info.num_nodes == 1 or now - self._stacks_polled_at < STACKS_POLL_S:
            return
        self._stacks_polled_at = now
        request = rdzv.stacks_request()
        if request is None or request == self._stacks_answered:
            return
        self._stacks_answered = request
        records = [self._record(f) for f in self._take_stacks()]
        rdzv.publish_stacks(request, json.dumps(records).encode())

    def _host_of(self, rank: int, info: RendezvousInfo) -> str:
        lo, hi = info.rank_offset, info.rank_offset + info.local_world_size
        return self.host if lo <= rank < hi else "another node"

    # -- signals -------------------------------------------------------------------------------
    def _on_signal(self, signum: int, frame) -> None:
        # Only recorded: the run loop acts on it within one monitor interval, forwarding it to
        # the workers once (WorkerGroup.stop(death_sig=signum)), never from inside a handler.
        if self._signal is None:
            self._signal = signum

    def _on_warning_signal(self, signum: int, frame) -> None:
        # SIGUSR1/SIGUSR2, not in --signals-to-handle: the schedulers' "save soon"; recorded
        # here, passed on by the run loop (`_pass_on_warnings`); the job goes on.
        self._warnings.append((signum, time.monotonic(), self._warnings_looked_at))

    def _pass_on_warnings(self, reaper: Reaper) -> None:
        """Give each worker a pass-through signal (SIGUSR1/2) the agent received, exactly once.

        SLURM's proctrack/linuxproc and cgroup signal every process of the job step, so the
        workers got it already; proctrack/pgid and a ``kill`` aimed at the agent reach the
        agent (and its process group) only. The reaper, in a session of its own, tells the
        two apart: it got the signal too only in the first case. The agent decides
        `_PROBE_WINDOW_S` after the signal came, and forwards it to every worker's process
        group in the second case."""
        now = self._warnings_looked_at = time.monotonic()
        # The reaper's times are when the signal came. The agent's handler runs later, on the
        # main thread, when it next runs Python (after a wait() of up to a monitor interval,
        # or a thread holding the GIL): the signal came after the loop last looked (`since`).
        self._reaper_saw += reaper.signals_seen()
        horizon = min((since for _, _, since in self._warnings), default=now)
        self._reaper_saw = [(n, t) for n, t in self._reaper_saw
                            if t >= horizon - 2 * _PROBE_WINDOW_S]  # fmt: skip
        while self._warnings and now - self._warnings[0][1] >= _PROBE_WINDOW_S:
            signum, at, since = self._warnings.pop(0)
            name = _signal_name(signum)
            step_wide = next((i for i, (n, t) in enumerate(self._reaper_saw) if n == signum
                              and since - 2 * _PROBE_WINDOW_S <= t <= at + 2 * _PROBE_WINDOW_S),
                             None)  # fmt: skip
            passed = False
            if step_wide is not None:
                del self._reaper_saw[step_wide]
                say(f"received {name}, sent to the whole job step: the workers got it too; "
                    "the job goes on")  # fmt: skip
            elif self._group is not None and at >= self._group_started_at:
                self._group.signal(signum)
                passed = True
                say(f"received {name}: passed to every worker; the job goes on")
            else:
                self._no_worker_warning(signum)
                continue
            self._events.emit("signal", signal=name, passed_on=passed)

    def _say_unpassed_warnings(self) -> None:
        """At the end: the warnings still waiting to be passed on (the job ended, or its
        rendezvous failed, within `_PROBE_WINDOW_S` of them) are said, never dropped."""
        while self._warnings:
            signum, _, _ = self._warnings.pop(0)
            name = _signal_name(signum)
            say(f"received {name} as the job ended; not passed on")
            self._events.emit("signal", signal=name, passed_on=False)

    def _no_worker_warning(self, signum: int) -> None:
        """A warning that came while no worker ran: nobody to pass it to; said, and an event."""
        name = _signal_name(signum)
        say(f"received {name} while no worker ran; the job goes on")
        self._events.emit("signal", signal=name, passed_on=False)

    def _raise_if_signalled(self) -> None:
        """Raise `_Stopped` when a handled signal arrived (checked before spending anything)."""
        if self._signal is not None:
            raise _Stopped(self._signal)

    def _interruptible(self, fn, *args, **kwargs):
        """Run a blocking rendezvous call on a thread, so a signal is acted on at once.

        A call blocked inside TCPStore (C++) would delay Python's signal handlers until it
        returns; the main thread stays free instead. Raises `_Stopped` on a handled signal.
        """
        self._raise_if_signalled()  # one that came before (a fast call has no join to see it)
        outcome: list = []

        def call() -> None:
            try:
                outcome.append((True, fn(*args, **kwargs)))
            except BaseException as e:  # noqa: BLE001 - re-raised on the main thread
                outcome.append((False, e))

        thread = threading.Thread(target=call, name="meshrun-rendezvous", daemon=True)
        thread.start()
        while thread.is_alive():
            thread.join(0.05)
            self._raise_if_signalled()
        self._raise_if_signalled()  # one that came as the call ended: before anything starts
        ok, value = outcome[0]
        if not ok:
            raise value
        return value

    def _stop_by_signal(self) -> int:
        """Forward the handled signal to the workers (once), one grace period, exit 128+N."""
        name = signal.Signals(self._signal).name
        say(
            f"received {name}: forwarded to the workers; stopping them "
            f"(grace {self.config.shutdown_timeout:g} s)"
        )
        self._watch = None
        if self._group is not None:
            self._group.stop(self.config.shutdown_timeout, death_sig=self._signal)
            self._note_exits()
            self._group = None
        return 128 + self._signal


# How a worker's failure reads when a peer process vanished under it: gloo and NCCL report the
# closed connection; the failure is then a consequence of a membership change, not its cause.
_PEER_LOST = re.compile(
    r"Connection (?:closed|reset) by peer|Broken pipe|ECONNRESET|"
    r"remote process exited|NCCL communicator was aborted",
    re.IGNORECASE,
)


# The restart reasons that in-place recovery takes: a membership change (a node lost, nodes
# waiting to join), never a failure or a hang.
_MEMBERSHIP_CHANGE = re.compile(r"^(?:node \S+ lost|\d+ node\(s\) waiting to join)$")
#: Seconds a worker that opted in to in-place recovery has to confirm a new round
#: (``MESHRUN_IN_PLACE_TIMEOUT`` in the agent's environment overrides it).
IN_PLACE_TIMEOUT_S = 10.0


def _in_place_timeout() -> float:
    raw = os.environ.get("MESHRUN_IN_PLACE_TIMEOUT", "")
    try:
        value = float(raw)
    except ValueError:
        return IN_PLACE_TIMEOUT_S
    return value if value > 0 else IN_PLACE_TIMEOUT_S


#: The schedulers' warning signals (SLURM ``--signal=USR1@N``): passed to the workers once and
#: the job goes on, unless listed in --signals-to-handle (then torchrun's meaning: stop).
PASS_THROUGH = (signal.SIGUSR1, signal.SIGUSR2)
#: Seconds the agent waits after a warning signal to learn whether the reaper got it too.
_PROBE_WINDOW_S = 0.3
#: Seconds between two publications of a node's step times (and straggler checks).
STEP_TIMES_EVERY_S = 2.0
#: Seconds between two looks for a ``meshrun stacks`` request (one store read each).
STACKS_POLL_S = 1.0


def _first_line(text: str, max_chars: int = 200) -> str:
    line = text.strip().split("\n", 1)[0] if text else ""
    return line if len(line) <= max_chars else line[: max_chars - 3] + "..."


def _signal_name(signum: int) -> str:
    try:
        return signal.Signals(signum).name
    except ValueError:
        return f"signal {signum}"


def _place(f: WorkerFailure) -> str:
    """Where a stopped rank was, in one line: "waiting in barrier at x.py:3 in f; stack: P"."""
    place = describe_place(f)
    found = f"; stack: {f.stack_path}" if f.stack_path else f" ({f.stack_problem})"
    return f"{place} at {f.at}{found}"


def _comparable_count(progress, frames) -> int:
    """The rank's count of meshrun.parallel collectives issued, or -1 where it cannot be
    compared with other ranks' (no counters; a pipeline stage, whose sends, receives and
    bucket counts differ from other stages' by design)."""
    if progress is None or any("meshrun/parallel/pipelining" in f.file for f in frames):
        return -1
    return progress.collectives


def _ranges(ranks: list[int]) -> str:
    """``[0, 1, 2, 5]`` -> "0-2, 5"."""
    out: list[str] = []
    for r in sorted(ranks):
        if out and out[-1].split("-")[-1] == str(r - 1):
            out[-1] = f"{out[-1].split('-')[0]}-{r}"
        else:
            out.append(str(r))
    return ", ".join(out) or "none"


def _peer_lost(failure: WorkerFailure) -> bool:
    return bool(_PEER_LOST.search(failure.message) or _PEER_LOST.search(failure.traceback))


def _endpoint_host(endpoint: str) -> str:
    """The host of the first ``host[:port]`` in a (comma-separated) endpoint list."""
    first = endpoint.split(",")[0].strip()
    first = first.split("://", 1)[-1]  # etcd endpoints may carry a scheme
    try:
        from meshrun.rendezvous.c10d import parse_endpoint

        return parse_endpoint(first)[0]
    except ValueError:
        return first


def _is_loopback_literal(host: str) -> bool:
    """Whether ``host`` is "localhost" or a loopback address literal (127.0.0.0/8, ::1)."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def _is_loopback(addr: str) -> bool:
    """Whether ``addr`` is, or (a name) resolves only to, loopback addresses."""
    if _is_loopback_literal(addr):
        return True
    try:
        ipaddress.ip_address(addr)
        return False
    except ValueError:
        pass
    try:
        infos = socket.getaddrinfo(addr, None)
    except (OSError, UnicodeError):
        return False
    return bool(infos) and all(_is_loopback_literal(i[4][0].split("%")[0]) for i in infos)


def _non_loopback_address() -> str | None:
    """This host's address on its default route (a UDP connect sends nothing), else its first
    IPv4 (then IPv6) address on an interface that is up and neither loopback nor link-local;
    None when it has none."""
    for family, probe in ((socket.AF_INET, "198.51.100.1"), (socket.AF_INET6, "2001:db8::1")):
        try:
            with socket.socket(family, socket.SOCK_DGRAM) as s:
                s.connect((probe, 9))
                found = s.getsockname()[0]
            if not ipaddress.ip_address(found.split("%")[0]).is_loopback:
                return found
        except (OSError, ValueError):
            pass
    import psutil

    stats = psutil.net_if_stats()
    for family in (socket.AF_INET, socket.AF_INET6):
        for name, entries in psutil.net_if_addrs().items():
            if name in stats and not stats[name].isup:
                continue
            for entry in entries:
                if entry.family != family:
                    continue
                ip = ipaddress.ip_address(entry.address.split("%")[0])
                if not (ip.is_loopback or ip.is_link_local):
                    return str(ip)
    return None


def is_secret_env(name: str) -> bool:
    """Whether meshrun reads a secret from the environment variable ``name`` (`SECRET_ENV`,
    or a ``MESHRUN_*`` name with SECRET, PASSWORD or TOKEN in it); such a variable is kept out
    of the workers' environment."""
    return name in SECRET_ENV or _SECRET_ENV_PATTERN.fullmatch(name) is not None


def worker_env(
    config: LaunchConfig, info: RendezvousInfo, local_rank: int, *, error_file: Path
) -> dict[str, str]:
    """The environment of one worker: the agent's own, plus torchrun's contract (DESIGN §3.1),
    less the variables meshrun reads secrets from (`is_secret_env`).

    Names and meanings are torchrun's (``LocalElasticAgent._start_workers``), so
    ``torch.distributed.is_torchelastic_launched()`` is true and ``init_process_group("env://")``
    connects to this round's bootstrap store as a client.
    """
    rank = info.rank_offset + local_rank
    env = {k: v for k, v in os.environ.items() if not is_secret_env(k)}
    for name, original in AGENT_ONLY_ENV.items():  # what the agent set for itself only
        if original is None:
            env.pop(name, None)
        else:
            env[name] = original
    env.update(
        RANK=str(rank),
        LOCAL_RANK=str(local_rank),
        WORLD_SIZE=str(info.world_size),
        LOCAL_WORLD_SIZE=str(info.local_world_size),
        GROUP_RANK=str(info.node_rank),
        GROUP_WORLD_SIZE=str(info.num_nodes),
        ROLE_NAME=config.role,
        ROLE_RANK=str(rank),
        ROLE_WORLD_SIZE=str(info.world_size),
        MASTER_ADDR=info.master_addr,
        MASTER_PORT=str(info.master_port),
        TORCHELASTIC_RESTART_COUNT=str(info.restart_count),
        TORCHELASTIC_MAX_RESTARTS=str(config.max_restarts),
        TORCHELASTIC_RUN_ID=info.run_id,
        TORCHELASTIC_USE_AGENT_STORE="True",
        TORCHELASTIC_ERROR_FILE=str(error_file),
        TORCH_NCCL_ASYNC_ERROR_HANDLING=os.environ.get("TORCH_NCCL_ASYNC_ERROR_HANDLING", "1"),
        MESHRUN_ROUND=str(info.round),
    )
    if "OMP_NUM_THREADS" not in os.environ and config.nproc_per_node > 1:
        env["OMP_NUM_THREADS"] = "1"
    if config.desync_check:  # torch's fingerprint check before every collective
        env["TORCH_DISTRIBUTED_DEBUG"] = "DETAIL"
    # the exit guard (torch's teardown must not fail a finished script) and the collective
    # record start from the worker site
    if env.get(exit_guard.OFF_ENV) != "0" or env.get(RECORD_ENV) != "0":
        env["PYTHONPATH"] = os.pathsep.join([WORKER_SITE, *_path_entries(env.get("PYTHONPATH"))])
    if config.virtual_local_rank:
        visible = os.environ.get("CUDA_VISIBLE_DEVICES")
        devices = visible.split(",") if visible else [str(i) for i in range(config.nproc_per_node)]
        env["LOCAL_RANK"] = "0"
        env["CUDA_VISIBLE_DEVICES"] = devices[local_rank % len(devices)]
    return env


# Leads every worker's PYTHONPATH: its sitecustomize installs `meshrun.exit_guard` and starts
# the collective record (`meshrun.agent.collectives`), then runs the script's own
# sitecustomize, if any.
WORKER_SITE = str(Path(__file__).resolve().parent / "worker_site")


def _path_entries(pythonpath: str | None) -> list[str]:
    """The entries of a PYTHONPATH value, less the worker site (a nested meshrun's agent); an
    empty entry (the current directory) is kept."""
    if not pythonpath:
        return []
    return [p for p in pythonpath.split(os.pathsep) if p != WORKER_SITE]


def _template_prefix(template: str, role: str, rank: int, local_rank: int) -> str:
    from string import Template

    return Template(template).safe_substitute(role_name=role, rank=rank, local_rank=local_rank)
