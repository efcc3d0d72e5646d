"""One node's worker processes: spawn, watch, signal and stop them.

A :class:`WorkerGroup` owns the local workers of one rendezvous round (torch's
``SubprocessContext`` plus the parts of ``LocalElasticAgent`` that start and stop it).

- Each worker runs in its own session and process group (``Popen(start_new_session=True)``;
  no ``preexec_fn``, which is unsafe in a threaded agent), so it can be signalled as a whole
  tree with ``killpg`` and terminal signals aimed at the agent do not reach it directly. The
  group id is registered with the :class:`~meshrun.agent.reaper.Reaper`, which kills it if
  the agent dies.
- One waiter thread per worker blocks in ``waitid(WEXITED | WNOWAIT)`` and records the exit and
  the time it observed it; :meth:`WorkerGroup.wait` sleeps on a condition that those threads
  notify, so it returns as soon as the outcome is decided (no polling: restart latency
  matters). The waiter does not reap: an exited worker stays a zombie, which keeps its pid and
  its process group id from being reused, until :meth:`WorkerGroup.stop` has sent its last
  signal. So no pid or group is ever signalled after it was reaped (it could belong to someone
  else's process by then).
- With ``adopt_orphans`` (the agent is a child subreaper, `become_subreaper`), processes that
  a worker's tree double-forked away (daemons re-parented to the agent) are part of the tree:
  :meth:`WorkerGroup.stop` signals, kills and reaps them with the rest.
- stdout and stderr are pipes forwarded by :mod:`meshrun.agent.logs`.
- :meth:`WorkerGroup.stop` is the one way down on every path: SIGTERM to every group (and to
  descendants that left it, and adopted orphans), one grace period for all, then SIGKILL to
  whatever is left, reap, drain the pipes, close the files.

This module imports nothing heavy (no torch).
"""

from __future__ import annotations

import enum
import os
import signal as _signal
import socket
import subprocess
import threading
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import BinaryIO

import psutil

from meshrun.agent import process_tree
from meshrun.agent.collectives import RECORD_FILE, read_record, summary
from meshrun.agent.console import Console, console
from meshrun.agent.errors import WorkerFailure, read_error_file
from meshrun.agent.logs import FilteredSink, PipeForwarder, StderrTail
from meshrun.agent.process_tree import become_subreaper, quiet_killpg, quiet_signal, reap_orphans
from meshrun.agent.ptys import open_pty, set_size, terminal_size
from meshrun.agent.reaper import Reaper

__all__ = ["GroupResult", "WorkerGroup", "WorkerSpec", "WorkerState", "become_subreaper"]

# After a worker exited and its group was killed, how long its pipes may stay open (held by a
# descendant that escaped) before the forwarders stop waiting for EOF.
_DRAIN_TIMEOUT_S = 1.0
# How long wait() gives a failed worker's stderr forwarder to reach EOF, so the report has the
# last lines. Normally EOF arrives within milliseconds of the exit.
_TAIL_SETTLE_S = 0.5
_POLL_S = process_tree.POLL_S  # the wait for processes that give no event to wait on

@dataclass(frozen=True)
class WorkerSpec:
    """Everything needed to start one worker process.

    Attributes:
        local_rank, global_rank: ``LOCAL_RANK`` and ``RANK`` (for logs and reports; the agent
            has already put them in ``env``).
        argv: the full, final command line (e.g. ``(sys.executable, "-u", "train.py", ...)``).
        env: the child's complete environment, including ``TORCHELASTIC_ERROR_FILE``.
        log_dir: this worker's directory (created if missing): ``stdout.log`` and
            ``stderr.log`` are written there.
        console_out, console_err: copy stdout / stderr to the agent's stdout / stderr.
        prefix: inserted at the start of every console line ("" = none), e.g. "[host:3]: ".
        cwd: the working directory, or None for the agent's.
        host, node_rank: where this runs, for failure reports (host "" = this machine's name).
        log_max_bytes: rotate each of the worker's log files before it passes this many bytes
            (``--log-max-bytes``; see `meshrun.agent.logs.LogFile`), or None: never.
    """

    local_rank: int
    global_rank: int
    argv: tuple[str, ...]
    env: Mapping[str, str]
    log_dir: Path
    console_out: bool
    console_err: bool
    prefix: str = ""
    cwd: str | None = None
    host: str = ""
    node_rank: int = 0
    log_max_bytes: int | None = None

    @property
    def error_file(self) -> str | None:
        """The path torch's ``@record`` writes to (``TORCHELASTIC_ERROR_FILE``), or None."""
        return self.env.get("TORCHELASTIC_ERROR_FILE") or None


