"""Stack collection against hostile or unlucky workers (found by the breaker): a worker that
armed faulthandler and then reset the stack signal must not be killed by it (``meshrun
stacks`` on a live job killed it); one with more than 100 threads, whose main thread
faulthandler leaves out, must not be placed in another thread; a deep main thread under a few
threads must keep its frames in the record cut to a few KB for the store."""

from __future__ import annotations

import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
from support import meshrun_env

from meshrun.agent import stacks as stacks_mod
from meshrun.agent.errors import WorkerFailure
from meshrun.agent.hang import progress_env
from meshrun.agent.stacks import Target, collect_stacks, main_thread

pytestmark = pytest.mark.timeout(60)

RESET = """
    import os, signal, sys, time
    from meshrun.parallel.heartbeat import register_stack_dump
    assert register_stack_dump()
    # a framework resetting its handlers
    signal.signal(int(os.environ["MESHRUN_STACK_SIGNAL"]), signal.SIG_DFL)
    print("ready", flush=True)
    def main_loop():
        time.sleep(60)
    main_loop()
"""

THREADS = """
    import threading, time
    from meshrun.parallel.heartbeat import register_stack_dump
    assert register_stack_dump()
    def idle_thread():
        time.sleep(60)
    for _ in range(150):
        threading.Thread(target=idle_thread, daemon=True).start()
    print("ready", flush=True)
    def main_loop():
        time.sleep(60)
    main_loop()
"""

DEEP = """
    import threading, time
    from meshrun.parallel.heartbeat import register_stack_dump
    assert register_stack_dump()
    def idle_thread():
        time.sleep(60)
    for _ in range(20):
        threading.Thread(target=idle_thread, daemon=True).start()
    def deep(n):
        if n == 0:
            print("ready", flush=True)
            time.sleep(60)
        return deep(n - 1)
    deep(150)
"""


def _start(tmp_path: Path, code: str) -> tuple[subprocess.Popen, Target]:
    env = meshrun_env(**progress_env(tmp_path))
    proc = subprocess.Popen([sys.executable, "-c", textwrap.dedent(code)], env=env,
                            stdout=subprocess.PIPE, text=True)  # fmt: skip
    assert proc.stdout.readline().strip() == "ready"
    target = Target(0, proc.pid, tmp_path / "stack.txt", tmp_path / "stack-py-spy.txt")
    return proc, target


def _stop(proc: subprocess.Popen) -> None:
    proc.kill()
    proc.wait()
    proc.stdout.close()


def test_a_worker_that_reset_the_stack_signal_is_not_killed_by_it(tmp_path, monkeypatch):
    proc, target = _start(tmp_path, RESET)
    try:
        taken = collect_stacks([target])[0]
        time.sleep(0.2)
        assert proc.poll() is None, "the stack signal killed a worker that no longer handles it"
        if stacks_mod._py_spy() is not None:
            assert taken.tool == "py-spy" and taken.main[0].func == "main_loop", taken
        monkeypatch.setattr(stacks_mod, "_py_spy", lambda: None)
        taken = collect_stacks([target])[0]
        time.sleep(0.2)
        assert proc.poll() is None
        assert "no longer handles" in taken.problem, taken
    finally:
        _stop(proc)


def test_more_than_100_threads_the_main_thread_is_not_mistaken(tmp_path, monkeypatch):
    proc, target = _start(tmp_path, THREADS)
    try:
        if stacks_mod._py_spy() is not None:  # py-spy completes the cut dump
            taken = collect_stacks([target])[0]
            assert taken.main and taken.main[0].func == "main_loop", taken.main[:3]
        monkeypatch.setattr(stacks_mod, "_py_spy", lambda: None)
        taken = collect_stacks([target])[0]
        assert taken.tool == "faulthandler" and taken.text, taken
        # faulthandler lists 100 threads, newest first: the main thread is not among them
        assert all(f.func != "idle_thread" for f in taken.main), taken.main[:3]
    finally:
        _stop(proc)


def test_a_deep_main_thread_keeps_its_frames_in_the_published_record(tmp_path, monkeypatch):
    monkeypatch.setattr(stacks_mod, "_py_spy", lambda: None)
    proc, target = _start(tmp_path, DEEP)
    try:
        taken = collect_stacks([target])[0]
    finally:
        _stop(proc)
    assert taken.tool == "faulthandler" and taken.main[0].func == "deep", taken.main[:2]
    record = WorkerFailure(0, 0, proc.pid, -15, 0, traceback=taken.text, source="stack")
    published = record.capped()  # what the store carries (4 KB)
    assert len(published.traceback) < len(taken.text)
    shown = main_thread(published.traceback)
    assert shown and shown[0].func == "deep" and shown[1].func == "deep", shown[:2]
