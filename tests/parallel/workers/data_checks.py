"""Data that was or was not sharded. Usage: data_checks.py MODE [WRAP], with MODE

- "same": every rank the same batch, at each of 10 steps (unsharded: warns);
- "keyword": the same, passed by keyword, ``model(x=x)`` (unsharded: warns);
- "sharded": each rank its own batches, then a sampler with set_epoch each epoch;
- "warmup": one constant warm-up forward, then each rank its own batches;
- "one-sample": a DistributedSampler over a dataset of one sample (its padding gives every rank
  that sample: correct, no warning), 10 epochs with set_epoch;
- "no-set-epoch": a shuffling DistributedSampler iterated twice without set_epoch;

and WRAP the wrapper: meshrun.parallel's "ddp" (default) or "fsdp", or torch's own
"torch-ddp" (``torch.nn.parallel.DistributedDataParallel``) or "torch-fsdp"
(``torch.distributed.fsdp.fully_shard``), imported here before ``meshrun.parallel.init()``.
Each rank prints "rank R done sum S" (S: the sum of its parameters after training)."""

import os
import sys

import torch
from torch.distributed.fsdp import fully_shard as torch_fully_shard
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader, TensorDataset
from torch.utils.data.distributed import DistributedSampler

import meshrun.parallel as mp

STEPS = 10


class Model(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.inner = torch.nn.Linear(4, 4)
        self.out = torch.nn.Linear(4, 1)

    def forward(self, x):
        return self.out(self.inner(x))


mode = sys.argv[1]
wrap = sys.argv[2] if len(sys.argv) > 2 else "ddp"
ctx = mp.init()
torch.manual_seed(0)
model = Model()
if wrap == "ddp":
    model = mp.ddp(model)
elif wrap == "fsdp":
    model = mp.fully_shard(model)
elif wrap == "torch-ddp":
    model = DistributedDataParallel(model)
elif wrap == "torch-fsdp":
    torch_fully_shard(model.inner)
    torch_fully_shard(model)
else:
    raise SystemExit(f"data_checks.py: unknown wrapper {wrap!r}")
optimizer = torch.optim.SGD(model.parameters(), lr=0.01)


def step(x, by_keyword=False):
    loss = (model(x=x) if by_keyword else model(x)).sum()
    loss.backward()
    optimizer.step()
    optimizer.zero_grad()


def batch(seed):
    return torch.randn(8, 4, generator=torch.Generator().manual_seed(seed))


data = TensorDataset(torch.arange(64, dtype=torch.float32).reshape(16, 4))
if mode in ("same", "keyword"):
    for i in range(STEPS):
        step(batch(i), by_keyword=mode == "keyword")
elif mode == "warmup":
    step(batch(0))
    for i in range(STEPS):
        step(batch(1000 * (1 + ctx.rank) + i))
elif mode == "one-sample":
    one = TensorDataset(torch.ones(1, 4))
    sampler = DistributedSampler(one, shuffle=True)
    for epoch in range(STEPS):
        sampler.set_epoch(epoch)
        for (x,) in DataLoader(one, batch_size=1, sampler=sampler):
            step(x.expand(2, 4).contiguous())
elif mode == "sharded":
    step(batch(1 + ctx.rank))
if mode in ("sharded", "no-set-epoch"):  # a sampler: with set_epoch (sharded) or without
    sampler = DistributedSampler(data, shuffle=True)
    for epoch in range(2):
        if mode == "sharded":
            sampler.set_epoch(epoch)
        for (x,) in DataLoader(data, batch_size=4, sampler=sampler):
            step(x)
total = sum(float(p.detach().sum()) for p in model.parameters())  # this rank's part (FSDP)
print(f"rank {ctx.rank} done sum {total:.6f}", flush=True)
os._exit(0)
