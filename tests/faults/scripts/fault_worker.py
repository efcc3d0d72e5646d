"""fault_worker.py OUT MODE: one worker of the fault-matrix tests (tests/faults).

Every run writes OUT/run_<RANK>_<TORCHELASTIC_RESTART_COUNT> first. MODE:

- ``segv``: rank 1 dies of a real SIGSEGV (a NULL read through ctypes); rank 0 sleeps.
- ``stubborn-tree``: rank 0 ignores SIGTERM and forks a child and a grandchild that calls
  os.setsid() (both ignore SIGTERM too), writes OUT/pid_0_{worker,child,grandchild}, and
  sleeps; rank 1 waits for those files, writes OUT/fault_t (time.time()), and exits 3.
"""

import os
import signal
import sys
import time

out, mode = sys.argv[1], sys.argv[2]
rank, restarts = os.environ["RANK"], os.environ["TORCHELASTIC_RESTART_COUNT"]


def write(name: str, text: str) -> None:
    path = os.path.join(out, name)
    with open(path + ".tmp", "w") as f:
        f.write(text)
    os.replace(path + ".tmp", path)


def sleep_forever() -> None:
    while True:
        time.sleep(1)


write(f"run_{rank}_{restarts}", "")
print(f"fault_worker rank {rank} restart {restarts}", flush=True)
if mode == "segv":
    if rank == "1":
        import ctypes

        print("about to segfault", file=sys.stderr, flush=True)
        ctypes.string_at(0)  # a real SIGSEGV from a NULL read
    sleep_forever()
elif mode == "stubborn-tree":
    if rank == "0":
        signal.signal(signal.SIGTERM, signal.SIG_IGN)  # inherited by the forks below
        if os.fork() == 0:
            if os.fork() == 0:
                os.setsid()
                write("pid_0_grandchild", str(os.getpid()))
                sleep_forever()
            write("pid_0_child", str(os.getpid()))
            sleep_forever()
        write("pid_0_worker", str(os.getpid()))
        sleep_forever()
    deadline = time.monotonic() + 60
    names = ("pid_0_worker", "pid_0_child", "pid_0_grandchild")
    while not all(os.path.exists(os.path.join(out, n)) for n in names):
        if time.monotonic() > deadline:
            sys.exit(9)
        time.sleep(0.02)
    write("fault_t", repr(time.time()))
    print("rank 1 failing with 3", file=sys.stderr, flush=True)
    sys.exit(3)
else:
    sys.exit(f"unknown mode {mode}")
