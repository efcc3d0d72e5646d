"""Two ranks train a tiny model with meshrun.parallel.ddp; rank SLOW_RANK (argv[1], -1 for
none) sleeps 0.1 s in every step before its forward: a straggler the others wait for."""

import os
import sys
import time

import torch

import meshrun.parallel as mp

slow = int(sys.argv[1])
ctx = mp.init(timeout=60)
torch.manual_seed(0)
model = mp.ddp(torch.nn.Linear(8, 8))
opt = torch.optim.SGD(model.parameters(), lr=0.1)
for _ in range(45):
    if ctx.rank == slow:
        time.sleep(0.1)
    else:
        time.sleep(0.01)
    model(torch.randn(4, 8)).sum().backward()
    opt.step()
    opt.zero_grad()
print(f"rank {ctx.rank} done", flush=True)
os._exit(0)
