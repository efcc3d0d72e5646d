"""Fault recovery time: meshrun vs torchrun, same worker script, same run, interleaved.

Usage (from the repository root, with the project's virtual environment):

    .venv/bin/python benchmarks/faults.py [--repeats 1] [--rows raise,exit,...] [--cap 60]
                                          [--hang-timeout 3] [--verbose]

Rows (the faults of docs/faults.md that have a recovery, plus agent SIGTERM):

- raise, exit, sigkill, segv: 2 workers, ``--max-restarts 1``; rank 1 raises / exits 3 /
  SIGKILLs / SIGSEGVs itself at step 5 after printing ``FAULT t=...``. Time = first line
  (``START``, printed before ``import torch``) of a restarted worker minus the FAULT time, both
  worker-side ``time.time()`` on one host clock.
- hang: rank 1 sleeps at step 5 (rank 0 waits in all_reduce). meshrun ``--hang-timeout H``;
  torchrun has no hang detection: capped at H + 15 s ("no recovery in T s"; the collective
  timeout of the script, 60 s, would end it later). Target: meshrun within H + 2 s.
- node-loss: two agents (``--nnodes 1:2``, c10d on 127.0.0.1, 1 worker each); node 1 (not the
  store host) dies whole: its agent and every descendant are SIGKILLed at once. Time = first
  START of a world-size-1 worker on node 0 minus the kill.
- node-join: node 0 runs alone (``--nnodes 1:2``); node 1 is started. Time = first START of a
  world-size-2 worker minus the start of node 1's launcher.
- agent-sigterm: SIGTERM to the single-node launcher (2 workers running); time to its exit.

Both launchers get ``--monitor-interval 0.1`` and, for c10d, ``--rdzv-conf
join_timeout=60,last_call_timeout=1`` (torchrun's default last call is 30 s); otherwise each
its defaults (meshrun's keep-alive 0.5 s x 5, torchrun's 5 s x 3). torchrun runs with
``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1`` (pytorch#135712). ``OMP_NUM_THREADS=1``. Each row is
capped (``--cap``); a run that does not recover in time prints "no recovery in T s". Every
process a run started is killed afterwards (found by an environment tag), and its temporary
directory removed.
"""

from __future__ import annotations

import argparse
import os
import re
import shlex
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
sys.path[:0] = [str(HERE)]
from _common import free_port, kill_tree, stop_round  # noqa: E402 - beside this file

WORKER = HERE / "_faults_worker.py"
TAG_ENV = "MESHRUN_BENCH_FAULTS_TAG"
ROWS = ["raise", "exit", "sigkill", "segv", "hang", "node-loss", "node-join", "agent-sigterm"]
START_RE = re.compile(r"START rank=(\d+) inc=(\d+) world=(\d+) t=([0-9.]+)")
READY_RE = re.compile(r"READY rank=(\d+) world=(\d+) t=([0-9.]+)")
FAULT_RE = re.compile(r"FAULT rank=(\d+) t=([0-9.]+)")


@dataclass
class Proc:
    """One launcher process, its output lines read on a thread."""

    popen: subprocess.Popen
    lines: list[str] = field(default_factory=list)

    def find(self, regex: re.Pattern, pred=lambda m: True) -> list[re.Match]:
        return [m for line in list(self.lines) if (m := regex.search(line)) and pred(m)]


