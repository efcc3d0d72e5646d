"""A worker that opts in to in-place recovery and then ignores every offer (the fallback
test): in a round after the first with a world of one (it was restarted after the handover
failed) it prints ``fresh <pid>`` and exits 0; otherwise it prints ``opted in <pid>`` and
sleeps until it is stopped."""

import os
import time

from meshrun import in_place

if os.environ["WORLD_SIZE"] == "1" and os.environ["MESHRUN_ROUND"] != "0":
    print(f"fresh {os.getpid()} round {os.environ['MESHRUN_ROUND']}", flush=True)
else:
    in_place.opt_in()
    print(f"opted in {os.getpid()} round {os.environ['MESHRUN_ROUND']}", flush=True)
    time.sleep(120)
