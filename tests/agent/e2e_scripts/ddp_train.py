"""A correct torch DistributedDataParallel training loop (gloo, CPU, seeded): 30 steps of a
small MLP on each rank's own batches; each rank prints its weights' checksum at the end
(``ddp_train: rank R checksum X``), which is the same on every rank and in every run."""

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

dist.init_process_group("gloo")
rank = dist.get_rank()
torch.manual_seed(0)
model = DDP(torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 4)),
            bucket_cap_mb=0.005)  # several buckets: several all-reduces per step
opt = torch.optim.SGD(model.parameters(), lr=0.05)
data = torch.Generator().manual_seed(100 + rank)
for _ in range(30):
    x = torch.randn(16, 32, generator=data)
    loss = model(x).pow(2).mean()
    opt.zero_grad()
    loss.backward()
    opt.step()
total = sum(p.detach().double().sum().item() for p in model.parameters())
print(f"ddp_train: rank {rank} checksum {total:.12e}", flush=True)
