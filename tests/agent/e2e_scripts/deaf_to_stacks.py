"""Rank 0 arms faulthandler (meshrun.parallel's register_stack_dump) and then blocks the stack
signal, so it never answers the agent's request for its stack; rank 1 fails after a moment."""

import os
import signal
import sys
import time

from meshrun.parallel.heartbeat import register_stack_dump

if int(os.environ["RANK"]) == 0:
    assert register_stack_dump()
    signal.pthread_sigmask(signal.SIG_BLOCK, {int(os.environ["MESHRUN_STACK_SIGNAL"])})
    time.sleep(120)
else:
    time.sleep(1)
    sys.exit(3)
