"""A container's training script under Kubeflow's operator (it runs ``torchrun train.py``):
joins the group from the torchrun environment, all-reduces, appends its view (rank, world
size, round) to RECORDS (argv[1]) as one JSON line."""

import json
import os
import sys

import torch
import torch.distributed as dist

dist.init_process_group("gloo")
total = torch.ones(1)
dist.all_reduce(total)
names = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "GROUP_RANK", "MASTER_ADDR", "MESHRUN_ROUND")
record = {k.lower(): os.environ.get(k) for k in names}
record["sum"] = int(total.item())
with open(sys.argv[1], "a") as f:
    f.write(json.dumps(record) + "\n")
dist.destroy_process_group()
os._exit(0)  # torch 2.13 + gloo may abort in its C++ teardown at exit (not under test here)
