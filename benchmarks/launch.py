"""Launch overhead, restart latency and restart success: meshrun vs torchrun, interleaved.

Usage (from the repository root, with the project's virtual environment):

    .venv/bin/python benchmarks/launch.py [--repeats 5] [--restart-runs 10] [--cap 60]
                                          [--warmup 1] [--verbose]

Both launchers start 2 gloo workers (``benchmarks/_launch_worker.py``) that print
``START rank=<r> attempt=<a> t=...`` as their first line (before ``import torch``), then
``READY ...`` once ``init_process_group("gloo")`` and one ``all_reduce`` are done, i.e. once
the job is usable. Runs alternate m, t, m, t, ... so that background load hits both alike.

(a) launch overhead: from just before ``Popen`` to the arrival (on the launcher's stdout pipe,
    read line by line and timestamped) of the last worker's first line (``START``), and of its
    ``READY`` line; and to the launcher's exit. Median of ``--repeats`` runs.
(b) restart latency: with ``--max-restarts 1``, rank 1 prints ``FAIL t=...`` on attempt 0 and
    exits 1 right after the all_reduce (rank 0 keeps running); latency = the earliest worker
    timestamp of a ``START ... attempt=1`` line (and of a ``READY`` line) minus the ``FAIL``
    timestamp (both worker-side ``time.time()``, same host clock). Median over the successful
    restart runs. The first line measures the launcher; ``READY`` adds the worker's own
    ``import torch`` and process-group setup, the same under both launchers.
(c) restart success: the launcher exits 0, with both ranks READY on attempt 1, within ``--cap``
    seconds (else the launcher's process group, and every process it started, is killed).

torchrun 2.x reuses its rendezvous TCPStore across restarts (pytorch#135712), so it is timed
with ``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1``; its default configuration is run too, for the
success rate only. ``OMP_NUM_THREADS=1`` for both. Every run gets its own TMPDIR and working
directory, removed afterwards.
"""

from __future__ import annotations

import argparse
import os
import re
import shlex
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path

try:
    import psutil
except ImportError:  # pragma: no cover - psutil is a meshrun dependency
    psutil = None

HERE = Path(__file__).resolve().parent
WORKER = HERE / "_launch_worker.py"
NPROC = 2
TAG_ENV = "MESHRUN_BENCH_LAUNCH_TAG"  # marks every process a run started, to clean up orphans
EXTRA_ENV: dict[str, str] = {}  # --trace: LAUNCH_BENCH_TRACE=1 for the workers

READY_RE = re.compile(r"READY rank=(\d+) attempt=(\S+) t=([0-9.]+)")
START_RE = re.compile(r"START rank=(\d+) attempt=(\S+) t=([0-9.]+)")
FAIL_RE = re.compile(r"FAIL rank=(\d+) attempt=(\S+) t=([0-9.]+)")


@dataclass
class Line:
    wall: float  # time.time() when the benchmark read it
    stream: str  # "out" | "err"
    text: str


@dataclass
class Run:
    name: str
    argv: list[str]
    start: float = 0.0  # time.time() just before Popen
    end: float | None = None  # time.time() when the launcher exit was observed
    rc: int | None = None
    timed_out: bool = False
    lines: list[Line] = field(default_factory=list)
    load1: float = 0.0

    @property
    def to_exit(self) -> float | None:
        return None if self.end is None else self.end - self.start

    def ready(self, attempt: str, pattern: re.Pattern = READY_RE) -> dict[int, tuple[float, float]]:
        """rank -> (arrival time on the pipe, worker's own time.time()) of its READY line."""
        found: dict[int, tuple[float, float]] = {}
        for ln in self.lines:
            for m in pattern.finditer(ln.text):
                if m.group(2) == attempt and int(m.group(1)) not in found:
                    found[int(m.group(1))] = (ln.wall, float(m.group(3)))
        return found

    def fail_time(self) -> float | None:
        for ln in self.lines:
            m = FAIL_RE.search(ln.text)
            if m:
                return float(m.group(3))
        return None

    # (a)
    def to_all_started(self) -> float | None:
        return self.to_all_ready(START_RE)

    def to_all_ready(self, pattern: re.Pattern = READY_RE) -> float | None:
        r = self.ready("0", pattern)
        if self.rc != 0 or len(r) < NPROC:
            return None
        return max(arrival for arrival, _ in r.values()) - self.start

    # (b), (c)
    def restart_ok(self) -> bool:
        return not self.timed_out and self.rc == 0 and len(self.ready("1")) == NPROC

    def restart_latency_to_start(self) -> float | None:
        return self.restart_latency(START_RE)

    def restart_latency(self, pattern: re.Pattern = READY_RE) -> float | None:
        fail, r = self.fail_time(), self.ready("1", pattern)
        if not self.restart_ok() or fail is None:
            return None
        return min(worker_t for _, worker_t in r.values()) - fail

    def trace(self) -> str:
        out = [
            f"    {self.name}: rc={self.rc} timed_out={self.timed_out} argv={shlex.join(self.argv)}"
        ]
        for ln in self.lines:
            out.append(f"      +{ln.wall - self.start:7.3f}s {ln.stream} {ln.text[:160]}")
        if self.end is not None:
            out.append(f"      +{self.end - self.start:7.3f}s exit rc={self.rc}")
        return "\n".join(out)


