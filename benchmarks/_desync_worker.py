"""The training loop `benchmarks/desync.py` runs under meshrun: an MLP, gloo, CPU, one thread per
rank, data parallel by torch's DistributedDataParallel (LOOP ``ddp``) or by one all_reduce per
gradient after the backward (LOOP ``manual``, the same model); rank 0 writes its step times
(seconds, after the warm-up) as JSON to OUT. argv: OUT STEPS WARMUP WIDTH LOOP."""

import json
import sys
import time

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

out, steps, warmup, width, loop = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), \
    int(sys.argv[4]), sys.argv[5]
torch.set_num_threads(1)
dist.init_process_group("gloo")
rank = dist.get_rank()
torch.manual_seed(0)
layers = []
for _ in range(4):
    layers += [torch.nn.Linear(width, width), torch.nn.ReLU()]
model = torch.nn.Sequential(*layers, torch.nn.Linear(width, 10))
if loop == "ddp":
    model = DistributedDataParallel(model)
else:
    for p in model.parameters():  # the same start on every rank, as DDP's first broadcast
        dist.broadcast(p.data, src=0)
opt = torch.optim.SGD(model.parameters(), lr=1e-3)
data = torch.Generator().manual_seed(rank)
times = []
for _ in range(warmup + steps):
    x = torch.randn(32, width, generator=data)
    t0 = time.perf_counter()
    opt.zero_grad(set_to_none=True)
    model(x).pow(2).mean().backward()
    if loop == "manual":
        for p in model.parameters():
            dist.all_reduce(p.grad)
            p.grad /= dist.get_world_size()
    opt.step()
    times.append(time.perf_counter() - t0)
if rank == 0:
    params = sum(p.numel() for p in model.parameters())
    with open(out, "w") as f:
        json.dump({"times": times[warmup:], "params": params,
                   "debug": str(dist.get_debug_level())}, f)
dist.destroy_process_group()
