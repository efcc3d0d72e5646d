"""A Lightning Fabric script as its users write it for torchrun: DDP on CPU, a few steps; each
rank prints its world size and a checksum of its parameters (equal on every rank if the
gradients were averaged)."""

import os

import torch
from lightning.fabric import Fabric

fabric = Fabric(accelerator="cpu", devices=int(os.environ.get("LOCAL_WORLD_SIZE", 1)),
                num_nodes=int(os.environ.get("GROUP_WORLD_SIZE", 1)), strategy="ddp")
fabric.launch()
torch.manual_seed(0)
model = torch.nn.Linear(8, 1)
optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
model, optimizer = fabric.setup(model, optimizer)
torch.manual_seed(1 + fabric.global_rank)  # each rank its own data
for _ in range(5):
    loss = model(torch.randn(16, 8)).pow(2).mean()
    fabric.backward(loss)
    optimizer.step()
    optimizer.zero_grad()
checksum = sum(float(p.detach().sum()) for p in model.parameters())
print(f"fabric rank {fabric.global_rank} of {fabric.world_size}: checksum {checksum:.6f}",
      flush=True)
