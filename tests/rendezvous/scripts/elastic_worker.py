"""A worker for the multi-agent tests: join the gloo group, all_reduce, record, wait for 'stop'.

Usage: elastic_worker.py RECORDS_FILE STOP_FILE. Appends one JSON line per (round, rank) to
RECORDS_FILE, then waits until STOP_FILE exists (60 s at most), then exits 0. The rank named by
the env var FAIL_RANK exits 7 instead, after a line on stderr (only on restart FAIL_ATTEMPT
when that is set). With SLOW_TERM_S set, a SIGTERM is answered after that many seconds (a
script that saves a checkpoint when it is stopped), with exit 0.

Exits with ``os._exit``: torch 2.13 + gloo sometimes aborts in its C++ teardown at interpreter
exit ("terminate called without an active exception", SIGABRT), which would turn the exit code
a test expects into 134 (the example and the parallel test workers do the same).
"""

import json
import os
import signal
import sys
import time
from datetime import timedelta

import torch
import torch.distributed as dist

records, stop = sys.argv[1], sys.argv[2]
if "SLOW_TERM_S" in os.environ:
    def _slow_exit(*_):
        time.sleep(float(os.environ["SLOW_TERM_S"]))
        os._exit(0)
    signal.signal(signal.SIGTERM, _slow_exit)
dist.init_process_group("gloo", timeout=timedelta(seconds=30))
total = torch.ones(1)
dist.all_reduce(total)
record = {
    name.lower(): int(os.environ[name])
    for name in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "GROUP_RANK", "GROUP_WORLD_SIZE",
                 "MESHRUN_ROUND", "TORCHELASTIC_RESTART_COUNT")
}
record["sum"] = int(total.item())
record["master_port"] = int(os.environ["MASTER_PORT"])
with open(records, "a") as f:
    f.write(json.dumps(record) + "\n")
print(f"ready rank={record['rank']} round={record['meshrun_round']}", flush=True)
attempt = os.environ.get("FAIL_ATTEMPT", str(record["torchelastic_restart_count"]))
if os.environ.get("FAIL_RANK") == str(record["rank"]) and attempt == str(
    record["torchelastic_restart_count"]
):
    print(f"deliberate failure of rank {record['rank']}", file=sys.stderr, flush=True)
    os._exit(7)
deadline = time.monotonic() + 60
while not os.path.exists(stop) and time.monotonic() < deadline:
    time.sleep(0.05)
sys.stdout.flush()
os._exit(0 if os.path.exists(stop) else 2)
