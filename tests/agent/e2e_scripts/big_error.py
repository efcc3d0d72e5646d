"""big_error.py SIZE: write torch's error-file JSON with a SIZE-byte message (it starts with
"HEAD-OF-RANK-<RANK>" and ends with "TAIL-OF-RANK-<RANK>") to TORCHELASTIC_ERROR_FILE, exit 1."""

import json
import os
import sys
import time

size, rank = int(sys.argv[1]), os.environ["RANK"]
head, tail = f"HEAD-OF-RANK-{rank} ", f" TAIL-OF-RANK-{rank}"
message = head + "x" * (size - len(head) - len(tail)) + tail
record = {"message": {"message": message, "extraInfo": {
    "py_callstack": f"Traceback (most recent call last):\nRuntimeError: rank {rank} boom\n",
    "timestamp": str(int(time.time()))}}}  # fmt: skip
with open(os.environ["TORCHELASTIC_ERROR_FILE"], "w") as f:
    json.dump(record, f)
sys.exit(1)
