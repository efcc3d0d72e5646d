"""The worker of benchmarks/faults.py (the same script under meshrun and torchrun).

First line, before ``import torch``: ``START rank=R inc=N world=W t=T`` (N: how many times
this rank has started in this run with this world size, from marker files in BENCH_DIR; t: ``time.time()``). A
later incarnation (N > 1) only sleeps: the benchmark has what it measures and stops the run.
The first incarnation joins gloo, prints ``READY``, then all_reduces every 0.1 s with
``meshrun.parallel.heartbeat()`` (a no-op outside meshrun's hang detection); at step 5 the rank
BENCH_FAULT_RANK prints ``FAULT rank=R t=T`` and does BENCH_FAULT: raise | exit | sigkill |
segv | hang (sleeps) | none.
"""

import os
import sys
import time

rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
bench = os.environ["BENCH_DIR"]
marker = os.path.join(bench, f"seen_{rank}_w{world}")
inc = 1
while os.path.exists(f"{marker}_{inc}"):
    inc += 1
open(f"{marker}_{inc}", "w").close()
print(f"START rank={rank} inc={inc} world={world} t={time.time():.6f}", flush=True)
if inc > 1:
    time.sleep(600)
    sys.exit(0)

from datetime import timedelta  # noqa: E402

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

import meshrun.parallel as mp  # noqa: E402

fault, fault_rank = (
    os.environ.get("BENCH_FAULT", "none"),
    int(os.environ.get("BENCH_FAULT_RANK", "1")),
)
dist.init_process_group("gloo", timeout=timedelta(seconds=60))
dist.all_reduce(torch.ones(1))
print(f"READY rank={rank} world={world} t={time.time():.6f}", flush=True)
step = 0
while True:
    step += 1
    if step == 5 and rank == fault_rank and fault != "none":
        print(f"FAULT rank={rank} t={time.time():.6f}", flush=True)
        if fault == "raise":
            raise RuntimeError("benchmark fault")
        if fault == "exit":
            sys.exit(3)
        if fault == "sigkill":
            os.kill(os.getpid(), 9)
        if fault == "segv":
            import ctypes

            ctypes.string_at(0)
        if fault == "hang":
            time.sleep(600)
    dist.all_reduce(torch.ones(1))
    mp.heartbeat()
    time.sleep(0.1)
