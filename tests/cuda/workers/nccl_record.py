"""One rank on one GPU, NCCL: a few collectives for tests/cuda/test_nccl_record.py to find in
meshrun's collective record. argv: OUT (a file written once the calls are done and the record
had time to copy them)."""

import os
import sys
import time

import torch
import torch._inductor.codecache  # noqa: F401  (as a script that compiles has it: call sites from torch's frames)
import torch.distributed as dist

torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
dist.init_process_group("nccl")
x = torch.ones(4, device="cuda")


def step():
    dist.all_reduce(x)  # ALL_REDUCE
    dist.broadcast(x, src=0)  # BROADCAST


step()
out = torch.empty(4 * dist.get_world_size(), device="cuda")
dist.all_gather_into_tensor(out, x)  # ALL_GATHER
torch.cuda.synchronize()
time.sleep(1.5)  # NCCL's watchdog marks them completed; the record looks every 0.5 s
with open(sys.argv[1], "w") as f:
    f.write("done")
dist.destroy_process_group()
