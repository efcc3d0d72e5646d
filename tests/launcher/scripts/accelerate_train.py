"""An Accelerate script as its users write it for torchrun (``Accelerator(cpu=True)``): a few
steps of DDP; each rank prints its world size and a checksum of its parameters."""

import torch
from accelerate import Accelerator

accelerator = Accelerator(cpu=True)
torch.manual_seed(0)
model = torch.nn.Linear(8, 1)
optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
model, optimizer = accelerator.prepare(model, optimizer)
torch.manual_seed(1 + accelerator.process_index)
for _ in range(5):
    loss = model(torch.randn(16, 8)).pow(2).mean()
    accelerator.backward(loss)
    optimizer.step()
    optimizer.zero_grad()
checksum = sum(float(p.detach().sum()) for p in model.parameters())
print(f"accelerate rank {accelerator.process_index} of {accelerator.num_processes}: "
      f"checksum {checksum:.6f}", flush=True)
accelerator.end_training()
