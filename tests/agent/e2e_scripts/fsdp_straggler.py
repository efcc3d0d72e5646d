"""A plain torch script: torch's own fully_shard (FSDP2) on gloo, meshrun.parallel's
heartbeat() after every step and nothing else of meshrun. Rank SLOW_RANK (argv[1], -1 for
none) sleeps 0.15 s more than the others in every step, before its forward; the others wait
for it in the step's first all-gather, and are in step with it for the rest. STEPS (argv[2],
default 60) steps."""

import sys
import time

import torch
import torch.distributed as dist
from torch.distributed.fsdp import fully_shard

from meshrun.parallel import heartbeat

slow = int(sys.argv[1])
steps = int(sys.argv[2]) if len(sys.argv) > 2 else 60
dist.init_process_group("gloo")
rank = dist.get_rank()
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(16, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))
for layer in model:
    if isinstance(layer, torch.nn.Linear):
        fully_shard(layer)
fully_shard(model)
opt = torch.optim.SGD(model.parameters(), lr=0.01)
for _ in range(steps):
    time.sleep(0.05 + (0.15 if rank == slow else 0.0))
    model(torch.randn(8, 16)).sum().backward()
    opt.step()
    opt.zero_grad()
    heartbeat()
print(f"rank {rank} done", flush=True)
dist.destroy_process_group()
