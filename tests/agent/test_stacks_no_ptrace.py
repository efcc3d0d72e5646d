"""Stacks without ptrace: a plain torch script (it never imports meshrun) still shows where
each stopped rank was when py-spy cannot be used (issue 48).

py-spy needs ptrace rights over the worker (refused in a container without CAP_SYS_PTRACE, or
under Yama's ptrace_scope); meshrun's worker site arms ``faulthandler`` on meshrun's stack
signal in every Python worker, so the agent gets the Python stacks from inside. The scenario is
tests/agent/e2e_scripts/slow_reader.py (rank 0 in its own slow reader, rank 1's barrier times
out): the failure report must place rank 0 in ``read_batch``, from a faulthandler dump.

py-spy is made unusable two ways:

- **absent**: neither on PATH nor beside ``sys.executable``: meshrun runs from a copy of the
  virtualenv (its own ``bin/python``, the same site-packages) with PATH=/usr/bin:/bin;
- **ptrace refused**: the tests run as root, where ptrace of a child cannot really be refused
  (no Yama here; dropping CAP_SYS_PTRACE does not stop a parent tracing its own child), so a
  fake ``py-spy`` first on PATH fails the way py-spy does on EPERM (its message, exit 1).
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.timeout(120)

READER = Path(__file__).parent / "e2e_scripts" / "slow_reader.py"
VENV = Path(sys.prefix)
# what py-spy 0.3/0.4 prints when ptrace fails with EPERM (remoteprocess's error), then exit 1
PTRACE_REFUSED = """#!/bin/sh
echo "Error: Permission Denied: Try running again with elevated permissions by going 'sudo env \\"PATH=\\$PATH\\" !!'" >&2
exit 1
"""


def _line_of(path: Path, text: str) -> int:
    return next(i for i, line in enumerate(path.read_text().splitlines(), 1) if text in line)


def _venv_without_py_spy(tmp_path: Path) -> Path:
    """A virtualenv that is the suite's (same base interpreter, same site-packages) with a bin/
    of its own that holds only python: its ``sys.executable`` has no py-spy beside it."""
    venv = tmp_path / "venv"
    (venv / "bin").mkdir(parents=True)
    (venv / "pyvenv.cfg").write_text((VENV / "pyvenv.cfg").read_text())
    os.symlink(os.path.realpath(sys.executable), venv / "bin" / "python")
    lib = venv / "lib" / f"python{sys.version_info.major}.{sys.version_info.minor}"
    lib.mkdir(parents=True)
    os.symlink(Path(sys.prefix) / lib.relative_to(venv) / "site-packages", lib / "site-packages")
    return venv / "bin" / "python"


def _assert_placed_from_faulthandler(result) -> None:
    err = result.stderr
    assert result.returncode == 1, err
    report = err[err.index("Root cause"):]
    reader = _line_of(READER, "time.sleep(120)")
    assert "no stack" not in report, report
    m = re.search(rf"rank 0 \(host .*\): .*at \S*slow_reader.py:{reader} in read_batch\n"
                  rf"    full stack: (\S+)", report)  # fmt: skip
    assert m, report
    dump = Path(m[1]).read_text()
    # faulthandler's format ('File "x", line N in f'), not py-spy's ('f (x:N)')
    assert re.search(rf'File "\S+slow_reader.py", line {reader} in read_batch', dump), dump


def test_py_spy_absent_the_report_still_places_every_rank(launch, tmp_path):
    python = _venv_without_py_spy(tmp_path)
    env = {"PATH": "/usr/bin:/bin"}
    # the set-up hides py-spy from the agent's own lookup, and the copy imports torch
    probe = subprocess.run(
        [str(python), "-c", "import torch; from meshrun.agent.stacks import _py_spy; "
         "print(_py_spy())"], capture_output=True, text=True, timeout=60,
        env={**os.environ, **env, "PYTHONPATH": str(Path(__file__).parents[2])},
    )  # fmt: skip
    assert probe.returncode == 0 and probe.stdout.strip() == "None", (probe.stdout, probe.stderr)
    _assert_placed_from_faulthandler(_run(launch, [str(python), "-m", "meshrun"], env))


def test_ptrace_refused_the_report_still_places_every_rank(launch, tmp_path):
    fake = tmp_path / "fake-bin"
    fake.mkdir()
    (fake / "py-spy").write_text(PTRACE_REFUSED)
    (fake / "py-spy").chmod(0o755)
    env = {"PATH": f"{fake}:{os.environ.get('PATH', '/usr/bin:/bin')}"}
    refused = subprocess.run(["py-spy", "dump", "--pid", str(os.getpid())], capture_output=True,
                             text=True, env={**os.environ, **env}, timeout=10)  # fmt: skip
    assert refused.returncode == 1 and "Permission Denied" in refused.stderr
    _assert_placed_from_faulthandler(_run(launch, [sys.executable, "-m", "meshrun"], env))


def _run(launch, command: list[str], env: dict[str, str]):
    proc = launch.start(["--nproc-per-node", "3", "--shutdown-timeout", "2", str(READER)],
                        env=env, command=command)  # fmt: skip
    try:
        out, err = proc.communicate(timeout=100)
    except subprocess.TimeoutExpired:
        proc.kill()
        out, err = proc.communicate()
        raise AssertionError(f"meshrun did not finish within 100 s\n{err}") from None
    return subprocess.CompletedProcess(proc.args, proc.returncode, out, err)


OWN_HANDLER = """
import os, signal, sys, time
def mine(signum, frame):
    print("mine", flush=True)
signal.signal(int(os.environ["MESHRUN_STACK_SIGNAL"]), mine)  # the script's own, after the site's
print("ready", flush=True)
time.sleep(60)
"""


def test_a_script_with_its_own_handler_for_the_stack_signal_keeps_it(tmp_path, monkeypatch):
    """The worker site armed faulthandler (a plain script: no meshrun import); the script then
    installs its own handler for the signal: the agent's request reaches the script's handler,
    the worker lives on, and the stack is reported missing, not made up."""
    from support import meshrun_env

    from meshrun.agent import stacks as stacks_mod
    from meshrun.agent.hang import progress_env
    from meshrun.agent.stacks import Target, collect_stacks
    from meshrun.agent.worker_env import WORKER_SITE

    monkeypatch.setattr(stacks_mod, "_py_spy", lambda: None)
    env = meshrun_env(**progress_env(tmp_path), PYTHONPATH=WORKER_SITE)
    proc = subprocess.Popen([sys.executable, "-c", OWN_HANDLER], env=env, stdout=subprocess.PIPE,
                            text=True)  # fmt: skip
    try:
        assert proc.stdout.readline().strip() == "ready"
        assert (tmp_path / "stack.txt").exists()  # armed by the site, before the script ran
        taken = collect_stacks([Target(0, proc.pid, tmp_path / "stack.txt", tmp_path / "x.txt")],
                               timeout=1.0)[0]  # fmt: skip
        assert proc.stdout.readline().strip() == "mine"
        assert proc.poll() is None
        assert taken.text == "" and "faulthandler did not answer" in taken.problem, taken
    finally:
        proc.kill()
        proc.wait()
        proc.stdout.close()
