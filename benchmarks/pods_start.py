"""Do pods that start seconds apart form one first round? (Kubeflow elastic jobs, srun steps.)

Each trial starts two agents of one elastic job (``--nnodes 1:2``, c10d on 127.0.0.1, one worker
each) a random 0-2 s apart (seeded) and counts the trial as one round when every worker ran in
round 0 only (the workers started once; on GPUs, CUDA and NCCL set up once). Side by side in one
run, trials interleaved: meshrun as shipped (round 0's last call 5 s), meshrun with the old
``last_call_timeout=1`` for every round, and torchrun (torch's 30 s last call, fewer trials: each
waits it out when the second node is late).

    .venv/bin/python benchmarks/pods_start.py --trials 20 --torch-trials 5

Prints, per launcher: one-round starts out of its trials, and the median time from the first
agent's start to both workers running.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
WORKER = """\
import json, os, sys, time
import torch.distributed as dist
dist.init_process_group("gloo")
with open(sys.argv[1], "a") as f:
    f.write(json.dumps({"round": os.environ.get("MESHRUN_ROUND", os.environ.get(
        "TORCHELASTIC_RESTART_COUNT")), "world": dist.get_world_size(), "t": time.time()}) + "\\n")
dist.barrier()
os._exit(0)
"""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def command(kind: str, port: int, script: Path, records: Path) -> list[str]:
    common = ["--nnodes", "1:2", "--nproc-per-node", "1", "--rdzv-backend", "c10d",
              "--rdzv-endpoint", f"127.0.0.1:{port}", "--rdzv-id", "pods"]  # fmt: skip
    if kind == "torchrun":
        return [sys.executable, "-m", "torch.distributed.run", *common, str(script), str(records)]
    conf = ["--rdzv-conf", "last_call_timeout=1"] if kind == "meshrun last_call 1 s" else []
    return [sys.executable, "-m", "meshrun", *common, *conf, str(script), str(records)]


def trial(kind: str, delay: float, work: Path) -> tuple[bool, float]:
    """(one round, seconds from the first start to the second worker's record)."""
    script, records = work / "worker.py", work / f"records_{time.monotonic_ns()}.jsonl"
    script.write_text(WORKER)
    port = free_port()
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    start = time.time()
    procs = [subprocess.Popen(command(kind, port, script, records), env=env, cwd=work,
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)]  # fmt: skip
    time.sleep(delay)
    procs.append(subprocess.Popen(command(kind, port, script, records), env=env, cwd=work,
                                  stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))  # fmt: skip
    for p in procs:
        try:
            p.wait(90)
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()
    seen = [json.loads(line) for line in records.read_text().splitlines()] if records.exists() else []
    two = [r for r in seen if r["world"] == 2]
    one_round = bool(two) and len(seen) == 2 and {r["round"] for r in seen} == {"0"}
    ready = max(r["t"] for r in two) - start if two else float("nan")
    return one_round, ready


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--trials", type=int, default=20)
    ap.add_argument("--torch-trials", type=int, default=5)
    ap.add_argument("--max-apart", type=float, default=2.0)
    ap.add_argument("--seed", type=int, default=1)
    args = ap.parse_args()
    print(f"$ {' '.join(sys.argv)}")
    print(f"load average: {os.getloadavg()[0]:.2f}; 2 agents, 1 worker each, started "
          f"0-{args.max_apart:g} s apart (seed {args.seed})")
    rng = random.Random(args.seed)
    kinds = ["meshrun", "meshrun last_call 1 s", "torchrun"]
    results: dict[str, list[tuple[bool, float]]] = {k: [] for k in kinds}
    with tempfile.TemporaryDirectory(prefix="pods_") as tmp:
        for i in range(args.trials):
            delay = rng.uniform(0, args.max_apart)
            for kind in kinds:
                if kind == "torchrun" and i >= args.torch_trials:
                    continue
                results[kind].append(trial(kind, delay, Path(tmp)))
    print("| launcher | one first round | median to both workers running |")
    print("|---|---|---|")
    for kind, rows in results.items():
        ok = sum(one for one, _ in rows)
        times = [t for _, t in rows if t == t]
        median = f"{statistics.median(times):.2f} s" if times else "-"
        print(f"| {kind} | {ok}/{len(rows)} | {median} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
