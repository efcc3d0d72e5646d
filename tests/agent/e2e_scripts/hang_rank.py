"""Two ranks step through all_reduces with meshrun.parallel.heartbeat(); one of them hangs.

Usage: hang_rank.py HANG_RANK [ATTEMPT]: rank HANG_RANK sleeps forever at step 3 on restart
attempt ATTEMPT (default 0; -1 never), while the other waits in the all_reduce. Exits 0 after
10 steps otherwise, with os._exit (torch 2.13 + gloo sometimes aborts in its C++ teardown at
interpreter exit, which is not what these tests check).
"""

import os
import sys
import time

import torch
import torch.distributed as dist

import meshrun.parallel as mp

hang_rank = int(sys.argv[1])
attempt = int(sys.argv[2]) if len(sys.argv) > 2 else 0
ctx = mp.init(timeout=120)
restart = int(os.environ["TORCHELASTIC_RESTART_COUNT"])
for step in range(10):
    if ctx.rank == hang_rank and step == 3 and restart == attempt:
        time.sleep(600)  # the hang
    dist.all_reduce(torch.ones(1))
    mp.heartbeat()
print(f"rank {ctx.rank} finished on attempt {restart}", flush=True)
os._exit(0)
