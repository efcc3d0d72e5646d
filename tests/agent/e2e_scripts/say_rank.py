"""say_rank.py: print a line on stdout and one on stderr naming the rank, then exit 0."""

import os
import sys

rank = os.environ["RANK"]
print(f"out-line from rank {rank}", flush=True)
print(f"err-line from rank {rank}", file=sys.stderr, flush=True)
print(f"name={__name__} rank={rank} args={sys.argv[1:]}", flush=True)
