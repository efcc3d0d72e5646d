"""A correct script: both ranks make the same 400 all_reduces and destroy their process group (as
torch's docs recommend); rank 0 then exits, rank 1 works 6 s more in its own code and exits 0."""

import time

import torch
import torch.distributed as dist

dist.init_process_group("gloo")
rank = dist.get_rank()
for _ in range(400):
    dist.all_reduce(torch.ones(4))
dist.destroy_process_group()
if rank == 1:
    time.sleep(6)
print(f"destroy_then_work: rank {rank} done", flush=True)
