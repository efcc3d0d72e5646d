"""exit_with.py OUT CODE WHEN FAILING: exit CODE on the ranks in FAILING ("all" or "1,3") when
WHEN is "always", or only while TORCHELASTIC_RESTART_COUNT == "0" when WHEN is "first".
Ranks that do not fail exit 0, or sleep (to be stopped) with a 5th argument "sleep".
Every run writes OUT/run_<RANK>_<TORCHELASTIC_RESTART_COUNT>.json (its environment)."""

import json
import os
import sys
import time

out, code, when, failing = sys.argv[1], int(sys.argv[2]), sys.argv[3], sys.argv[4]
others_sleep = sys.argv[5:] == ["sleep"]
rank, restarts = os.environ["RANK"], os.environ["TORCHELASTIC_RESTART_COUNT"]
with open(os.path.join(out, f"run_{rank}_{restarts}.json"), "w") as f:
    json.dump(dict(os.environ), f)
print(f"hello from rank {rank} restart {restarts}", flush=True)
mine = failing == "all" or rank in failing.split(",")
if mine and (when == "always" or restarts == "0"):
    print(f"rank {rank} failing on purpose with {code}", file=sys.stderr, flush=True)
    sys.exit(code)
if others_sleep:
    time.sleep(60)
