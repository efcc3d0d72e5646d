"""fail_while_other_lingers.py OUT: rank 0 ignores SIGTERM and sleeps (the stop must wait out
its grace); rank 1 exits 5 once OUT/go exists. Both write OUT/ready_<RANK> when set up."""

import os
import signal
import sys
import time

out, rank = sys.argv[1], os.environ["RANK"]
if rank == "0":
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
open(os.path.join(out, f"ready_{rank}"), "w").close()
deadline = time.monotonic() + 60
while time.monotonic() < deadline:
    if rank == "1" and os.path.exists(os.path.join(out, "go")):
        print("rank 1 failing on purpose with 5", file=sys.stderr, flush=True)
        sys.exit(5)
    time.sleep(0.02)