class WorkerState(enum.Enum):
    """The decided outcome of a group (the two final values of torch's ``WorkerState``)."""

    SUCCEEDED = "SUCCEEDED"
    FAILED = "FAILED"


@dataclass
class GroupResult:
    """The outcome of a :class:`WorkerGroup` (torch's ``RunResult``).

    Attributes:
        state: SUCCEEDED when every worker exited 0; FAILED as soon as one did not.
        failures: the workers that failed so far, sorted by observed exit time, then global
            rank (so ``failures[0]`` is the local root cause).
    """

    state: WorkerState
    failures: list[WorkerFailure] = field(default_factory=list)


class WorkerGroup:
    """The worker processes of one node for one round.

    Args:
        specs: one :class:`WorkerSpec` per local worker.
        reaper: a started :class:`Reaper` to register each worker's process group with, or
            None (then a killed agent leaves its workers running).
        duplicate_stdout_filters, duplicate_stderr_filters: torchrun's duplicate filters (see
            :mod:`meshrun.agent.logs`): console lines containing any of the strings are also
            written to ``filtered_dir/filtered_stdout.log`` / ``filtered_stderr.log``.
        filtered_dir: where those files go; required when a filter list is non-empty.
        console_stdout, console_stderr: the binary streams console copies go to (default: the
            agent's ``sys.stdout.buffer`` / ``sys.stderr.buffer`` at the time of each write).
        adopt_orphans: this process is a child subreaper (`become_subreaper`) and runs no
            other children than these workers and the reaper: every other child of it at
            :meth:`stop` is an orphan of a worker's tree, stopped and reaped with the group.

    Raises:
        ValueError: filters without ``filtered_dir``, or duplicate global ranks.
    """

    def __init__(
        self,
        specs: Sequence[WorkerSpec],
        reaper: Reaper | None,
        *,
        duplicate_stdout_filters: Sequence[str] = (),
        duplicate_stderr_filters: Sequence[str] = (),
        filtered_dir: Path | None = None,
        console_stdout: BinaryIO | None = None,
        console_stderr: BinaryIO | None = None,
        adopt_orphans: bool = False,
    ) -> None:
        if (duplicate_stdout_filters or duplicate_stderr_filters) and filtered_dir is None:
            raise ValueError(
                "WorkerGroup: duplicate_stdout_filters/duplicate_stderr_filters need "
                "filtered_dir (where filtered_stdout.log and filtered_stderr.log go)"
            )
        ranks = [s.global_rank for s in specs]
        if len(set(ranks)) != len(ranks):
            raise ValueError(f"WorkerGroup: duplicate global ranks in specs: {sorted(ranks)}")
        self.specs = list(specs)
        self._reaper = reaper
        self._stdout_filters = list(duplicate_stdout_filters)
        self._stderr_filters = list(duplicate_stderr_filters)
        self._filtered_dir = Path(filtered_dir) if filtered_dir is not None else None
        self._stdout_console = (
            Console(lambda: console_stdout) if console_stdout else console("stdout")
        )
        self._stderr_console = (
            Console(lambda: console_stderr) if console_stderr else console("stderr")
        )
        self._host = socket.gethostname()
        self._adopt_orphans = adopt_orphans
        self._real_console = console_stdout is None and console_stderr is None
        self._ptys: list[int] = []  # copies of the master ends of the workers' terminals
        self._pty_size: tuple[int, int] | None = None

        self._cond = threading.Condition()
        self._workers: list[_Worker] = []
        self._sinks: list[FilteredSink] = []
        self._started = False
        self._stopped = False
        self._exited_before_stop: set[int] | None = None  # global ranks; None: not stopped
        self._stop_lock = threading.Lock()
        # Held while signalling workers' groups and while reaping them: a group id is only
        # signalled while its leader is unreaped (so the id is still the worker's).
        self._reap_lock = threading.Lock()
        self._reaped = False

    # --- public API ---------------------------------------------------------------------------

    @property
    def pids(self) -> list[int]:
        """The workers' pids in spec order (also their process group ids); [] before start."""
        return [w.proc.pid for w in self._workers]

    def start(self) -> None:
        """Spawn every worker, each in its own session, and start forwarding their output.

        Removes a stale error file left at a worker's ``TORCHELASTIC_ERROR_FILE`` path, so a
        report never shows an old error. If one spawn fails, the workers already started are
        stopped and the error is raised.

        Raises:
            RuntimeError: called twice.
            OSError: a worker could not be spawned (e.g. ``argv[0]`` not found).
        """
        if self._started:
            raise RuntimeError("WorkerGroup.start() called twice; make a new group per round")
        self._started = True
        out_filter = self._open_sink("filtered_stdout.log", self._stdout_filters)
        err_filter = self._open_sink("filtered_stderr.log", self._stderr_filters)
        try:
            for spec in self.specs:
                self._workers.append(self._spawn(spec, out_filter, err_filter))
        except BaseException:
            self.stop(grace=0)
            raise

    def wait(self, timeout: float) -> GroupResult | None:
        """Block up to ``timeout`` seconds for the group's outcome.

        Returns FAILED as soon as any worker exited non-zero or was killed by a signal (the
        others may still run: call :meth:`stop`), SUCCEEDED once all exited 0, and None if
        still undecided after ``timeout``. Wakes on the exit itself, not on a poll tick.

        Raises:
            RuntimeError: called before :meth:`start`.
        """
        if not self._started:
            raise RuntimeError("WorkerGroup.wait() called before start()")
        with self._cond:
            self._cond.wait_for(self._decided, timeout=max(0.0, timeout))
            failed = [w for w in self._workers if w.exitcode not in (None, 0)]
            succeeded = bool(self._workers) and all(w.exitcode == 0 for w in self._workers)
        if failed:
            return GroupResult(WorkerState.FAILED, _describe(failed))
        if succeeded:
            return GroupResult(WorkerState.SUCCEEDED)
        return None

    def failures(self) -> list[WorkerFailure]:
        """The workers that failed on their own, sorted by observed exit time, then global
        rank: those that exited non-zero or by a signal before :meth:`stop` signalled the
        group (:meth:`wait` also counts those that the stop ended). After a stop this is the
        round's whole list, with the ranks that failed a moment after the first one.
        """
        with self._cond:
            before = self._exited_before_stop
            failed = [
                w
                for w in self._workers
                if w.exitcode not in (None, 0) and (before is None or w.spec.global_rank in before)
            ]
        return _describe(failed)

    def stderr_tail(self, local_rank: int) -> str:
        """The last lines the worker of ``local_rank`` wrote to stderr (kept in memory)."""
        return next((w.tail.text() for w in self._workers if w.spec.local_rank == local_rank), "")

    def follow_terminal(self) -> None:
        """Give the workers' pseudo-terminals the console's size when it changed (a resize);
        called once per monitor tick. A no-op without pseudo-terminals."""
        if not self._ptys:
            return
        size = terminal_size("stdout") or terminal_size("stderr")
        if size is None or size == self._pty_size:
            return
        self._pty_size = size
        for fd in self._ptys:
            try:
                set_size(fd, size)
            except OSError:  # that worker's forwarder closed it: the worker is gone
                pass

    def running(self) -> list[tuple[WorkerSpec, int]]:
        """``(spec, pid)`` of each worker that is still running, in spec order ([] after
        :meth:`stop`). Workers are reaped only by :meth:`stop`, so until then each pid names
        its worker even if it exits meanwhile (a zombie), and may be signalled."""
        with self._reap_lock:
            if self._reaped:
                return []
            return [(w.spec, w.proc.pid) for w in self._workers if not _has_exited(w)]

    def outcomes(self) -> list[tuple[WorkerSpec, int | None, bool]]:
        """``(spec, exit code, stopped)`` of each worker, in spec order: the code as
        ``Popen.returncode`` (None while running), and whether :meth:`stop` ended it (it had
        not exited on its own before the stop signalled the group)."""
        with self._cond:
            before = self._exited_before_stop
            return [
                (w.spec, w.exitcode, before is not None and w.spec.global_rank not in before)
                for w in self._workers
            ]

    def renumber(self, specs: Sequence[WorkerSpec]) -> None:
        """Give the running workers the specs of a new round that they took in place
        (`meshrun.in_place`): new global ranks, node rank and environment, for reports and
        events. The processes, their log directories and their output are unchanged.

        Raises:
            ValueError: the specs are not one per worker, with the same local ranks and log
                directories, in the same order.
        """
        specs = list(specs)
        same = [(s.local_rank, Path(s.log_dir)) for s in specs] == [
            (s.local_rank, Path(s.log_dir)) for s in self.specs
        ]
        if not same:
            raise ValueError("WorkerGroup.renumber: the new specs must keep each worker's "
                             "local rank and log directory, in order")
        with self._cond:
            self.specs = specs
            for w, spec in zip(self._workers, specs, strict=True):
                w.spec = spec

    def signal(self, signum: int) -> None:
        """Send ``signum`` to the process group of every worker that has not exited (a no-op
        after :meth:`stop`, which reaps them)."""
        with self._reap_lock:
            for w in self._workers:
                if w.exitcode is None and not self._reaped:
                    quiet_killpg(w.proc.pid, signum)

    def stop(self, grace: float, death_sig: int = _signal.SIGTERM) -> None:
        """Stop all workers: ``death_sig``, up to ``grace`` seconds, then SIGKILL; reap; drain.

        ``death_sig`` (SIGTERM, or the signal the agent received, forwarded once) goes to every
        worker's process group and to descendants that left it (setsid, setpgid), found with
        psutil before signalling, and with ``adopt_orphans`` to every other child of this
        process (orphans of the workers' trees); SIGCONT follows it, so a stopped process
        takes it now. After ``grace`` seconds in total (or as
        soon as everything is gone) whatever is left gets SIGKILL, whole trees. Then the
        process groups are forgotten by the reaper, the workers (and orphans) are reaped, the
        output forwarders finish (waiting at most ~1 s for EOF if an escaped descendant still
        holds a pipe), and files are closed. A worker's group is signalled only while the
        worker is unreaped, so its id cannot have been reused. Idempotent; safe to call after
        the group finished, and after a failed :meth:`start`. Mirrors torch's
        ``PContext.close(death_sig, timeout)``.
        """
        with self._stop_lock:
            if self._stopped:
                return
            self._stopped = True
            deadline = time.monotonic() + max(0.0, grace)
            with self._cond:  # a worker that is already gone cannot have been ended by us
                self._exited_before_stop = {
                    w.spec.global_rank for w in self._workers if _has_exited(w)
                }

            # 1. SIGTERM: every group, and descendants found now (before parents die and their
            #    children are re-parented out of reach). Then SIGCONT, as systemd does: a
            #    stopped process (SIGSTOP, ^Z, a debugger's stop) gets its SIGTERM only once
            #    it runs again, so it would otherwise hold the stop for the whole grace
            #    (while the other nodes go on, and may finish the job, without this one).
            escaped = self._descendants() + self._orphans()
            with self._reap_lock:
                for w in self._workers:
                    quiet_killpg(w.proc.pid, death_sig)
                    quiet_killpg(w.proc.pid, _signal.SIGCONT)
            for p in escaped:
                quiet_signal(p, death_sig)
                quiet_signal(p, _signal.SIGCONT)

            # 2. Up to `grace` for all: workers (event-driven), then the rest (polled).
            with self._cond:
                self._cond.wait_for(
                    lambda: all(w.exitcode is not None for w in self._workers),
                    timeout=max(0.0, deadline - time.monotonic()),
                )
            while time.monotonic() < deadline and self._anything_left(escaped):
                time.sleep(_POLL_S)

            # 3. SIGKILL what is left, whole trees (including anything forked meanwhile).
            escaped = escaped + self._descendants() + self._orphans()
            with self._reap_lock:
                for w in self._workers:
                    quiet_killpg(w.proc.pid, _signal.SIGKILL)
            for p in escaped:
                quiet_signal(p, _signal.SIGKILL)

            # 4. Forget, reap, drain, close. The reaper forgets a group before its leader is
            #    reaped, so it never holds a group id that could be reused.
            for w in self._workers:
                w.waiter.join(5.0)  # SIGKILLed: exits at once, barring uninterruptible sleep
            if self._reaper is not None:
                for w in self._workers:
                    self._reaper.forget(w.proc.pid)
            with self._reap_lock:
                self._reaped = True
                for w in self._workers:
                    if w.exitcode is not None:
                        w.proc.wait()  # the zombie the waiter left
            if self._adopt_orphans:  # and those re-parented to us since the last look
                late = self._orphans()
                for p in late:
                    quiet_signal(p, _signal.SIGKILL)
                reap_orphans(escaped + late)
            drain_deadline = time.monotonic() + _DRAIN_TIMEOUT_S
            forwarders = [f for w in self._workers for f in (w.stdout, w.stderr)]
            for f in forwarders:
                f.join(max(0.0, drain_deadline - time.monotonic()))
            for f in forwarders:
                f.stop(timeout=3.0)  # what is in the pipe reaches the log file (a busy machine)
            for sink in self._sinks:
                sink.close()
            for fd in self._ptys:
                os.close(fd)
            self._ptys = []

    def __enter__(self) -> WorkerGroup:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop(grace=5.0)

    # --- helpers ------------------------------------------------------------------------------

    def _decided(self) -> bool:
        codes = [w.exitcode for w in self._workers]
        return any(c not in (None, 0) for c in codes) or all(c == 0 for c in codes)

    def _open_sink(self, name: str, filters: list[str]) -> FilteredSink | None:
        if not filters:
            return None
        assert self._filtered_dir is not None
        self._filtered_dir.mkdir(mode=0o700, parents=True, exist_ok=True)
        sink = FilteredSink(self._filtered_dir / name, filters, self._stderr_console.say)
        self._sinks.append(sink)
        return sink

    def _spawn(
        self, spec: WorkerSpec, out_filter: FilteredSink | None, err_filter: FilteredSink | None
    ) -> _Worker:
        log_dir = Path(spec.log_dir)
        log_dir.mkdir(mode=0o700, parents=True, exist_ok=True)
        if spec.error_file:
            try:
                os.unlink(spec.error_file)
            except FileNotFoundError:
                pass
        # A pseudo-terminal per stream that goes to a terminal (`meshrun.agent.ptys`), else
        # a pipe; tests that give their own console streams get pipes.
        out_size = terminal_size("stdout") if spec.console_out and self._real_console else None
        err_size = terminal_size("stderr") if spec.console_err and self._real_console else None
        out_fd, out_w = open_pty(out_size) if out_size else os.pipe()
        err_fd, err_w = open_pty(err_size) if err_size else os.pipe()
        # our own copies of the masters, to resize them while the forwarders read theirs
        self._ptys += [os.dup(fd) for fd, size in ((out_fd, out_size), (err_fd, err_size)) if size]
        try:
            proc = subprocess.Popen(  # vfork: see `meshrun.agent.spawn` on the price of fork
                list(spec.argv),
                env=dict(spec.env),
                cwd=spec.cwd,
                stdin=subprocess.DEVNULL,
                stdout=out_w,
                stderr=err_w,
                start_new_session=True,
                close_fds=True,
            )
        except BaseException:
            os.close(out_fd)
            os.close(err_fd)
            raise
        finally:
            os.close(out_w)
            os.close(err_w)
        try:
            if self._reaper is not None:
                self._reaper.watch(proc.pid)  # pgid == pid: the worker leads its own session
            tail = StderrTail()

            def forwarder(fd, stream, console, shown, line_filter, **extra) -> PipeForwarder:
                """The thread that drains one of the worker's pipes (stdout or stderr)."""
                return PipeForwarder(
                    fd,
                    log_dir / f"{stream}.log",
                    console=console if shown else None,
                    prefix=spec.prefix,
                    filtered=line_filter.line_filter(spec.prefix.encode())
                    if line_filter and shown
                    else None,
                    name=f"meshrun-rank{spec.global_rank}-{stream}",
                    label=f"rank {spec.global_rank}'s {stream}",
                    max_bytes=spec.log_max_bytes,
                    notices=self._stderr_console,
                    **extra,
                )

            stdout = forwarder(out_fd, "stdout", self._stdout_console, spec.console_out,
                               out_filter)  # fmt: skip
            stderr = forwarder(err_fd, "stderr", self._stderr_console, spec.console_err,
                               err_filter, tail=tail)  # fmt: skip
        except BaseException:
            # Not tracked yet: nothing else would ever stop this process.
            quiet_killpg(proc.pid, _signal.SIGKILL)
            proc.wait()
            for fd in (out_fd, err_fd):
                try:
                    os.close(fd)
                except OSError:
                    pass
            raise
        worker = _Worker(spec, proc, stdout, stderr, tail, host=spec.host or self._host)
        stdout.start()
        stderr.start()
        worker.waiter = threading.Thread(
            target=self._wait_one, args=(worker,), name=f"meshrun-rank{spec.global_rank}-waiter",
            daemon=True,
        )
        worker.waiter.start()
        return worker

    def _wait_one(self, worker: _Worker) -> None:
        # Wait without reaping (WNOWAIT): stop() reaps after its last signal to the group.
        try:
            info = os.waitid(os.P_PID, worker.proc.pid, os.WEXITED | os.WNOWAIT)
            code = info.si_status if info.si_code == os.CLD_EXITED else -info.si_status
        except ChildProcessError:  # reaped elsewhere (should not happen): Popen knows the code
            code = worker.proc.wait()
        ms = int(time.time() * 1000)
        with self._cond:
            worker.exitcode = code
            worker.exit_ms = ms
            self._cond.notify_all()

    def _descendants(self) -> list[psutil.Process]:
        """Live descendants of live workers, wherever their process group is."""
        return process_tree.descendants([w.proc.pid for w in self._workers if w.exitcode is None])

    def _orphans(self) -> list[psutil.Process]:
        """With ``adopt_orphans``: this process's children other than the workers and the
        reaper (descendants that a worker's tree double-forked away), and their descendants."""
        if not self._adopt_orphans:
            return []
        known = {w.proc.pid for w in self._workers}
        if self._reaper is not None and self._reaper.pid is not None:
            known.add(self._reaper.pid)
        return process_tree.orphans(known)

    def _anything_left(self, escaped: list[psutil.Process]) -> bool:
        if any(w.exitcode is None for w in self._workers):
            return True
        return process_tree.anything_left({w.proc.pid for w in self._workers}, escaped)


