"""What ``--desync-check`` costs a torch-DDP training step, beside torch's own check.

Runs a training loop (`benchmarks/_desync_worker.py`: an MLP, 2 ranks, gloo, CPU, data
parallel by torch's DistributedDataParallel, and, the same model, by one ``all_reduce`` per
gradient: torch 2.13's DDP constructor crashes under DETAIL, so that loop is where torch's
check can be timed) under a real ``meshrun --nproc-per-node 2`` three ways, the modes
alternated round by round so that the machine's load falls on all three alike:

- ``off``: no check;
- ``meshrun``: ``meshrun --desync-check`` (the agent compares the ranks' collective records,
  `meshrun.agent.desync`; nothing is added to the workers' collectives);
- ``torch DETAIL``: ``TORCH_DISTRIBUTED_DEBUG=DETAIL`` in the workers (torch's fingerprint
  check: an all-gather of each call's fingerprint before the call, through a helper group),
  what ``--desync-check`` set before issue 48.

Prints, side by side for each loop, the median step time of each mode over all rounds (rank
0's steps after the warm-up), its ratio to ``off``, the spread of the per-round medians (max -
min over their median: the run-to-run noise), and the agent's own CPU time per second of the
run (what the check adds on the agent's side; the workers run the same code in ``off`` and
``meshrun``: the record is on in both); a mode whose run fails is shown with its exit status.
The target is at most 1.2x a DDP step.

Usage::

    .venv/bin/python benchmarks/desync.py [--rounds 3] [--steps 40] [--warmup 5] [--width 512]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import psutil

HERE = Path(__file__).resolve().parent
WORKER = HERE / "_desync_worker.py"
MODES = ("off", "meshrun", "torch DETAIL")
LOOPS = ("ddp", "manual")


def one_run(mode: str, loop: str, steps: int, warmup: int, width: int, tmp: Path) -> dict:
    """One meshrun job in ``mode``; rank 0's result (`_desync_worker.py`), or ``{"failed":
    exit status}`` when the job failed."""
    out = tmp / f"{loop}_{mode.replace(' ', '_')}.json"
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    env.pop("TORCH_DISTRIBUTED_DEBUG", None)
    args = [sys.executable, "-m", "meshrun", "--nproc-per-node", "2", "--monitor-interval",
            "0.1"]  # fmt: skip
    if mode == "meshrun":
        args.append("--desync-check")
    elif mode == "torch DETAIL":
        env["TORCH_DISTRIBUTED_DEBUG"] = "DETAIL"
    args += [str(WORKER), str(out), str(steps), str(warmup), str(width), loop]
    t0 = time.monotonic()
    with tempfile.TemporaryFile("w+") as err:
        proc = subprocess.Popen(args, env=env, cwd=HERE.parent, stdout=subprocess.DEVNULL,
                                stderr=err, text=True)  # fmt: skip
        agent = psutil.Process(proc.pid)
        cpu = 0.0
        while proc.poll() is None:  # the agent's own CPU time (not its workers'), last seen
            try:
                t = agent.cpu_times()
                cpu = t.user + t.system
            except psutil.Error:
                pass
            time.sleep(0.2)
    wall = time.monotonic() - t0
    if proc.returncode != 0:
        return {"failed": proc.returncode}
    return {**json.loads(out.read_text()), "agent_cpu_ms_per_s": 1000 * cpu / wall}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--width", type=int, default=512, help="the MLP's hidden width")
    a = p.parse_args()
    times = {(loop, m): [] for loop in LOOPS for m in MODES}
    agent_cpu = {(loop, m): [] for loop in LOOPS for m in MODES}
    medians = {(loop, m): [] for loop in LOOPS for m in MODES}
    failed: dict[tuple[str, str], int] = {}
    params = 0
    with tempfile.TemporaryDirectory() as tmp:
        for _ in range(a.rounds):
            for loop in LOOPS:
                for mode in MODES:
                    if (loop, mode) in failed:
                        continue
                    result = one_run(mode, loop, a.steps, a.warmup, a.width, Path(tmp))
                    if "failed" in result:
                        failed[(loop, mode)] = result["failed"]
                        continue
                    want = "DETAIL" if mode == "torch DETAIL" else "OFF"
                    assert want in result["debug"], (mode, result["debug"])
                    times[(loop, mode)] += result["times"]
                    medians[(loop, mode)].append(statistics.median(result["times"]))
                    agent_cpu[(loop, mode)].append(result["agent_cpu_ms_per_s"])
                    params = result["params"]
    print(f"MLP of {params / 1e6:.2f}M parameters, 2 ranks, gloo, CPU; {a.rounds} rounds x "
          f"{a.steps} steps (after {a.warmup} warm-up) per mode, modes alternated")
    print("| loop | mode | ms/step (median) | vs off | noise (per-round medians) | agent CPU "
          "ms/s |")
    print("|---|---|---|---|---|---|")
    for loop in LOOPS:
        base = statistics.median(times[(loop, "off")]) if times[(loop, "off")] else None
        name = "torch DDP" if loop == "ddp" else "all_reduce per gradient"
        for mode in MODES:
            if (loop, mode) in failed:
                print(f"| {name} | {mode} | failed: exit {failed[(loop, mode)]} | - | - | - |")
                continue
            m = statistics.median(times[(loop, mode)])
            runs = medians[(loop, mode)]
            spread = (max(runs) - min(runs)) / statistics.median(runs)
            ratio = f"{m / base:.2f}x" if base else "-"
            cpu = statistics.median(agent_cpu[(loop, mode)])
            print(f"| {name} | {mode} | {1000 * m:.1f} | {ratio} | {100 * spread:.1f} % | "
                  f"{cpu:.0f} |")

if __name__ == "__main__":
    main()
