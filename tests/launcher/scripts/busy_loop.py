"""A correct plain torch script that keeps every rank busy in all_reduces until STOP (argv[1])
exists; each rank appends its rank to READY (argv[2]) once it runs."""

import datetime
import os
import sys
import time

import torch
import torch.distributed as dist

stop, ready = sys.argv[1], sys.argv[2]
dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=90))
with open(ready, "a") as f:
    f.write(f"{dist.get_rank()}\n")
deadline = time.monotonic() + 60
while not os.path.exists(stop) and time.monotonic() < deadline:
    flag = torch.tensor([float(os.path.exists(stop))])
    dist.all_reduce(flag)
    if flag.item():
        break
    time.sleep(0.002)
dist.destroy_process_group()