# -- running one launcher, bounded -------------------------------------------------------------
def _tagged(tag: str) -> list:
    """Live processes whose environment carries this run's tag (ours: we set it)."""
    if psutil is None:
        return []
    found = []
    for p in psutil.process_iter(["pid"]):
        if p.pid == os.getpid():
            continue
        try:
            if p.environ().get(TAG_ENV) == tag and p.status() != psutil.STATUS_ZOMBIE:
                found.append(p)
        except (psutil.Error, OSError):
            continue
    return found


def _kill_everything(proc: subprocess.Popen, tag: str, grace: float = 2.0) -> None:
    """SIGTERM then SIGKILL: the launcher's process group, and every process tagged by the run
    (workers may sit in sessions of their own, or have been re-parented)."""
    victims = _tagged(tag)
    for sig in (signal.SIGTERM, signal.SIGKILL):
        try:
            os.killpg(proc.pid, sig)
        except OSError:
            pass
        for p in victims + _tagged(tag):
            try:
                p.send_signal(sig)
            except (psutil.Error, OSError):
                pass
        if sig == signal.SIGTERM:
            try:
                proc.wait(timeout=grace)
            except subprocess.TimeoutExpired:
                pass
    try:
        proc.wait(timeout=10)
    except subprocess.TimeoutExpired:
        pass


def _reader(pipe, stream: str, sink: list[Line], lock: threading.Lock) -> None:
    for raw in iter(pipe.readline, b""):
        now = time.time()
        with lock:
            sink.append(Line(now, stream, raw.decode(errors="replace").rstrip("\r\n")))
    pipe.close()


def run_launcher(name: str, argv: list[str], env_extra: dict[str, str], cap: float) -> Run:
    run = Run(name, argv)
    tag = uuid.uuid4().hex
    tmp = tempfile.mkdtemp(prefix="meshrun_bench_launch_")
    env = dict(os.environ)
    env.pop("TORCH_DISABLE_SHARE_RDZV_TCP_STORE", None)
    env.update(OMP_NUM_THREADS="1", TMPDIR=tmp, **{TAG_ENV: tag})
    env.update(EXTRA_ENV)
    env.update(env_extra)
    lock = threading.Lock()
    try:
        run.load1 = os.getloadavg()[0]
        run.start = time.time()
        proc = subprocess.Popen(
            argv,
            cwd=tmp,
            env=env,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            start_new_session=True,
            bufsize=0,
        )
        readers = [
            threading.Thread(
                target=_reader, args=(proc.stdout, "out", run.lines, lock), daemon=True
            ),
            threading.Thread(
                target=_reader, args=(proc.stderr, "err", run.lines, lock), daemon=True
            ),
        ]
        for t in readers:
            t.start()
        try:
            run.rc = proc.wait(timeout=cap)
            run.end = time.time()
        except subprocess.TimeoutExpired:
            run.timed_out = True
            _kill_everything(proc, tag)
            run.rc = proc.returncode
        # Workers the launcher left behind (should be none) would hold the pipes open.
        leftovers = _tagged(tag)
        if leftovers:
            print(
                f"  warning: {name} left {len(leftovers)} process(es) behind; killing them",
                file=sys.stderr,
            )
            _kill_everything(proc, tag, grace=0.5)
        for t in readers:
            t.join(timeout=5)
        with lock:
            run.lines.sort(key=lambda ln: ln.wall)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return run


