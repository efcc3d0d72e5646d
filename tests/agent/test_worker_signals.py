"""Nothing meshrun puts into a worker changes its signals: torch's and Python's documented
signal patterns behave under meshrun as under torchrun (issue 48).

Every worker runs torch.distributed on gloo, so meshrun's collective record thread
(``meshrun-collective-record``) runs in it, and meets signals one way
(tests/agent/scripts/signal_patterns.py): Python handlers for SIGUSR1 and SIGTERM; SIGUSR1
blocked with ``pthread_sigmask`` and read with ``sigtimedwait`` then ``sigwait``; SIGTERM
blocked and read. The signals are sent to each worker process by pid (what SLURM's
proctrack/linuxproc and cgroup do: ``scancel`` signals every process of the step), and SIGTERM
also to the launcher, which forwards it (what ``kill <launcher>`` and SLURM's pgid tracking
do). Before meshrun's threads blocked every signal, a blocked SIGUSR1 landed on the record's
thread and killed the worker (exit 138), and a blocked SIGTERM killed it too.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from support import read_pid

pytestmark = pytest.mark.timeout(120)

SCRIPT = str(Path(__file__).resolve().parent / "scripts" / "signal_patterns.py")
TORCHRUN = [sys.executable, "-m", "torch.distributed.run"]
EXPECTED = {"handler": ["SIGUSR1", "SIGTERM"], "sigwait": ["SIGUSR1", "SIGUSR1"],
            "term": ["SIGTERM"]}  # fmt: skip


def _lines(path: Path) -> list[str]:
    try:
        return path.read_text().split()
    except FileNotFoundError:
        return []


def run_pattern(launch, launcher: str, mode: str, route: str) -> tuple[dict, int, str]:
    """Run 2 workers of signal_patterns.py in ``mode`` under ``launcher`` ("meshrun" or
    "torchrun"), send the mode's signals by ``route`` ("pid": to each worker, "launcher": to
    the launcher); return (rank -> the signals each read, the launcher's exit status, its
    stderr)."""
    out = launch.cwd / f"{launcher}-{mode}-{route}"
    out.mkdir()
    args = ["--nproc-per-node", "2", "--master-port", str(launch.free_port()), SCRIPT,
            str(out), mode]  # fmt: skip
    proc = launch.start(args, command=TORCHRUN if launcher == "torchrun" else None)
    pids = {}
    for rank in (0, 1):
        pids[rank] = launch.wait_for(lambda r=rank: proc.poll() is not None and -1
                                     or read_pid(out / f"pid_{r}"),
                                     60, what=f"rank {rank}'s pid file")  # fmt: skip
        assert pids[rank] != -1, f"{launcher} ended early:\n{proc.communicate()[1][-3000:]}"
        launch.extra_pids.add(pids[rank])
    threads = (out / "threads_0").read_text().split()
    if launcher == "meshrun":  # the thread that took the signals is there
        assert "meshrun-collective-record" in threads, threads
    for rank, pid in pids.items():
        for n, name in enumerate(EXPECTED[mode]):
            signum = signal.Signals[name]
            try:
                if route == "pid":
                    os.kill(pid, signum)
                elif rank == 0:
                    os.kill(proc.pid, signum)
            except ProcessLookupError:  # it died of an earlier signal: the result shows it
                break
            # one at a time: a second signal of a kind sent before the first was read merges
            launch.wait_for(lambda r=rank, n=n: len(_lines(out / f"got_{r}")) > n
                            or proc.poll() is not None, 30,
                            what=f"rank {rank} to read {name}")  # fmt: skip
    try:
        _, err = proc.communicate(timeout=60)
    except subprocess.TimeoutExpired:
        proc.kill()
        _, err = proc.communicate()
    got = {rank: _lines(out / f"got_{rank}") for rank in (0, 1)}
    return got, proc.returncode, err


@pytest.mark.parametrize("mode", ["handler", "sigwait", "term"])
def test_signals_sent_to_the_workers_behave_as_under_torchrun(launch, mode):
    mine, mine_rc, mine_err = run_pattern(launch, "meshrun", mode, "pid")
    theirs, theirs_rc, theirs_err = run_pattern(launch, "torchrun", mode, "pid")
    assert theirs == {0: EXPECTED[mode], 1: EXPECTED[mode]}, theirs_err[-3000:]
    assert mine == theirs, mine_err[-3000:]
    assert mine_rc == theirs_rc == 0, (mine_rc, theirs_rc, mine_err[-3000:])


def test_a_blocked_sigterm_sent_to_the_launcher_is_read_as_under_torchrun(launch):
    """SIGTERM to the launcher is forwarded to every worker, which reads it with sigtimedwait
    and exits 0 (torchrun exits 1 after it, meshrun 143: the launchers' own codes differ)."""
    mine, _, mine_err = run_pattern(launch, "meshrun", "term", "launcher")
    theirs, _, theirs_err = run_pattern(launch, "torchrun", "term", "launcher")
    assert theirs == {0: ["SIGTERM"], 1: ["SIGTERM"]}, theirs_err[-3000:]
    assert mine == theirs, mine_err[-3000:]


def test_a_warning_sent_to_meshrun_reaches_a_worker_that_sigwaits_for_it(launch):
    """SIGUSR1 to meshrun is passed to every worker once (SLURM's ``--signal=USR1@N`` under
    proctrack/pgid); a worker that blocked it reads it. torchrun has no such pass-through (a
    SIGUSR1 ends torchrun itself), so this one has no torchrun twin."""
    mine, rc, err = run_pattern(launch, "meshrun", "sigwait", "launcher")
    assert mine == {0: ["SIGUSR1", "SIGUSR1"], 1: ["SIGUSR1", "SIGUSR1"]}, err[-3000:]
    assert rc == 0, err[-3000:]


def _blocked_mask(tid: int) -> int:
    with open(f"/proc/self/task/{tid}/status") as f:
        return next(int(line.split()[1], 16) for line in f if line.startswith("SigBlk:"))


@pytest.mark.timeout(30)
def test_start_thread_blocks_every_signal_in_the_new_thread_only():
    import threading

    from meshrun.worker_signals import start_thread

    before = _blocked_mask(threading.get_native_id())
    seen, go = {}, threading.Event()

    def body():
        seen["mask"] = _blocked_mask(threading.get_native_id())
        go.wait(10)

    thread = start_thread(threading.Thread(target=body, daemon=True))
    try:
        for _ in range(500):
            if "mask" in seen:
                break
            threading.Event().wait(0.01)
        every = 0
        for s in signal.valid_signals():
            if s not in (signal.SIGKILL, signal.SIGSTOP):  # the kernel never blocks these
                every |= 1 << (s - 1)
        assert seen["mask"] & every == every, hex(seen["mask"])
        assert _blocked_mask(threading.get_native_id()) == before  # the caller's mask is back
    finally:
        go.set()
        thread.join(10)


# The files whose code runs inside workers (the parallel library, what the worker site loads):
# each thread they make is started through worker_signals.start_thread.
WORKER_SIDE = ["meshrun/parallel", "meshrun/agent/collective_record.py", "meshrun/exit_guard.py",
               "meshrun/_torch.py", "meshrun/in_place.py", "meshrun/agent/worker_site"]  # fmt: skip


def test_every_thread_made_in_worker_code_is_started_with_signals_blocked():
    """A source check (for threads added later): in the worker-side files, as many
    ``threading.Thread(`` as ``start_thread(`` calls, and no thread ``.start()`` of their own."""
    import re

    repo = Path(__file__).resolve().parents[2]
    files = []
    for entry in WORKER_SIDE:
        path = repo / entry
        files += sorted(path.rglob("*.py")) if path.is_dir() else [path]
    made = started = 0
    for path in files:
        text = path.read_text()
        made_here = len(re.findall(r"threading\.Thread\(", text))
        started_here = len(re.findall(r"start_thread\(", text))
        assert made_here <= started_here, f"{path}: a thread started without start_thread"
        assert not re.search(r"_thread\.start\(\)|\bthread\.start\(\)", text), path
        made, started = made + made_here, started + started_here
    assert made >= 4, made  # the record's, busy()'s, the checkpoint's, the elastic watch's
