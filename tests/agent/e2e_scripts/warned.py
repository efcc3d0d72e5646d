"""Counts the SIGUSR1 and SIGUSR2 it receives (a script that saves when warned), writes its
pid to OUT/ready_<rank> once its handlers are in, appends the time of each warning to
OUT/warned_<rank> (so a test knows a scheduler's timed warning came), and at the end (when
OUT/stop exists, 60 s at most) writes its counts to OUT/counts_<rank> as "usr1 usr2"."""

import os
import signal
import sys
import time

out, rank = sys.argv[1], os.environ["RANK"]
counts = {signal.SIGUSR1: 0, signal.SIGUSR2: 0}


def warned(signum, frame):
    counts[signum] += 1
    with open(os.path.join(out, f"warned_{rank}"), "a") as f:
        f.write(f"{time.time()}\n")


signal.signal(signal.SIGUSR1, warned)
signal.signal(signal.SIGUSR2, warned)
with open(os.path.join(out, f"ready_{rank}"), "w") as f:
    f.write(str(os.getpid()))
deadline = time.monotonic() + 60
while not os.path.exists(os.path.join(out, "stop")) and time.monotonic() < deadline:
    time.sleep(0.05)
with open(os.path.join(out, f"counts_{rank}"), "w") as f:
    f.write(f"{counts[signal.SIGUSR1]} {counts[signal.SIGUSR2]}")
