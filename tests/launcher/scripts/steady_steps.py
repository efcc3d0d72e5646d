"""Train a tiny model with meshrun.parallel.ddp, one step every ~50 ms, until STOP (argv[1])
exists (60 s at most); each rank appends "ready" to READY (argv[2]) after its tenth step."""

import os
import sys
import time

import torch

import meshrun.parallel as mp

stop, ready = sys.argv[1], sys.argv[2]
ctx = mp.init(timeout=60)
model = mp.ddp(torch.nn.Linear(8, 8))
deadline = time.monotonic() + 60
step = 0
while not os.path.exists(stop) and time.monotonic() < deadline:
    time.sleep(0.05)
    model(torch.randn(4, 8)).sum().backward()
    step += 1
    if step == 10:
        with open(ready, "a") as f:
            f.write(f"{ctx.rank}\n")
os._exit(0)