class _Worker:
    """The agent-side state of one worker process."""

    def __init__(
        self,
        spec: WorkerSpec,
        proc: subprocess.Popen,
        stdout: PipeForwarder,
        stderr: PipeForwarder,
        tail: StderrTail,
        host: str,
    ) -> None:
        self.spec = spec
        self.proc = proc
        self.stdout = stdout
        self.stderr = stderr
        self.tail = tail
        self.host = host
        self.waiter: threading.Thread | None = None
        self.exitcode: int | None = None  # set by the waiter thread, under the group's lock
        self.exit_ms: int = 0

    def failure(self) -> WorkerFailure:
        spec = self.spec
        record = read_error_file(spec.error_file)
        if record is not None and record[1]:
            message, traceback, source = record[0], record[1], "error.json"
        else:
            message, traceback = (record[0] if record else ""), self.tail.text()
            source = "stderr" if traceback else ""
        return WorkerFailure(
            local_rank=spec.local_rank,
            global_rank=spec.global_rank,
            pid=self.proc.pid,
            exitcode=int(self.exitcode if self.exitcode is not None else 0),
            timestamp_ms=self.exit_ms,
            host=self.host,
            node_rank=spec.node_rank,
            message=message,
            traceback=traceback,
            stdout_path=str(Path(spec.log_dir) / "stdout.log"),
            stderr_path=str(Path(spec.log_dir) / "stderr.log"),
            source=source,
            calls=summary(read_record(Path(spec.log_dir) / RECORD_FILE)),
        )


def _has_exited(worker: _Worker) -> bool:
    """Whether the worker process has exited (reaped or not), without reaping it: its waiter
    thread may not have recorded the exit yet, but a zombie is an exit all the same."""
    if worker.exitcode is not None:
        return True
    try:
        flags = os.WEXITED | os.WNOHANG | os.WNOWAIT
        return os.waitid(os.P_PID, worker.proc.pid, flags) is not None
    except ChildProcessError:  # reaped by the waiter thread a moment ago
        return True


def _describe(failed: list[_Worker]) -> list[WorkerFailure]:
    """The failures of ``failed``, sorted by observed exit time, then global rank; each
    worker's stderr gets up to 0.5 s in all to reach EOF first, so its tail is complete."""
    deadline = time.monotonic() + _TAIL_SETTLE_S
    for w in failed:
        w.stderr.join(max(0.0, deadline - time.monotonic()))
    return sorted((w.failure() for w in failed), key=lambda f: (f.timestamp_ms, f.global_rank))
