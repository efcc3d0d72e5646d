"""Signals the agent receives: the ones that stop the job, and the schedulers' warnings.

Two kinds, two rules:

- **Handled signals** (``--signals-to-handle``: TERM, INT, HUP, QUIT by default) stop the
  job. The handler only records the first one; the run loop acts on it within one monitor
  interval (`Signals.stop_signal`): it is forwarded to the workers once, one grace period,
  exit 128+N. Signals win over failures: from the moment one is recorded nothing is
  published and no restart is spent (`Signals.raise_if_stopped`, `Stopped`).
- **Warnings** (`PASS_THROUGH`: SIGUSR1 and SIGUSR2, unless listed in --signals-to-handle)
  are the schedulers' "save soon" (SLURM ``--signal=USR1@N``, ``scancel -s USR1``). Each
  worker gets one exactly once and the job goes on (`Signals.pass_on_warnings`). SLURM's
  proctrack/linuxproc and cgroup signal every process of the step, so the workers got it
  already; proctrack/pgid and a ``kill`` aimed at the agent reach the agent (and its process
  group) only. The reaper, in a session of its own, tells the two apart: it got the signal
  too only in the first case (`meshrun.agent.reaper.Reaper.signals_seen`).

A rendezvous call can block inside TCPStore's C++ code, where Python's handlers do not run
until it returns; `Signals.interruptible` runs such a call on a thread so that a signal is
acted on at once.
"""

from __future__ import annotations

import signal
import threading
import time
from collections.abc import Callable

from meshrun._console import take_early
from meshrun.agent.say import say

#: The schedulers' warning signals (SLURM ``--signal=USR1@N``): passed to the workers once and
#: the job goes on, unless listed in --signals-to-handle (then torchrun's meaning: stop).
PASS_THROUGH = (signal.SIGUSR1, signal.SIGUSR2)
#: Seconds the agent waits after a warning signal to learn whether the reaper got it too.
PROBE_WINDOW_S = 0.3


class Stopped(Exception):
    """A handled signal arrived: whatever the agent was doing (a rendezvous call, waiting to
    tell a lost node from a failure, the exit barrier) ends, and the agent exits 128+N.
    Signals win over failures: nothing is published and no restart is spent after one."""

    def __init__(self, signum: int):
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


