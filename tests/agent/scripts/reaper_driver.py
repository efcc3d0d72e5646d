"""A stand-in agent for the reaper test: a Reaper and a WorkerGroup running tree.py, then sleep.

Usage: reaper_driver.py PIDFILE LOGDIR. Appends "driver <pid>" and "reaper <pid>" to PIDFILE;
the worker tree appends its own lines. The test kills this process with SIGKILL.
"""

import os
import sys
import time
from pathlib import Path

from meshrun.agent.reaper import Reaper
from meshrun.agent.workers import WorkerGroup, WorkerSpec

pidfile, logdir = sys.argv[1], Path(sys.argv[2])
here = os.path.dirname(os.path.abspath(__file__))
reaper = Reaper()
reaper.start()
spec = WorkerSpec(
    local_rank=0,
    global_rank=0,
    argv=(sys.executable, "-u", os.path.join(here, "tree.py"), pidfile, "--ignore-term"),
    env=dict(os.environ),
    log_dir=logdir / "0",
    console_out=False,
    console_err=False,
)
group = WorkerGroup([spec], reaper)
group.start()
with open(pidfile, "a") as f:
    f.write(f"driver {os.getpid()}\nreaper {reaper.pid}\n")
time.sleep(120)
