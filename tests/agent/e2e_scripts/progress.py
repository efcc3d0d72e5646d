"""progress.py GO_FILE: a tqdm-style bar redrawn with \r, then a partial line (no newline)
that stays partial until GO_FILE exists."""

import os
import sys
import time

go = sys.argv[1]
sys.stdout.write("bar 1/3\rbar 2/3\rbar 3/3\n")
sys.stdout.flush()
sys.stdout.write("partial-no-newline")
sys.stdout.flush()
deadline = time.monotonic() + 60
while not os.path.exists(go) and time.monotonic() < deadline:
    time.sleep(0.02)
sys.stdout.write(" finished\n")