class Signals:
    """The agent's signal handlers and what they recorded.

    Args:
        handled: the signals that stop the job (``--signals-to-handle``).
        emit: ``emit(kind, **fields)`` writes one event to the agent's event log (the
            timeline's ``signal`` events).
    """

    def __init__(self, handled: tuple[int, ...], emit: Callable[..., None]):
        self.handled = tuple(handled)
        self._emit = emit
        #: the first handled signal received, or None
        self.stop_signal: int | None = None
        # warnings received: (signum, when the handler ran, when the run loop last looked)
        self._warnings: list[tuple[int, float, float]] = []
        self._looked_at = 0.0  # monotonic time `pass_on_warnings` last started
        self._reaper_saw: list[tuple[int, float]] = []  # ... that reached the reaper too
        self._previous: dict[int, object] = {}

    # -- handlers ------------------------------------------------------------------------------
    def install(self) -> None:
        """Install the handlers: every handled signal, and the warnings not among them."""
        self._previous = {s: signal.signal(s, self._on_stop) for s in self.handled}
        for s in PASS_THROUGH:
            if s not in self.handled:
                self._previous[s] = signal.signal(s, self._on_warning)

    def restore(self) -> None:
        """Put back the handlers that were in place before `install`."""
        for s, handler in self._previous.items():
            signal.signal(s, handler)
        self._previous = {}

    def replay_early(self) -> None:
        """Act on the warnings meshrun's entry point caught before these handlers were in
        place (`meshrun._console.take_early`): a handled one stops the job, as if it came now;
        any other is said as a warning that came while no worker ran."""
        for s in take_early():
            if s in self.handled:
                self._on_stop(s, None)
            else:
                self.no_worker_warning(s)

    def _on_stop(self, signum: int, frame) -> None:
        # Only recorded: the run loop acts on it within one monitor interval, forwarding it to
        # the workers once (WorkerGroup.stop(death_sig=signum)), never from inside a handler.
        if self.stop_signal is None:
            self.stop_signal = signum

    def _on_warning(self, signum: int, frame) -> None:
        # SIGUSR1/SIGUSR2, not in --signals-to-handle: the schedulers' "save soon"; recorded
        # here, passed on by the run loop (`pass_on_warnings`); the job goes on.
        self._warnings.append((signum, time.monotonic(), self._looked_at))

    # -- stopping ------------------------------------------------------------------------------
    def raise_if_stopped(self) -> None:
        """Raise `Stopped` when a handled signal arrived (checked before spending anything)."""
        if self.stop_signal is not None:
            raise Stopped(self.stop_signal)

    def interruptible(self, fn, *args, **kwargs):
        """Run a blocking rendezvous call on a thread, so a signal is acted on at once.

        A call blocked inside TCPStore (C++) would delay Python's signal handlers until it
        returns; the main thread stays free instead. Raises `Stopped` on a handled signal.
        """
        self.raise_if_stopped()  # one that came before (a fast call has no join to see it)
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
            self.raise_if_stopped()
        self.raise_if_stopped()  # one that came as the call ended: before anything starts
        ok, value = outcome[0]
        if not ok:
            raise value
        return value

    # -- warnings ------------------------------------------------------------------------------
    def pass_on_warnings(self, reaper, group, group_started_at: float) -> None:
        """Give each worker of ``group`` (a `WorkerGroup`, or None) a warning the agent
        received, exactly once; the job goes on.

        The agent decides `PROBE_WINDOW_S` after the signal came: when the ``reaper`` got it
        too, it was sent to the whole job step and the workers have it; otherwise it is
        forwarded to every worker's process group. A warning that came before the running
        group started (``group_started_at``, monotonic seconds) reached no worker of it, and
        is said as one that came while no worker ran."""
        now = self._looked_at = time.monotonic()
        # The reaper's times are when the signal came. The agent's handler runs later, on the
        # main thread, when it next runs Python (after a wait() of up to a monitor interval,
        # or a thread holding the GIL): the signal came after the loop last looked (`since`).
        self._reaper_saw += reaper.signals_seen()
        horizon = min((since for _, _, since in self._warnings), default=now)
        self._reaper_saw = [(n, t) for n, t in self._reaper_saw
                            if t >= horizon - 2 * PROBE_WINDOW_S]  # fmt: skip
        while self._warnings and now - self._warnings[0][1] >= PROBE_WINDOW_S:
            signum, at, since = self._warnings.pop(0)
            name = signal_name(signum)
            step_wide = next((i for i, (n, t) in enumerate(self._reaper_saw) if n == signum
                              and since - 2 * PROBE_WINDOW_S <= t <= at + 2 * PROBE_WINDOW_S),
                             None)  # fmt: skip
            passed = False
            if step_wide is not None:
                del self._reaper_saw[step_wide]
                say(f"received {name}, sent to the whole job step: the workers got it too; "
                    "the job goes on")  # fmt: skip
            elif group is not None and at >= group_started_at:
                group.signal(signum)
                passed = True
                say(f"received {name}: passed to every worker; the job goes on")
            else:
                self.no_worker_warning(signum)
                continue
            self._emit("signal", signal=name, passed_on=passed)

    def say_unpassed(self) -> None:
        """At the end: the warnings still waiting to be passed on (the job ended, or its
        rendezvous failed, within `PROBE_WINDOW_S` of them) are said, never dropped."""
        while self._warnings:
            signum, _, _ = self._warnings.pop(0)
            name = signal_name(signum)
            say(f"received {name} as the job ended; not passed on")
            self._emit("signal", signal=name, passed_on=False)

    def no_worker_warning(self, signum: int) -> None:
        """A warning that came while no worker ran: nobody to pass it to; said, and an event."""
        name = signal_name(signum)
        say(f"received {name} while no worker ran; the job goes on")
        self._emit("signal", signal=name, passed_on=False)


def signal_name(signum: int) -> str:
    """``SIGTERM`` for 15; "signal N" for a number that names no signal."""
    try:
        return signal.Signals(signum).name
    except ValueError:
        return f"signal {signum}"
