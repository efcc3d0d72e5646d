"""Launch a worker script on N local processes and collect what each rank reported.

The launcher is chosen by ``MESHRUN_TEST_LAUNCHER``: ``meshrun`` runs
``python -m meshrun --nproc-per-node N script ...``; ``torchrun`` runs
``python -m torch.distributed.run --standalone --nproc-per-node N script ...``. Unset, it is
``meshrun`` when meshrun's launcher is importable, else ``torchrun``.

Workers report through `report()`: each rank writes ``rank<r>.json`` into the directory named
by ``MESHRUN_TEST_RESULTS``; `launch()` returns the list of those dicts, indexed by rank.
"""

from __future__ import annotations

import importlib.util
import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import traceback
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
WORKERS = Path(__file__).resolve().parent / "workers"
RESULTS_ENV = "MESHRUN_TEST_RESULTS"


@dataclass
class Launch:
    returncode: int
    output: str  # stdout and stderr of the launcher and workers, interleaved
    results: list[dict]  # one per rank that reported, indexed by rank (missing ranks: {})


def launcher_name() -> str:
    name = os.environ.get("MESHRUN_TEST_LAUNCHER")
    if name:
        if name not in ("meshrun", "torchrun"):
            raise ValueError(f"MESHRUN_TEST_LAUNCHER must be meshrun or torchrun (got {name!r})")
        return name
    return "meshrun" if importlib.util.find_spec("meshrun.launcher.cli") else "torchrun"


def launcher_command(nproc: int, launcher_args: tuple[str, ...] = ()) -> list[str]:
    if launcher_name() == "meshrun":
        return [sys.executable, "-m", "meshrun", "--nproc-per-node", str(nproc), *launcher_args]
    return [sys.executable, "-m", "torch.distributed.run", "--standalone",
            "--nproc-per-node", str(nproc), *launcher_args]


def launch(script: str | Path, nproc: int = 2, args: tuple[str, ...] = (), *,
           launcher_args: tuple[str, ...] = (), timeout: float = 90,
           check: bool = True) -> Launch:
    """Run ``script`` (a path, or a name in tests/parallel/workers) on ``nproc`` processes.

    Raises AssertionError (with the output) when ``check`` and the launch failed, or when it
    ran past ``timeout`` seconds (the launcher's whole process group is then killed).
    """
    script = Path(script)
    if not script.is_absolute():
        script = WORKERS / script
    with tempfile.TemporaryDirectory(prefix="meshrun-test-") as results_dir:
        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join([str(REPO), env.get("PYTHONPATH", "")]).rstrip(
            os.pathsep)
        env[RESULTS_ENV] = results_dir
        env.setdefault("OMP_NUM_THREADS", "1")
        cmd = [*launcher_command(nproc, launcher_args), str(script), *args]
        proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=subprocess.PIPE,
                                stderr=subprocess.STDOUT, text=True, start_new_session=True)
        try:
            output, _ = proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)  # the launcher and every worker
            output, _ = proc.communicate()
            raise AssertionError(f"{' '.join(cmd)} still running after {timeout} s; "
                                 f"killed. Output:\n{output}") from None
        results = []
        for rank in range(nproc):
            path = Path(results_dir) / f"rank{rank}.json"
            results.append(json.loads(path.read_text()) if path.exists() else {})
    if check:
        assert proc.returncode == 0, f"{' '.join(cmd)} exited {proc.returncode}:\n{output}"
    return Launch(proc.returncode, output, results)


def assert_all_ok(result: Launch) -> None:
    """Every rank reported, and every check it ran (`run_checks`) was "ok"; else the failing
    rank, check and traceback (or the launch output when a rank reported nothing)."""
    for rank, checks in enumerate(result.results):
        assert checks, f"rank {rank} reported nothing:\n{result.output}"
        for name, outcome in checks.items():
            assert outcome == "ok", f"rank {rank} {name}:\n{outcome}"


def run_one_process(script: str | Path, args: tuple[str, ...] = (), *, timeout: float = 120
                    ) -> subprocess.CompletedProcess:
    """Run ``script`` as plain ``python`` (no launcher, none of the torchrun environment: a
    world of one); raises AssertionError with the output when it exits non-zero."""
    env = {k: v for k, v in os.environ.items()
           if k not in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")}
    env.update(OMP_NUM_THREADS="1", PYTHONPATH=str(REPO))
    done = subprocess.run([sys.executable, str(script), *args], env=env, cwd=REPO,
                          capture_output=True, text=True, timeout=timeout)
    assert done.returncode == 0, done.stdout + done.stderr
    return done


def training_log(output: str) -> dict[int, tuple[float, float]]:
    """examples/train_char_lm.py's log lines ``step N | loss L | grad norm G | ...`` from rank
    0: ``{N: (L, G)}``, G the global gradient norm before clipping."""
    found = re.findall(r"step (\d+) \| loss ([0-9.]+) \| grad norm ([0-9.]+)", output)
    return {int(n): (float(loss), float(norm)) for n, loss, norm in found}


def kill_once_writing(proc: subprocess.Popen, partial: Path, timeout: float) -> str:
    """SIGKILL ``proc`` as soon as a save has a data file in ``partial`` (its
    ``<path>.partial`` directory); its stdout. Fails if the save ends first or never writes."""
    import time

    deadline = time.monotonic() + timeout
    while not (partial.is_dir() and any(partial.glob("*.distcp"))):
        assert proc.poll() is None, "the save finished before it could be killed"
        assert time.monotonic() < deadline, "the save never started writing"
        time.sleep(0.01)
    proc.send_signal(signal.SIGKILL)
    out, _ = proc.communicate(timeout=30)
    return out


def run_checks(checks, before_each=None) -> None:
    """Worker side: run each check (a function of the `ParallelContext`) on every rank, record
    "ok" or the traceback under its name, keep the ranks in step between checks (a failed check
    must not leave a collective or a message for the next one), and `report()` the results."""
    import torch.distributed as dist

    from meshrun.parallel import init

    ctx = init(timeout=60)
    results = {}
    for check in checks:
        if before_each is not None:
            before_each()
        try:
            check(ctx)
            results[check.__name__] = "ok"
        except Exception:
            results[check.__name__] = traceback.format_exc()
        dist.barrier()
    report(results)
    dist.destroy_process_group()
    exit_without_teardown()


def exit_without_teardown() -> None:
    """Leave the worker now: torch 2.13 + gloo sometimes aborts in C++ teardown after a clean
    finish ("terminate called without an active exception"), which would fail a passing run."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def report(result: dict) -> None:
    """Worker side: write this rank's result (a JSON-able dict) for `launch()` to collect."""
    path = Path(os.environ[RESULTS_ENV]) / f"rank{os.environ.get('RANK', '0')}.json"
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(result))
    os.replace(tmp, path)
