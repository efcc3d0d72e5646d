"""A worker that opts in to in-place recovery and then ignores every offer (the fallback
test): in a round after the first with a world of one (it was restarted after the handover
failed) it prints ``fresh <pid>`` and exits 0; otherwise it prints ``opted in <pid>`` and
sleeps until it is stopped. With ``IGNORER_BLOCK_OFFER`` set it also puts a non-empty
directory where the agent writes its offer (a channel that cannot be written, as on a full
disk)."""

import os
import time

from meshrun import in_place

if os.environ["WORLD_SIZE"] == "1" and os.environ["MESHRUN_ROUND"] != "0":
    print(f"fresh {os.getpid()} round {os.environ['MESHRUN_ROUND']}", flush=True)
else:
    in_place.opt_in()
    if os.environ.get("IGNORER_BLOCK_OFFER"):
        (in_place.channel() / in_place.OFFER / "blocked").mkdir(parents=True)
    print(f"opted in {os.getpid()} round {os.environ['MESHRUN_ROUND']}", flush=True)
    time.sleep(120)
