"""Ranks step through all_reduces with heartbeats; at step 3 rank ODD (argv[1]) calls broadcast
where the others call all_reduce: every rank then waits, in two different collectives."""

import os
import sys

import torch
import torch.distributed as dist

import meshrun.parallel as mp

odd = int(sys.argv[1])
ctx = mp.init(timeout=120)
for step in range(6):
    if step == 3 and ctx.rank == odd:
        dist.broadcast(torch.ones(1), src=odd)
    else:
        dist.all_reduce(torch.ones(1))
    mp.heartbeat()
os._exit(0)
