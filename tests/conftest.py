"""Shared fixtures for end-to-end tests that run the real ``meshrun`` command.

``launch`` starts ``python -m meshrun ...`` as a real subprocess in a per-test temp directory,
with a clean environment (no ``PET_*``/``TORCHELASTIC_*``/``MASTER_*``/``OMP_NUM_THREADS``
leaking in from the caller), and stops at teardown whatever a test left running: the meshrun
processes it started and any pids the test registered (workers it learned of), by pid only.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from support import free_port, meshrun_env
from timeout_pause import pytest_runtest_makereport  # noqa: F401  (a hook: see its module)


def wait_for(predicate, timeout: float, interval: float = 0.02, what: str = "condition"):
    """Poll ``predicate`` until it returns a truthy value (returned) or ``timeout`` s pass."""
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout} s waiting for {what}")
        time.sleep(interval)


class Launcher:
    """Starts meshrun subprocesses for one test and cleans up after it."""

    def __init__(self, cwd: Path) -> None:
        self.cwd = cwd
        self.procs: list[subprocess.Popen] = []
        self.extra_pids: set[int] = set()

    free_port = staticmethod(free_port)
    wait_for = staticmethod(wait_for)

    def start(
        self,
        args: list[str],
        *,
        env: dict[str, str] | None = None,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text: bool = True,
        cwd: Path | None = None,
        start_new_session: bool = False,
        command: list[str] | None = None,
    ) -> subprocess.Popen:
        """Start ``python -m meshrun ARGS`` (or ``command ARGS``: the console script);
        returns the Popen (its pid is the agent's; with ``start_new_session`` also its
        process group's id)."""
        full_env = meshrun_env(**(env or {}))
        proc = subprocess.Popen(
            [*(command or [sys.executable, "-m", "meshrun"]), *args],
            cwd=cwd or self.cwd,
            env=full_env,
            stdin=subprocess.DEVNULL,
            stdout=stdout,
            stderr=stderr,
            text=text,
            start_new_session=start_new_session,
        )
        proc.launch_env = full_env  # what the agent was started with, for comparisons
        self.procs.append(proc)
        return proc

    def run(
        self,
        args: list[str],
        *,
        timeout: float = 60,
        env: dict[str, str] | None = None,
        cwd: Path | None = None,
    ) -> subprocess.CompletedProcess:
        """Run meshrun to completion; returns a CompletedProcess (text stdout/stderr)."""
        proc = self.start(args, env=env, cwd=cwd)
        try:
            out, err = proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            out, err = proc.communicate()
            raise AssertionError(
                f"meshrun {args} did not finish within {timeout} s\nstdout:\n{out}\nstderr:\n{err}"
            ) from None
        done = subprocess.CompletedProcess(proc.args, proc.returncode, out, err)
        done.launch_env = proc.launch_env
        return done

    def cleanup(self) -> None:
        for proc in self.procs:
            if proc.poll() is None:
                try:
                    os.kill(proc.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
                try:
                    proc.communicate(timeout=10)
                except subprocess.TimeoutExpired:
                    pass
        for pid in self.extra_pids:
            try:
                os.kill(pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass


@pytest.fixture
def launch(tmp_path: Path):
    """A `Launcher` whose working directory is a fresh temp directory (``launch.cwd``)."""
    launcher = Launcher(tmp_path)
    try:
        yield launcher
    finally:
        launcher.cleanup()
