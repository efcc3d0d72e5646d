"""A plain torch script (no meshrun.parallel) whose rank 0 sits in its own slow data reader
while rank 1's barrier times out (pytorch#122694): rank 1 fails, rank 0 caused it. Any other
rank waits in the barrier with a long timeout (a stopped rank inside a collective).
"""

import datetime
import os
import time

import torch.distributed as dist


def read_batch() -> None:
    time.sleep(120)  # the slow reader


def main() -> None:
    rank = int(os.environ["RANK"])
    seconds = 3 if rank == 1 else 120
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=seconds))
    if rank == 0:
        read_batch()
    dist.barrier()


main()
