"""chaos_worker.py RECORDS STOP: a worker for the multi-node interleaving tests.

Joins the gloo group, all_reduces once, appends {rank, round, restarts, pid, master_addr} as a
JSON line to RECORDS, then, by ``CHAOS_MODE``:

- "loop" (default): an all_reduce every 50 ms until STOP exists (a peer that vanishes makes
  this rank fail with gloo's "Connection closed by peer");
- "wait": waits for STOP without further collectives.

The ranks listed in ``CHAOS_DONE_RANKS`` (comma-separated) exit 0 right after recording; with
``CHAOS_LINGER=1`` they first fork a child that stays in their process group, ignores SIGTERM
and holds no pipe (a lingering descendant). Exits with ``os._exit`` (gloo's C++ teardown can
abort at interpreter exit).
"""

import json
import os
import signal
import sys
import time
from datetime import timedelta

import torch
import torch.distributed as dist

records, stop = sys.argv[1], sys.argv[2]
dist.init_process_group("gloo", timeout=timedelta(seconds=30))
dist.all_reduce(torch.ones(1))
rank = dist.get_rank()
with open(records, "a") as f:
    f.write(json.dumps({
        "rank": rank, "round": int(os.environ["MESHRUN_ROUND"]),
        "restarts": int(os.environ["TORCHELASTIC_RESTART_COUNT"]), "pid": os.getpid(),
        "master_addr": os.environ["MASTER_ADDR"],
    }) + "\n")  # fmt: skip
print(f"ready rank={rank}", flush=True)
if str(rank) in os.environ.get("CHAOS_DONE_RANKS", "").split(","):
    if os.environ.get("CHAOS_LINGER") == "1" and os.fork() == 0:
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        devnull = os.open(os.devnull, os.O_RDWR)
        for fd in (0, 1, 2):
            os.dup2(devnull, fd)
        with open(os.path.join(os.path.dirname(records), f"linger_{rank}"), "w") as f:
            f.write(str(os.getpid()))
        time.sleep(60)
        os._exit(0)
    os._exit(0)
mode = os.environ.get("CHAOS_MODE", "loop")
deadline = time.monotonic() + 90
while not os.path.exists(stop) and time.monotonic() < deadline:
    if mode == "loop":
        dist.all_reduce(torch.ones(1))
    time.sleep(0.05)
os._exit(0 if os.path.exists(stop) else 2)
