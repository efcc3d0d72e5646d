"""The worker of the two-agent launch in ``benchmarks/rendezvous.py``.

Joins the gloo process group the launcher set up (torchrun's environment contract), does one
all_reduce, prints one line, and records the wall-clock time of that line in
``$RDZV_BENCH_DIR/rank<RANK>`` (the parent reads the files, so the measurement does not depend
on how each launcher forwards output).
"""

import os
import time

import torch
import torch.distributed as dist

dist.init_process_group("gloo")
t = torch.ones(1)
dist.all_reduce(t)
now = time.time()
rank = dist.get_rank()
print(f"rank {rank}/{dist.get_world_size()} ready, all_reduce={t.item():g}", flush=True)
path = os.path.join(os.environ["RDZV_BENCH_DIR"], f"rank{rank}")
with open(path + ".tmp", "w") as f:
    f.write(repr(now))
os.replace(path + ".tmp", path)
dist.destroy_process_group()
