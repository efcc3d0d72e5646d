"""A training loop with one planted fault, for the hang generator (test_verdicts_generated.py).

argv: framework kind culprits fault_step
- framework: ``plain`` (gradients all-reduced by hand), ``ddp`` (torch's
  DistributedDataParallel), ``fsdp2`` (torch's fully_shard), ``meshrun`` (meshrun.parallel.ddp)
- kind, done by the ranks in ``culprits`` (comma-separated) at step ``fault_step``:
  - ``own``: stall in their own code before the step (a slow data reader);
  - ``fewer``: one batch fewer: they leave the loop a step early for the end-of-epoch barrier;
  - ``other_op``: broadcast the step's loss where the others all-reduce it;
  - ``extra``: all-reduce a 3-value metric the others do not.

Every rank calls meshrun.parallel.heartbeat() after each step. The collectives time out after
120 s, far past the test's --hang-timeout: the agent, not gloo, ends the hang.
"""

import datetime
import sys
import time

import torch
import torch.distributed as dist

import meshrun.parallel as mp

framework, kind, fault_step = sys.argv[1], sys.argv[2], int(sys.argv[4])
culprits = {int(r) for r in sys.argv[3].split(",")}
dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=120))
rank = dist.get_rank()
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.ReLU(), torch.nn.Linear(8, 1))
if framework == "ddp":
    model = torch.nn.parallel.DistributedDataParallel(model)
elif framework == "fsdp2":
    from torch.distributed.fsdp import fully_shard

    fully_shard(model[0])
    fully_shard(model)
elif framework == "meshrun":
    model = mp.ddp(model)
opt = torch.optim.SGD(model.parameters(), lr=0.01)
faulty = rank in culprits


def read_batch(step):
    if faulty and kind == "own" and step == fault_step:
        time.sleep(600)  # the planted stall
    return torch.randn(4, 8, generator=torch.Generator().manual_seed(rank * 100 + step))


def train_step(x):
    loss = model(x).square().mean()
    loss.backward()
    if framework == "plain":
        for p in model.parameters():
            dist.all_reduce(p.grad)
    opt.step()
    opt.zero_grad()
    return loss.detach().reshape(1)


def log_loss(loss, step):
    if faulty and kind == "extra" and step == fault_step:
        dist.all_reduce(torch.zeros(3))  # the planted extra call
    if faulty and kind == "other_op" and step == fault_step:
        dist.broadcast(loss, src=0)  # the planted other op
    else:
        dist.all_reduce(loss)


for step in range(6):
    if faulty and kind == "fewer" and step == fault_step:
        break  # the planted short epoch
    loss = train_step(read_batch(step))
    log_loss(loss, step)
    mp.heartbeat()
dist.barrier()
print(f"hang_cases: rank {rank} finished", flush=True)
dist.destroy_process_group()
