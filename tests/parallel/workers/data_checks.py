"""Data that was never sharded. Usage: data_checks.py MODE [ddp|fsdp], with MODE
"same" (every rank the same batch), "sharded" (each rank its own batch, then a sampler with
set_epoch each epoch) or "no-set-epoch" (a shuffling DistributedSampler iterated twice without
set_epoch); the model is wrapped by ddp (default) or fully_shard."""

import os
import sys

import torch
from torch.utils.data import DataLoader, TensorDataset
from torch.utils.data.distributed import DistributedSampler

import meshrun.parallel as mp

mode = sys.argv[1]
wrap = mp.fully_shard if sys.argv[2:] == ["fsdp"] else mp.ddp
ctx = mp.init()
torch.manual_seed(0)
model = wrap(torch.nn.Linear(4, 1))
data = TensorDataset(torch.arange(64, dtype=torch.float32).reshape(16, 4))
if mode in ("same", "sharded"):
    seed = 0 if mode == "same" else 1 + ctx.rank
    x = torch.randn(8, 4, generator=torch.Generator().manual_seed(seed))
    model(x).sum().backward()
if mode == "sharded":  # and then a sampler used rightly: no warning for either
    mode = "set-epoch"
if mode != "same":
    sampler = DistributedSampler(data, shuffle=True)
    for epoch in range(2):
        if mode == "set-epoch":
            sampler.set_epoch(epoch)
        for (x,) in DataLoader(data, batch_size=4, sampler=sampler):
            model(x).sum().backward()
print(f"rank {ctx.rank} done", flush=True)
os._exit(0)
