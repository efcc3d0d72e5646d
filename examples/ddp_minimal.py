"""Data parallelism in ten lines of meshrun: `meshrun --nproc-per-node 2 examples/ddp_minimal.py`.

Every rank builds the same model, `ddp` averages the gradients over the ranks after each
backward, so every rank takes the same step on its own batch. Runs under torchrun as well.
"""

import os

import torch

from meshrun.parallel import ddp, init

ctx = init()  # the torchrun environment -> process group, device
torch.manual_seed(0)  # the same initial weights on every rank
model = ddp(torch.nn.Linear(16, 1).to(ctx.device))
optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
data = torch.Generator().manual_seed(1000 + ctx.rank)  # each rank its own batches
for step in range(1, 51):
    x = torch.randn(32, 16, generator=data).to(ctx.device)
    loss = (model(x) - x.sum(dim=1, keepdim=True)).pow(2).mean()  # learn y = sum(x)
    optimizer.zero_grad()
    loss.backward()
    optimizer.step()
    if ctx.rank == 0 and step % 10 == 0:
        print(f"step {step} | loss {loss.item():.4f}", flush=True)
torch.distributed.destroy_process_group()
os._exit(0)  # torch 2.13 + gloo can abort (SIGABRT) in its C++ teardown after a clean finish
