"""fail_in_step.py RANK: every rank makes a barrier; then RANK exits 7 while the others wait in a
second barrier, whose gloo connections then close under them (they raise while being stopped)."""

import datetime
import sys
import time

import torch.distributed as dist

dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=60))
dist.barrier()
if dist.get_rank() == int(sys.argv[1]):
    time.sleep(1)
    sys.exit(7)
dist.barrier()