# -- the benchmark --------------------------------------------------------------------------------
def _launcher(path: str | None, name: str) -> str:
    if path:
        return path
    beside = Path(sys.executable).parent / name
    found = str(beside) if beside.exists() else shutil.which(name)
    if not found:
        sys.exit(
            f"launch.py: cannot find {name!r} (beside {sys.executable} or on PATH); pass --{name}"
        )
    return found


def _median(xs: list[float]) -> float | None:
    return statistics.median(xs) if xs else None


def _fmt(x: float | None) -> str:
    return "n/a" if x is None else f"{x:.2f}"


def _ratio(a: float | None, b: float | None) -> str:
    return "n/a" if a is None or b is None or b == 0 else f"{a / b:.2f}x"


def _spread(xs: list[float]) -> str:
    return "n/a" if not xs else f"{min(xs):.2f}..{max(xs):.2f}"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--repeats", type=int, default=5, help="launch runs per launcher (default 5)")
    ap.add_argument(
        "--restart-runs",
        type=int,
        default=10,
        help="restart runs per launcher configuration (default 10)",
    )
    ap.add_argument(
        "--cap",
        type=float,
        default=60.0,
        help="seconds a run may take before its launcher is killed (default 60)",
    )
    ap.add_argument(
        "--warmup", type=int, default=1, help="untimed launch runs per launcher first (default 1)"
    )
    ap.add_argument("--meshrun", help="the meshrun executable (default: beside this python)")
    ap.add_argument("--torchrun", help="the torchrun executable (default: beside this python)")
    ap.add_argument(
        "--verbose", action="store_true", help="print every run's timestamped launcher output"
    )
    ap.add_argument(
        "--trace",
        action="store_true",
        help="workers also print timestamped phases on stderr (implies --verbose)",
    )
    args = ap.parse_args()
    args.verbose = args.verbose or args.trace
    if args.repeats < 1 or args.restart_runs < 1:
        ap.error("--repeats and --restart-runs must be >= 1")

    meshrun, torchrun = _launcher(args.meshrun, "meshrun"), _launcher(args.torchrun, "torchrun")
    worker = [str(WORKER)]
    m_launch = [meshrun, "--nproc-per-node", str(NPROC), *worker]
    t_launch = [torchrun, "--standalone", "--nproc-per-node", str(NPROC), *worker]
    m_restart = [meshrun, "--nproc-per-node", str(NPROC), "--max-restarts", "1", *worker, "--fail"]
    t_restart = [
        torchrun,
        "--standalone",
        "--nproc-per-node",
        str(NPROC),
        "--max-restarts",
        "1",
        *worker,
        "--fail",
    ]
    t_fixed = {"TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"}
    if args.trace:
        global EXTRA_ENV
        EXTRA_ENV = {"LAUNCH_BENCH_TRACE": "1"}

    def progress(run: Run, what: str) -> None:
        print(
            f"  {run.name:<17} {what:<40} rc={run.rc} load1={run.load1:.2f}"
            + (" TIMED OUT (killed)" if run.timed_out else ""),
            file=sys.stderr,
            flush=True,
        )
        if args.verbose:
            print(run.trace(), file=sys.stderr, flush=True)

    load_start = os.getloadavg()
    wall_start = time.monotonic()
    all_runs: list[Run] = []

    for _ in range(args.warmup):
        for name, argv, extra in (("meshrun", m_launch, {}), ("torchrun", t_launch, t_fixed)):
            r = run_launcher(f"{name} (warmup)", argv, extra, args.cap)
            progress(r, f"ready {_fmt(r.to_all_ready())} s, exit {_fmt(r.to_exit)} s")

    # (a) launch overhead, interleaved m, t, m, t, ...
    launch: dict[str, list[Run]] = {"meshrun": [], "torchrun": []}
    for i in range(args.repeats):
        for name, argv, extra in (("meshrun", m_launch, {}), ("torchrun", t_launch, t_fixed)):
            r = run_launcher(name, argv, extra, args.cap)
            launch[name].append(r)
            all_runs.append(r)
            progress(
                r,
                f"launch {i + 1}/{args.repeats}: ready {_fmt(r.to_all_ready())} s, "
                f"exit {_fmt(r.to_exit)} s",
            )

    # (b), (c) restarts, interleaved m, t (fixed store), t (default), ...
    n_restart = max(args.restart_runs, args.repeats)  # (b) needs >= --repeats samples
    restart: dict[str, list[Run]] = {"meshrun": [], "torchrun": [], "torchrun default": []}
    configs = (
        ("meshrun", m_restart, {}),
        ("torchrun", t_restart, t_fixed),
        ("torchrun default", t_restart, {}),
    )
    for i in range(n_restart):
        for name, argv, extra in configs:
            r = run_launcher(name, argv, extra, args.cap)
            restart[name].append(r)
            all_runs.append(r)
            progress(
                r,
                f"restart {i + 1}/{n_restart}: ok={r.restart_ok()} "
                f"latency {_fmt(r.restart_latency())} s",
            )

    load_end = os.getloadavg()
    elapsed = time.monotonic() - wall_start

    def col(runs: list[Run], f) -> list[float]:
        return [v for v in (f(r) for r in runs) if v is not None]

    started = {k: col(v, Run.to_all_started) for k, v in launch.items()}
    ready = {k: col(v, Run.to_all_ready) for k, v in launch.items()}
    to_exit = {k: col(v, lambda r: r.to_exit if r.rc == 0 else None) for k, v in launch.items()}
    latency_start = {k: col(v, Run.restart_latency_to_start) for k, v in restart.items()}
    latency = {k: col(v, Run.restart_latency) for k, v in restart.items()}
    ok = {k: sum(r.restart_ok() for r in v) for k, v in restart.items()}

    loads = [r.load1 for r in all_runs]
    print(f"command: {shlex.join([sys.executable, *sys.argv])}")
    print(f"launchers: meshrun = {shlex.join(m_launch)}")
    print(f"           torchrun = TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 {shlex.join(t_launch)}")
    print("           restart runs add: --max-restarts 1 ... --fail; OMP_NUM_THREADS=1 for all")
    print(
        f"machine: nproc={os.cpu_count()} (usable {len(os.sched_getaffinity(0))}), "
        f"load average at start {' '.join(f'{x:.2f}' for x in load_start)}, "
        f"at end {' '.join(f'{x:.2f}' for x in load_end)}, 1-min load over the runs "
        f"{min(loads):.2f}..{max(loads):.2f} (median {statistics.median(loads):.2f}); "
        f"benchmark took {elapsed:.0f} s"
    )
    print()
    rows = [
        ("(a) launch to every worker's first line (median s)", started),
        ("launch to all workers ready, after one all_reduce (median s)", ready),
        ("launch to exit (median s)", to_exit),
        ("(b) restart latency, failure to first line (median s)", latency_start),
        ("restart latency, failure to ready (median s)", latency),
    ]
    print("| metric | meshrun | torchrun | meshrun / torchrun |")
    print("|---|---|---|---|")
    for label, d in rows:
        m, t = _median(d["meshrun"]), _median(d["torchrun"])
        print(f"| {label} | {_fmt(m)} | {_fmt(t)} | {_ratio(m, t)} |")
    print(
        f"| (c) restart success (x/N) | {ok['meshrun']}/{n_restart} | {ok['torchrun']}/{n_restart} | |"
    )
    print(f"| torchrun default restart success (x/N) | | {ok['torchrun default']}/{n_restart} | |")
    print()
    print(
        "spread (min..max, n): "
        + "; ".join(
            f"{label.split(' (')[0]}: meshrun {_spread(d['meshrun'])} "
            f"(n={len(d['meshrun'])}), torchrun {_spread(d['torchrun'])} "
            f"(n={len(d['torchrun'])})"
            for label, d in rows
        )
    )
    if latency["torchrun default"]:
        print(
            f"torchrun default, successful runs' restart latency: median "
            f"{_fmt(_median(latency['torchrun default']))} s"
        )
    timeouts = {k: sum(r.timed_out for r in v) for k, v in restart.items()}
    print(
        f"restart runs killed at the {args.cap:g} s cap: "
        + ", ".join(f"{k} {v}" for k, v in timeouts.items())
    )
    print()
    print(
        "targets (issue): (a) at most 1.0x torchrun, aim 0.6x; (b) at most 0.5x torchrun; "
        "(c) 100 %."
    )
    print(
        "known here for torchrun: (a) about 1.1 s to the first line, 3.0 s to exit; "
        "(b) about 0.63 s."
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
