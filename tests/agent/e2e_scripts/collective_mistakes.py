"""A plain torch script (no meshrun.parallel) with one of the classic collective mistakes, after
one good all_reduce; the collectives time out after argv[2] seconds.

Modes (argv[1]):
- ``odd-op``: rank 1 calls broadcast where the others call all_reduce;
- ``skip``: rank 0 skips the second all_reduce under a branch, then works on its own;
- ``skip-then-barrier``: rank 0 skips it and goes on to a barrier;
- ``shapes``: rank 1 all-reduces 8 values where the others all-reduce 4.
"""

import datetime
import sys
import time

import torch
import torch.distributed as dist

mode, timeout_s = sys.argv[1], float(sys.argv[2])
dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=timeout_s))
rank = dist.get_rank()
x = torch.ones(4)
dist.all_reduce(x)


def train_step():
    if mode == "odd-op" and rank == 1:
        dist.broadcast(x, src=0)
    elif mode == "shapes" and rank == 1:
        dist.all_reduce(torch.ones(8))
    elif mode.startswith("skip") and rank == 0:
        pass  # the mistake: rank 0 skips this collective
    else:
        dist.all_reduce(x)


print(f"collective_mistakes: first collective at {time.time():.3f}", flush=True)
train_step()
if mode == "skip-then-barrier":
    dist.barrier()
elif mode == "skip" and rank == 0:
    time.sleep(3 * timeout_s)  # its own work; the others wait for the skipped all_reduce
