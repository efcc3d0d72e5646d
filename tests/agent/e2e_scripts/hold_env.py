"""Print this worker's whole environment (to its log), write OUT/pid_<RANK>, then wait for
OUT/stop (at most 60 s), so a test can read /proc/<pid>/environ or probe the job's ports
while the worker runs. With --dist: init gloo (env://, through the agent's workers' store)
first and all_reduce once after the stop (a wrong sum exits 1)."""

import os
import sys
import time

out = sys.argv[1]
dist_on = "--dist" in sys.argv[2:]
if dist_on:
    from datetime import timedelta

    import torch
    import torch.distributed as dist

    dist.init_process_group("gloo", timeout=timedelta(seconds=60))
for key, value in sorted(os.environ.items()):
    print(f"{key}={value}", flush=True)
    print(f"{key}={value}", file=sys.stderr, flush=True)
path = os.path.join(out, f"pid_{os.environ['RANK']}")
with open(path + ".tmp", "w") as f:
    f.write(str(os.getpid()))
os.replace(path + ".tmp", path)
deadline = time.monotonic() + 60
while not os.path.exists(os.path.join(out, "stop")) and time.monotonic() < deadline:
    time.sleep(0.05)
if dist_on:
    t = torch.ones(1)
    dist.all_reduce(t)
    ok = t.item() == dist.get_world_size()
    dist.destroy_process_group()
    os._exit(0 if ok else 1)  # torch 2.13 + gloo may abort in its C++ teardown at exit
