"""A plain torch script (gloo, no meshrun.parallel but its heartbeat) whose ranks fall out of
step after a few good all_reduces; its collectives time out after argv[2] seconds, so only
meshrun's --desync-check names the mistake quickly.

Modes (argv[1]):
- ``reorder``: the last rank calls barrier, then all_reduce; the others all_reduce, then barrier;
- ``shape``: rank 1 all-reduces a 2x4 tensor where the others all-reduce 8 values (the same
  bytes: gloo reduces them without a word, and the training goes on);
- ``skip-hang``: rank 0 skips one all_reduce, then every rank makes the same calls; rank 0 ends
  its loop one call early and does its own work without a heartbeat while the others wait;
- ``skip-end``: the same, but rank 0 exits when its loop ends.

Before the first mismatched call each rank prints ``desync_mistakes: mismatch at <time.time()>``.
"""

import datetime
import sys
import time

import torch
import torch.distributed as dist

from meshrun.parallel import heartbeat

mode, timeout_s = sys.argv[1], float(sys.argv[2])
dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=timeout_s))
rank, world = dist.get_rank(), dist.get_world_size()
x = torch.ones(1024)
for _ in range(4):  # good steps (the record is written every 0.5 s)
    dist.all_reduce(x)
    heartbeat()
    time.sleep(0.2)

print(f"desync_mistakes: mismatch at {time.time():.3f}", flush=True)
if mode == "reorder":
    if rank == world - 1:
        dist.barrier()  # the mistake: the calls in another order
        dist.all_reduce(x)
    else:
        dist.all_reduce(x)
        dist.barrier()
elif mode == "shape":
    for _ in range(50):
        dist.all_reduce(torch.ones(2, 4) if rank == 1 else torch.ones(8))
        heartbeat()
        time.sleep(0.1)
elif mode.startswith("skip"):
    for step in range(6):
        if not (rank == 0 and step == 1):  # the mistake: rank 0 skips one all_reduce
            dist.all_reduce(x)
        heartbeat()
        time.sleep(0.1)
    if mode == "skip-hang" and rank == 0:
        time.sleep(3 * timeout_s)  # its own work (an evaluation, say); the others wait
print(f"desync_mistakes: rank {rank} done", flush=True)
