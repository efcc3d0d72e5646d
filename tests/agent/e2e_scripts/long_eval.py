"""Steps with heartbeats, then a 5 s "evaluation" on every rank, then more steps.

Usage: long_eval.py MODE: "busy" wraps the evaluation in meshrun.parallel.busy() (progress, not
a hang), "busy-timeout" gives busy() a 1 s timeout (a hang after it), "bare" does not wrap it.
"""

import os
import sys
import time

import torch
import torch.distributed as dist

import meshrun.parallel as mp

mode = sys.argv[1]
ctx = mp.init(timeout=120)
for _ in range(3):
    dist.all_reduce(torch.ones(1))
    mp.heartbeat()
if mode == "bare":
    time.sleep(5)
else:
    with mp.busy("evaluation", timeout=1.0 if mode == "busy-timeout" else None):
        time.sleep(5)
for _ in range(3):
    dist.all_reduce(torch.ones(1))
    mp.heartbeat()
print(f"rank {ctx.rank} done", flush=True)
os._exit(0)
