"""flood.py LINES WIDTH [GO_FILE]: print LINES numbered lines of WIDTH bytes (newline included)
on stdout as fast as it can, then "flood-done" on stderr; then, if GO_FILE is given, wait for it
(60 s at most); then "finished rank R" on stdout and exit with $FLOOD_EXIT (default 0).

Every write is checked: a BrokenPipeError (the agent stopped reading) ends the script with
exit code 99, so a test tells a dropped pipe from the expected code. `expected_lines` gives the
exact stdout lines a test should find in the log file."""

import os
import sys
import time


def expected_lines(rank: int, lines: int, width: int) -> list[str]:
    head = [f"r{rank} line {i:06d} " for i in range(lines)]
    return [h + "x" * (width - len(h) - 1) + "\n" for h in head]


if __name__ == "__main__":
    rank = int(os.environ["RANK"])
    lines, width = int(sys.argv[1]), int(sys.argv[2])
    go = sys.argv[3] if len(sys.argv) > 3 else None
    try:
        for line in expected_lines(rank, lines, width):
            sys.stdout.write(line)
        sys.stdout.flush()
        print("flood-done", file=sys.stderr, flush=True)
        deadline = time.monotonic() + 60
        while go and not os.path.exists(go) and time.monotonic() < deadline:
            time.sleep(0.02)
        print(f"finished rank {rank}", flush=True)
    except BrokenPipeError:
        os._exit(99)
    sys.exit(int(os.environ.get("FLOOD_EXIT", "0")))
