"""A plain torch script that stalls until STOP (argv[1]) exists: rank 0 in its own reader,
every other rank waiting for it in a barrier; each rank appends its rank to READY (argv[2])
first."""

import datetime
import os
import sys
import time

import torch.distributed as dist

stop, ready = sys.argv[1], sys.argv[2]


def read_batch() -> None:
    deadline = time.monotonic() + 60
    while not os.path.exists(stop) and time.monotonic() < deadline:
        time.sleep(0.05)


dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=90))
with open(ready, "a") as f:
    f.write(f"{dist.get_rank()}\n")
if dist.get_rank() == 0:
    read_batch()
dist.barrier()
os._exit(0)
