"""ns_worker.py RECORDS STOP: a worker of the network-namespace test (tests/faults/test_netns.py).

Joins the gloo group (``GLOO_SOCKET_IFNAME`` names its namespace's veth), all_reduces once,
appends {rank, world_size, round, group_rank, master_addr, ns} to RECORDS (``ns`` from the env
var NS_NAME that the test sets per agent: the namespaces share one hostname), then all_reduces
every 0.2 s until STOP exists (60 s at most) and exits 0.
"""

import json
import os
import sys
import time
from datetime import timedelta

import torch
import torch.distributed as dist

records, stop = sys.argv[1], sys.argv[2]
dist.init_process_group("gloo", timeout=timedelta(seconds=30))
total = torch.ones(1)
dist.all_reduce(total)
record = {
    "rank": dist.get_rank(),
    "world_size": dist.get_world_size(),
    "round": int(os.environ["MESHRUN_ROUND"]),
    "group_rank": int(os.environ["GROUP_RANK"]),
    "restarts": int(os.environ["TORCHELASTIC_RESTART_COUNT"]),
    "master_addr": os.environ["MASTER_ADDR"],
    "ns": os.environ.get("NS_NAME", ""),
    "sum": int(total.item()),
}
with open(records, "a") as f:
    f.write(json.dumps(record) + "\n")
print(f"ready {record}", flush=True)
deadline = time.monotonic() + 60
while not os.path.exists(stop) and time.monotonic() < deadline:
    dist.all_reduce(torch.ones(1))
    time.sleep(0.2)
sys.stdout.flush()  # os._exit: skip torch 2.13 + gloo's C++ teardown, which can abort at exit
os._exit(0 if os.path.exists(stop) else 2)