class Run:
    """One launcher (meshrun | torchrun) running one row; cleans up everything it started."""

    def __init__(self, launcher: str, row: str, args: argparse.Namespace):
        self.launcher, self.row, self.args = launcher, row, args
        self.dir = Path(tempfile.mkdtemp(prefix=f"faults_{launcher}_{row}_"))
        self.tag = uuid.uuid4().hex
        self.procs: list[Proc] = []
        self.port = free_port()

    def env(self) -> dict[str, str]:
        env = {
            k: v
            for k, v in os.environ.items()
            if not k.startswith(("PET_", "TORCHELASTIC_", "MESHRUN_")) and k != "MASTER_PORT"
        }
        env.update(
            PYTHONPATH=str(REPO), OMP_NUM_THREADS="1", CUDA_VISIBLE_DEVICES="",
            BENCH_DIR=str(self.dir), TMPDIR=str(self.dir), **{TAG_ENV: self.tag},
        )  # fmt: skip
        fault = {"raise": "raise", "exit": "exit", "sigkill": "sigkill", "segv": "segv",
                 "hang": "hang"}.get(self.row, "none")  # fmt: skip
        env.update(BENCH_FAULT=fault, BENCH_FAULT_RANK="1")
        if self.launcher == "torchrun":
            env["TORCH_DISABLE_SHARE_RDZV_TCP_STORE"] = "1"
        return env

    def argv(self, multi: bool) -> list[str]:
        exe = [sys.executable, "-m", "meshrun"] if self.launcher == "meshrun" else [
            str(Path(sys.executable).parent / "torchrun")]  # fmt: skip
        common = ["--monitor-interval", "0.1", "--max-restarts", "1"]
        if multi:
            common += [
                "--nnodes", "1:2", "--nproc-per-node", "1", "--rdzv-backend", "c10d",
                "--rdzv-endpoint", f"127.0.0.1:{self.port}", "--rdzv-id", self.tag[:8],
                "--rdzv-conf", "join_timeout=60,last_call_timeout=1",
            ]  # fmt: skip
        else:
            common += ["--standalone", "--nproc-per-node", "2"]
        if self.row == "hang" and self.launcher == "meshrun":
            common += ["--hang-timeout", str(self.args.hang_timeout)]
        return [*exe, *common, str(WORKER)]

    def start(self, multi: bool = False) -> Proc:
        popen = subprocess.Popen(
            self.argv(multi), env=self.env(), cwd=self.dir, stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True,
        )  # fmt: skip
        proc = Proc(popen)
        threading.Thread(target=_pump, args=(popen, proc.lines), daemon=True).start()
        self.procs.append(proc)
        return proc

    def cleanup(self) -> None:
        stop_round([proc.popen for proc in self.procs], TAG_ENV, self.tag, self.dir)

    def log(self) -> str:
        return "\n".join(f"--- proc {i} ---\n" + "".join(p.lines) for i, p in enumerate(self.procs))


def _pump(popen: subprocess.Popen, lines: list[str]) -> None:
    for line in popen.stdout:
        lines.append(line)


def _wait(pred, timeout: float):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = pred()
        if value:
            return value
        time.sleep(0.02)
    return None


# -- the rows: each returns seconds from the fault to recovery, or None (no recovery in cap) --


def measure(launcher: str, row: str, args) -> tuple[float | None, float, str]:
    """(seconds, cap used, note)."""
    run = Run(launcher, row, args)
    cap = args.cap
    if row == "hang" and launcher == "torchrun":
        cap = args.hang_timeout + 15
    try:
        if row in ("raise", "exit", "sigkill", "segv", "hang"):
            p = run.start()
            fault = _wait(lambda: p.find(FAULT_RE), args.cap)
            if not fault:
                return None, cap, "no fault seen (start too slow?)"
            t_fault = float(fault[0].group(2))
            back = _wait(lambda: p.find(START_RE, lambda m: int(m.group(2)) > 1), cap)
            return (float(back[0].group(4)) - t_fault if back else None), cap, ""
        if row == "agent-sigterm":
            p = run.start()
            if not _wait(lambda: len(p.find(READY_RE)) == 2, args.cap):
                return None, cap, "workers never ready"
            t0 = time.monotonic()
            p.popen.send_signal(signal.SIGTERM)
            try:
                code = p.popen.wait(cap)
            except subprocess.TimeoutExpired:
                return None, cap, ""
            return time.monotonic() - t0, cap, f"exit {code}"
        if row == "node-loss":
            n0 = run.start(multi=True)
            _wait(lambda: _listening(run.port), args.cap)
            n1 = run.start(multi=True)
            if not _wait(lambda: n0.find(READY_RE, lambda m: m.group(2) == "2")
                         and n1.find(READY_RE, lambda m: m.group(2) == "2"), args.cap):  # fmt: skip
                return None, cap, "never ran with 2 nodes"
            time.sleep(0.5)
            t_kill = time.time()
            kill_tree(n1.popen.pid)  # the whole node at once: agent and every descendant
            back = _wait(lambda: n0.find(
                START_RE, lambda m: m.group(3) == "1" and float(m.group(4)) > t_kill), cap)  # fmt: skip
            return (float(back[0].group(4)) - t_kill if back else None), cap, ""
        if row == "node-join":
            n0 = run.start(multi=True)
            if not _wait(lambda: n0.find(READY_RE), args.cap):
                return None, cap, "node 0 never ran"
            time.sleep(0.5)
            t_join = time.time()
            n1 = run.start(multi=True)
            back = _wait(lambda: [m for p in (n0, n1) for m in p.find(
                START_RE, lambda m: m.group(3) == "2")], cap)  # fmt: skip
            return (min(float(m.group(4)) for m in back) - t_join if back else None), cap, ""
        raise ValueError(row)
    finally:
        if args.verbose:
            print(f"[{launcher} {row}]\n{run.log()}", file=sys.stderr)
        run.cleanup()


