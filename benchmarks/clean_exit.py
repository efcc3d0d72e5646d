"""Do finished scripts exit 0? torch's teardown abort under CPU load, meshrun vs torchrun.

torch 2.13 + gloo: a script whose work is done can die at interpreter exit with "terminate
called without an active exception" (SIGABRT), and its launcher reports the job failed
(`meshrun.exit_guard` explains the race). Each trial launches one two-worker job of a script
while two busy processes load both cores; trials are interleaved across launchers. Scripts:

- ``ddp``: a plain torch DDP script (torchrun-style, no meshrun import): 10 steps, then ends;
- ``tp``: a meshrun.parallel script (``init()``, ``parallelize`` a 2-layer MLP): 10 steps.

Launchers: meshrun as shipped (the exit guard), meshrun with ``MESHRUN_EXIT_GUARD=0`` (before),
and torchrun (under which ``init()`` still installs the guard, so its tp column has it too).

    .venv/bin/python benchmarks/clean_exit.py --trials 20

Prints, per script and launcher: clean exits out of trials, and how many ended in SIGABRT.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
DDP = """\
import torch, torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel
dist.init_process_group("gloo")
torch.manual_seed(0)
model = DistributedDataParallel(torch.nn.Linear(64, 64))
opt = torch.optim.SGD(model.parameters(), lr=0.1)
for _ in range(10):
    model(torch.randn(32, 64)).pow(2).mean().backward()
    opt.step()
    opt.zero_grad()
print("done", dist.get_rank(), flush=True)
"""
TP = """\
import torch
from meshrun import parallel
ctx = parallel.init()
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(64, 128), torch.nn.ReLU(), torch.nn.Linear(128, 64))
parallel.parallelize(model, None, {"0": parallel.ColwiseParallel(), "2": parallel.RowwiseParallel()})
opt = torch.optim.SGD(model.parameters(), lr=0.1)
for _ in range(10):
    model(torch.randn(32, 64)).pow(2).mean().backward()
    opt.step()
    opt.zero_grad()
print("done", ctx.rank, flush=True)
"""
SCRIPTS = {"ddp": DDP, "tp": TP}
LOAD = "while True: pass"


def _launchers(torchrun: str) -> dict[str, tuple[list[str], dict[str, str]]]:
    meshrun = [sys.executable, "-m", "meshrun", "--nproc-per-node", "2"]
    return {
        "meshrun": (meshrun, {}),
        "meshrun, guard off": (meshrun, {"MESHRUN_EXIT_GUARD": "0"}),
        "torchrun": ([torchrun, "--standalone", "--nproc-per-node", "2"], {}),
    }


def _trial(argv: list[str], extra_env: dict[str, str], script: Path) -> int:
    env = {**os.environ, "PYTHONPATH": str(REPO), **extra_env}
    done = subprocess.run([*argv, str(script)], env=env, capture_output=True, timeout=300,
                          cwd=script.parent)  # fmt: skip
    return done.returncode


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--trials", type=int, default=20)
    ap.add_argument("--scripts", default="ddp,tp", help="comma-separated: ddp, tp")
    ap.add_argument("--load", type=int, default=2, help="busy processes beside each trial")
    args = ap.parse_args()
    torchrun = str(Path(sys.executable).parent / "torchrun")
    launchers = _launchers(torchrun)
    names = [s for s in args.scripts.split(",") if s]
    codes: dict[tuple[str, str], list[int]] = {(s, n): [] for s in names for n in launchers}
    load = [subprocess.Popen([sys.executable, "-c", LOAD]) for _ in range(args.load)]
    try:
        with tempfile.TemporaryDirectory() as tmp:
            files = {s: Path(tmp, f"{s}_script.py") for s in names}
            for s, path in files.items():
                path.write_text(SCRIPTS[s])
            for trial in range(args.trials):
                for s in names:
                    for name, (argv, extra) in launchers.items():
                        codes[(s, name)].append(_trial(argv, extra, files[s]))
                print(f"trial {trial + 1}/{args.trials} done", file=sys.stderr, flush=True)
    finally:
        for p in load:
            p.kill()
            p.wait()
    print(f"\n{args.trials} trials per cell, 2 workers each, {args.load} busy processes beside")
    print(f"{'script':<8}{'launcher':<22}{'exit 0':>8}{'SIGABRT':>9}{'other':>7}")
    for (s, name), rcs in codes.items():
        aborts = sum(rc in (134, -6) for rc in rcs)
        clean = sum(rc == 0 for rc in rcs)
        print(f"{s:<8}{name:<22}{clean:>5}/{len(rcs):<2}{aborts:>9}{len(rcs) - clean - aborts:>7}")


if __name__ == "__main__":
    main()
