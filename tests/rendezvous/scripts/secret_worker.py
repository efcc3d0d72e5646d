"""A worker for the shared-secret test: join the gloo group, all_reduce, and write what it
sees to OUT/rank_<RANK>.json (its torchrun variables and the all_reduce sum) and its raw
/proc/self/environ to OUT/environ_<RANK>, then exit 0.

Usage: secret_worker.py OUT. Leaves with os._exit (torch 2.13 + gloo may abort in teardown).
"""

import json
import os
import sys
from datetime import timedelta

import torch
import torch.distributed as dist

out = sys.argv[1]
rank = os.environ["RANK"]
with open(os.path.join(out, f"environ_{rank}"), "wb") as f:
    with open("/proc/self/environ", "rb") as env:
        f.write(env.read())
    f.write(b"\0" + json.dumps(dict(os.environ)).encode())
dist.init_process_group("gloo", timeout=timedelta(seconds=30))
total = torch.ones(1)
dist.all_reduce(total)
record = {name: os.environ[name] for name in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")}
record["sum"] = int(total.item())
with open(os.path.join(out, f"rank_{rank}.json"), "w") as f:
    json.dump(record, f)
print(f"secret_worker rank {rank} done", flush=True)
sys.stdout.flush()
os._exit(0)
