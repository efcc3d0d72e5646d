"""Print this worker's whole environment (to its log), write OUT/pid_<RANK>, then wait for
OUT/stop (at most 60 s), so a test can read /proc/<pid>/environ while the worker runs."""

import os
import sys
import time

out = sys.argv[1]
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
