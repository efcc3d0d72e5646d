"""proc_tree.py OUT MODE: a worker that records its pid(s) in OUT and sleeps.

MODE: "plain" (default signals); "tree" (forks a child, which forks a grandchild that calls
os.setsid()); "daemon" (a double fork: the grandchild calls os.setsid() and its parent exits at
once, so it is re-parented out of the worker's tree; the worker exits 0 once it is there); "term" (on SIGTERM: write OUT/term_<RANK> "got", sleep 1 s, append "done", exit
0); "ignore" (SIGTERM ignored); "cleanup" (SIGTERM raises SystemExit, SIGINT is Python's
KeyboardInterrupt; either way a `finally` cleanup sleeps 1 s, then writes "cleanup done"; every
signal seen is appended to OUT/sig_<RANK>). With "--wait-store" rank 0 first connects to the
agent's bootstrap store and writes OUT/pid_0_store once connected. Pid files OUT/pid_<RANK>_<role> are written atomically."""

import os
import signal
import sys
import time

out, mode = sys.argv[1], sys.argv[2]
rank = os.environ["RANK"]


def note(role: str) -> None:
    path = os.path.join(out, f"pid_{rank}_{role}")
    with open(path + ".tmp", "w") as f:
        f.write(str(os.getpid()))
    os.replace(path + ".tmp", path)


def sleep_forever() -> None:
    while True:
        time.sleep(1)


def on_term(signum, frame):
    path = os.path.join(out, f"term_{rank}")
    with open(path, "w") as f:
        f.write("got\n")
    time.sleep(1.0)
    with open(path, "a") as f:
        f.write("done\n")
    os._exit(0)


if mode == "term":
    signal.signal(signal.SIGTERM, on_term)
elif mode == "ignore":
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
elif mode == "tree":
    if os.fork() == 0:  # the child
        if os.fork() == 0:  # the grandchild: leaves the worker's session and group
            os.setsid()
            note("grandchild")
            sleep_forever()
        note("child")
        sleep_forever()
elif mode == "daemon":
    if os.fork() == 0:  # the child: forks the daemon and exits at once
        if os.fork() == 0:
            os.setsid()
            note("daemon")
            sleep_forever()
        os._exit(0)
    os.wait()
    while not os.path.exists(os.path.join(out, f"pid_{rank}_daemon")):
        time.sleep(0.01)
    note("worker")
    sys.exit(0)


def log_signal(name: str) -> None:
    with open(os.path.join(out, f"sig_{rank}"), "a") as f:
        f.write(name + "\n")


def exit_on_term(signum, frame):
    log_signal("SIGTERM")
    raise SystemExit(0)


if mode == "cleanup":
    signal.signal(signal.SIGTERM, exit_on_term)
if "--wait-store" in sys.argv[3:] and rank == "0":
    # Connect to the agent's bootstrap TCPStore: this returns only once the agent has imported
    # torch and its store has taken over the listening socket, i.e. the agent has settled.
    from datetime import timedelta

    import torch.distributed as dist

    dist.TCPStore(
        os.environ["MASTER_ADDR"],
        int(os.environ["MASTER_PORT"]),
        is_master=False,
        timeout=timedelta(seconds=30),
    ).check(["any"])
    note("store")
note("worker")
print(f"rank {rank} ready", flush=True)
if mode != "cleanup":
    sleep_forever()
try:
    sleep_forever()
except KeyboardInterrupt:
    log_signal("SIGINT")
finally:
    time.sleep(1.0)  # e.g. saving a checkpoint: what the grace period is for
    log_signal("cleanup done")
