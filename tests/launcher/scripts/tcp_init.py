"""A torchrun script that names its own store: ``init_process_group(init_method=
"tcp://HOST:PORT")`` with HOST and PORT from argv (argv[1], argv[2]), as torch's own launcher
test does; all-reduces, then appends its view of the environment to argv[3] as one JSON line."""

import json
import os
import sys
from datetime import timedelta

import torch
import torch.distributed as dist

host, port, out = sys.argv[1], int(sys.argv[2]), sys.argv[3]
rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
dist.init_process_group("gloo", init_method=f"tcp://{host}:{port}", rank=rank,
                        world_size=world, timeout=timedelta(seconds=30))  # fmt: skip
total = torch.ones(1)
dist.all_reduce(total)
names = ("RANK", "MASTER_ADDR", "MASTER_PORT", "TORCHELASTIC_RUN_ID", "TORCHELASTIC_USE_AGENT_STORE",
         "TORCHELASTIC_SIGNALS_TO_HANDLE")  # fmt: skip
record = {k: os.environ.get(k) for k in names}
record["sum"] = int(total.item())
with open(out, "a") as f:
    f.write(json.dumps(record) + "\n")
dist.destroy_process_group()
os._exit(0)  # torch 2.13 + gloo may abort in its C++ teardown at exit (not under test here)