def _listening(port: int) -> bool:
    with socket.socket() as s:
        return s.connect_ex(("127.0.0.1", port)) == 0


def _fmt(values: list[float | None], cap: float) -> str:
    got = [v for v in values if v is not None]
    if not got:
        return f"no recovery in {cap:g} s"
    text = f"{statistics.median(got):.2f}"
    if len(got) < len(values):
        text += f" ({len(values) - len(got)}/{len(values)} no recovery in {cap:g} s)"
    return text


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=1)
    ap.add_argument("--rows", default=",".join(ROWS), help=f"comma-separated, of {ROWS}")
    ap.add_argument("--cap", type=float, default=60.0, help="seconds per row and launcher")
    ap.add_argument("--hang-timeout", type=float, default=3.0)
    ap.add_argument("--verbose", action="store_true")
    args = ap.parse_args()
    rows = [r for r in args.rows.split(",") if r]
    bad = set(rows) - set(ROWS)
    if bad:
        ap.error(f"unknown rows {sorted(bad)}; choose from {ROWS}")
    print("command: " + shlex.join([Path(sys.executable).name, *sys.argv]))
    load0 = os.getloadavg()
    print(f"machine: {os.cpu_count()} cores, load average {load0[0]:.2f} {load0[1]:.2f} "
          f"{load0[2]:.2f} at start")  # fmt: skip
    results: dict[tuple[str, str], list] = {}
    caps: dict[tuple[str, str], float] = {}
    notes: list[str] = []
    began = time.monotonic()
    for row in rows:
        for i in range(args.repeats):
            order = ("meshrun", "torchrun") if i % 2 == 0 else ("torchrun", "meshrun")
            for launcher in order:
                value, cap, note = measure(launcher, row, args)
                results.setdefault((row, launcher), []).append(value)
                caps[(row, launcher)] = cap
                if note:
                    notes.append(f"{row} / {launcher}: {note}")
                shown = f"{value:.2f} s" if value is not None else f"no recovery in {cap:g} s"
                print(f"  {row:13s} {launcher:8s} {shown}{'  (' + note + ')' if note else ''}",
                      flush=True)  # fmt: skip
    load1 = os.getloadavg()
    print(f"machine: load average {load1[0]:.2f} {load1[1]:.2f} {load1[2]:.2f} at end; "
          f"{time.monotonic() - began:.0f} s in all\n")  # fmt: skip
    print("| fault | meshrun (s) | torchrun (s) | ratio |")
    print("|---|---|---|---|")
    for row in rows:
        m, t = results[(row, "meshrun")], results[(row, "torchrun")]
        mg, tg = [v for v in m if v is not None], [v for v in t if v is not None]
        if mg and tg:
            ratio = f"{statistics.median(mg) / statistics.median(tg):.2f}"
        elif mg:
            ratio = "torchrun did not recover"
        else:
            ratio = "-"
        name = f"hang (--hang-timeout {args.hang_timeout:g})" if row == "hang" else row
        print(f"| {name} | {_fmt(m, caps[(row, 'meshrun')])} | "
              f"{_fmt(t, caps[(row, 'torchrun')])} | {ratio} |")  # fmt: skip
    print("\nratio = meshrun / torchrun (below 1: meshrun recovers sooner). Times are from the "
          "fault to the first line of a restarted worker (worker clocks), except agent-sigterm "
          "(signal to the launcher's exit) and node-loss/node-join (the benchmark's kill/start "
          "to the first line).")  # fmt: skip
    if "hang" in rows:
        mh = [v for v in results[("hang", "meshrun")] if v is not None]
        target = args.hang_timeout + 2
        verdict = "met" if mh and max(mh) <= target else "MISSED"
        print(f"hang target (detected and restarted within {target:g} s): {verdict}")
    for note in notes:
        print("note: " + note)
    return 0


if __name__ == "__main__":
    sys.exit(main())
