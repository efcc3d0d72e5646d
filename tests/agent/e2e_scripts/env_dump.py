"""Write this worker's environment to OUT/env_<RANK>.json; with --dist, also init gloo and
all_reduce the rank (the sum of 0..WORLD_SIZE-1 is recorded).

Leaves with os._exit: torch 2.13 + gloo sometimes aborts in its C++ teardown at interpreter exit
("terminate called without an active exception"), which is not what these tests check.
"""

import json
import os
import sys

out = sys.argv[1]
data = {"env": dict(os.environ)}
if "--dist" in sys.argv[2:]:
    from datetime import timedelta

    import torch
    import torch.distributed as dist

    data["launched"] = dist.is_torchelastic_launched()
    dist.init_process_group("gloo", timeout=timedelta(seconds=60))
    t = torch.tensor([float(os.environ["RANK"])])
    dist.all_reduce(t)
    data.update(sum=t.item(), rank=dist.get_rank(), world=dist.get_world_size())
    dist.destroy_process_group()
path = os.path.join(out, f"env_{os.environ['RANK']}.json")
with open(path + ".tmp", "w") as f:
    json.dump(data, f)
os.replace(path + ".tmp", path)
print(f"env_dump rank {os.environ['RANK']} done", flush=True)
os._exit(0)
