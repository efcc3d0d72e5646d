"""A checkpoint save that hangs on one rank. Usage: checkpoint_hang.py DIR HOW, HOW "arg"
(``save(..., busy_timeout=4)``) or "env" (the bound from ``MESHRUN_CHECKPOINT_TIMEOUT``, which
the test sets) or "default" (neither). Both ranks beat three times, then save; rank 1's state
holds a ``Stateful`` whose ``state_dict()`` never returns, so rank 1 never reaches the save's
collectives and rank 0 waits in them. Rank 0 prints "rank 0 saving at T" (wall clock, s)."""

import sys
import time

import torch
from torch.distributed.checkpoint.stateful import Stateful

import meshrun.parallel as mp
from meshrun.parallel import checkpoint

BOUND_S = 4.0


class Stuck(Stateful):
    def state_dict(self):
        time.sleep(3600)  # a write that never returns (a stuck filesystem)
        return {}

    def load_state_dict(self, state_dict):
        pass


directory, how = sys.argv[1], sys.argv[2]
ctx = mp.init()
for _ in range(3):
    mp.heartbeat()
    time.sleep(0.1)
state = {"w": torch.ones(4)}
if ctx.rank == 1:
    state["stuck"] = Stuck()
print(f"rank {ctx.rank} saving at {time.time():.3f}", flush=True)
checkpoint.save(state, f"{directory}/step_1", **({"busy_timeout": BOUND_S} if how == "arg" else {}))
print(f"rank {ctx.rank} saved", flush=True)
