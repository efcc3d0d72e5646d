"""big_error.py SIZE SYNC_DIR N: write torch's error-file JSON with a SIZE-byte message (it
starts with "HEAD-OF-RANK-<RANK>" and ends with "TAIL-OF-RANK-<RANK>") to
TORCHELASTIC_ERROR_FILE and exit 1, once all N ranks are ready (SYNC_DIR/ready_<RANK>), so
they fail together."""

import json
import os
import sys
import time

size, sync, n = int(sys.argv[1]), sys.argv[2], int(sys.argv[3])
rank = os.environ["RANK"]
head, tail = f"HEAD-OF-RANK-{rank} ", f" TAIL-OF-RANK-{rank}"
message = head + "x" * (size - len(head) - len(tail)) + tail
record = {"message": {"message": message, "extraInfo": {
    "py_callstack": f"Traceback (most recent call last):\nRuntimeError: rank {rank} boom\n",
    "timestamp": str(int(time.time()))}}}  # fmt: skip
with open(os.environ["TORCHELASTIC_ERROR_FILE"], "w") as f:
    json.dump(record, f)
open(os.path.join(sync, f"ready_{rank}"), "w").close()
deadline = time.monotonic() + 60
while len(os.listdir(sync)) < n and time.monotonic() < deadline:
    time.sleep(0.005)
sys.exit(1)
