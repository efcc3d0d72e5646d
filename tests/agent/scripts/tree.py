"""A worker that starts a process tree, for stop() and reaper tests.

Usage: tree.py PIDFILE [--ignore-term]

worker (this process) -> child (same process group) -> grandchild (calls setsid: own session).
Each appends "<role> <pid>" to PIDFILE once it runs, then sleeps. With --ignore-term, every
process ignores SIGTERM, so only SIGKILL stops it.
"""

import os
import signal
import subprocess
import sys
import time


def main() -> None:
    role = os.environ.get("TREE_ROLE", "worker")
    pidfile = sys.argv[1]
    if "--ignore-term" in sys.argv:
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
    if role == "grandchild":
        os.setsid()
    nxt = {"worker": "child", "child": "grandchild"}.get(role)
    if nxt:
        subprocess.Popen([sys.executable, *sys.argv], env={**os.environ, "TREE_ROLE": nxt})
    with open(pidfile, "a") as f:
        f.write(f"{role} {os.getpid()}\n")
    print(f"{role} ready", flush=True)
    time.sleep(120)


if __name__ == "__main__":
    main()
