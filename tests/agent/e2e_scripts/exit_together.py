"""exit_together.py LOCK OUT: every rank writes OUT/ready_<RANK>, blocks on a shared flock of
LOCK (the test holds it exclusively), and when the test lets go, exits with 5 + RANK at once:
all ranks fail within a fraction of a millisecond of each other, before their agent reacts."""

import fcntl
import os
import sys

lock, out = sys.argv[1], sys.argv[2]
rank = int(os.environ["RANK"])
with open(lock) as f:
    with open(os.path.join(out, f"ready_{rank}"), "w"):
        pass
    fcntl.flock(f, fcntl.LOCK_SH)
    os._exit(5 + rank)
