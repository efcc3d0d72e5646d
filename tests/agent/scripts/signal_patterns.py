"""A worker that meets signals in one of the documented ways (Python's ``signal`` docs, torch
elastic's SIGTERM), with torch.distributed up on gloo (so meshrun's collective record is
reading). Run under meshrun and under torchrun by tests/agent/test_worker_signals.py.

argv: OUT MODE, MODE one of
  handler  Python handlers for SIGUSR1 and SIGTERM; ends once it got both
  sigwait  SIGUSR1 blocked (pthread_sigmask), looked for with sigtimedwait(.., 0) after each
           step of local work, then read again with sigwait
  term     SIGTERM blocked, looked for the same way (a preemption checked at step ends)

Writes OUT/threads_<rank> (its Python threads' names) and OUT/pid_<rank> once ready, OUT/got_<rank> one line per signal read (its name), and
exits 0 after the last one (or 3 after 60 s without it).
"""

import os
import signal
import sys
import threading
import time

import torch
import torch.distributed as dist

out, mode = sys.argv[1], sys.argv[2]
rank = int(os.environ["RANK"])
if mode == "sigwait":
    signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGUSR1})
elif mode == "term":
    signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGTERM})
got = []


def note(name: str) -> None:
    got.append(name)
    with open(os.path.join(out, f"got_{rank}"), "a") as f:
        f.write(name + "\n")


def on_signal(signum, frame):
    note(signal.Signals(signum).name)


if mode == "handler":
    signal.signal(signal.SIGUSR1, on_signal)
    signal.signal(signal.SIGTERM, on_signal)
dist.init_process_group("gloo")
t = torch.ones(4)
dist.all_reduce(t)
assert t[0].item() == dist.get_world_size()
time.sleep(0.6)  # the record's thread has looked at the ring (every 0.5 s)
with open(os.path.join(out, f"threads_{rank}"), "w") as f:
    f.write("\n".join(t.name for t in threading.enumerate()))
tmp = os.path.join(out, f"pid_{rank}.tmp")
with open(tmp, "w") as f:
    f.write(str(os.getpid()))
os.replace(tmp, os.path.join(out, f"pid_{rank}"))
if mode == "handler":
    deadline = time.monotonic() + 60
    while len(got) < 2 and time.monotonic() < deadline:
        time.sleep(0.02)
else:  # training steps, looking for the blocked signal at each step's end (the signal
    # comes while the main thread computes, not while it waits for it), then a plain sigwait
    wanted = signal.SIGUSR1 if mode == "sigwait" else signal.SIGTERM
    deadline = time.monotonic() + 60
    x = torch.randn(64, 64)
    while time.monotonic() < deadline:
        x = torch.tanh(x @ x)  # local work: a peer that has read its signal may have left
        time.sleep(0.05)
        info = signal.sigtimedwait({wanted}, 0)
        if info is not None:
            note(signal.Signals(info.si_signo).name)
            break
    if got and mode == "sigwait":
        note(signal.Signals(signal.sigwait({wanted})).name)
os._exit(0 if got else 3)  # no destroy: a peer may be gone already (a launcher's stop)
