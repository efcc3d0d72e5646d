"""A torch DistributedDataParallel training loop (gloo, CPU, seeded): 30 steps of a small MLP
on each rank's own batches, then a barrier; each rank prints its weights' checksum at the end
(``ddp_train: rank R checksum X``), which is the same on every rank and in every run.

With argv[1] ``uneven`` (the classic mistake: an uneven last batch), the last rank has one
batch fewer: it goes to the end-of-epoch barrier while the others wait in DDP's all-reduce of
their last backward (issued from C++, not from Python); the group times out after 60 s.
"""

import datetime
import sys
import time

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

uneven = sys.argv[1:] == ["uneven"]
dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=60))
rank, world = dist.get_rank(), dist.get_world_size()
torch.manual_seed(0)
model = DDP(torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 4)),
            bucket_cap_mb=0.005)  # several buckets: several all-reduces per step
opt = torch.optim.SGD(model.parameters(), lr=0.05)
data = torch.Generator().manual_seed(100 + rank)
for step in range(29 if uneven and rank == world - 1 else 30):
    if uneven and step == 29:
        print(f"ddp_train: mismatch at {time.time():.3f}", flush=True)
    x = torch.randn(16, 32, generator=data)
    loss = model(x).pow(2).mean()
    opt.zero_grad()
    loss.backward()
    opt.step()
dist.barrier()  # the end of the epoch
total = sum(p.detach().double().sum().item() for p in model.parameters())
print(f"ddp_train: rank {rank} checksum {total:.12e}", flush=True)
