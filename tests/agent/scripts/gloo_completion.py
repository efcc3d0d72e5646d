"""What torch's flight recorder says of completion on gloo, seen from inside a 2-rank run.

Rank 0 prints one JSON line: the group's last completed and last enqueued call number (and the
entries' states) at three moments: while its synchronous all_reduce is blocked (rank 1 joins
1.5 s late), 0.2 s after an ``async_op=True`` all_reduce it waited for, and 0.2 s after a
synchronous barrier returned (gloo marks completion a moment after the call returns).
"""

import json
import os
import threading
import time

import torch
import torch.distributed as dist

os.environ.setdefault("TORCH_FR_BUFFER_SIZE", "64")
dist.init_process_group("gloo")
rank = dist.get_rank()
t = torch.ones(4)
dist.all_reduce(t)  # call 1


def status() -> dict:
    dump = json.loads(torch._C._distributed_c10d._dump_fr_trace_json(True, False))
    (pg,) = dump["pg_status"].values()
    return {"done": int(pg["last_completed_collective"]), "issued": int(pg["last_enqueued_collective"]),
            "states": sorted({e["state"] for e in dump["entries"]})}


seen = {}
if rank == 0:
    threading.Thread(target=lambda: (time.sleep(0.8), seen.__setitem__("blocked", status()))).start()
    dist.all_reduce(t)  # call 2: blocked until rank 1 joins
else:
    time.sleep(1.5)
    dist.all_reduce(t)
work = dist.all_reduce(t, async_op=True)  # call 3
work.wait()
time.sleep(0.2)
seen["async_waited"] = status()
dist.barrier()  # call 4
time.sleep(0.2)
seen["sync_returned"] = status()
if rank == 0:
    print("GLOO_COMPLETION " + json.dumps(seen), flush=True)
dist.destroy_process_group()
