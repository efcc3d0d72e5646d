"""Each recorded collective carries its call site (the innermost frame of the user's code),
the ``at`` field of the record file (issue 48).

Two sources (`meshrun.agent.collective_record.Recorder._call_sites`): torch's pickle dump,
which holds every call's Python frames, read where ``torch._inductor.codecache`` is already
loaded (symbolizing the frames imports it: 3.6 s and 71 MB otherwise); else the main thread's
stack, for the newest call, once the ring has not moved for a look while that thread is inside
torch: the call a rank hangs in.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from meshrun.agent.collective_record import call_site

pytestmark = pytest.mark.timeout(120)

REPO = Path(__file__).resolve().parents[2]
MISTAKES = Path(__file__).parent / "e2e_scripts" / "collective_mistakes.py"


def test_call_site_is_the_innermost_frame_of_the_users_code():
    import threading

    import torch

    torch_file = str(Path(torch.__file__).parent / "distributed" / "distributed_c10d.py")
    meshrun_file = str(REPO / "meshrun" / "parallel" / "ddp.py")
    stdlib_file = threading.__file__
    frames = [(torch_file, 3245, "all_reduce"), (meshrun_file, 10, "sync"),
              (stdlib_file, 331, "wait"), ("<frozen importlib._bootstrap>", 1, "x"),
              ("/home/me/train.py", 42, "step"), ("/home/me/train.py", 60, "<module>")]  # fmt: skip
    assert call_site(frames) == "/home/me/train.py:42 in step"
    assert call_site(frames[:4]) == ""
    assert call_site([]) == ""
    lib = "/venv/lib/python3.11/site-packages/accelerate/accelerator.py"  # a user's library
    assert call_site([(torch_file, 1, "all_reduce"), (lib, 7, "gather")]) == f"{lib}:7 in gather"


WITH_TORCH_FRAMES = textwrap.dedent("""
    import json, sys
    import torch, torch.distributed as dist
    import torch._inductor.codecache  # as a script that compiles has it
    from meshrun.agent.collective_record import Recorder

    def step(x):
        dist.all_reduce(x)  # STEP

    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    recorder = Recorder(sys.argv[1])
    step(torch.ones(4))
    step(torch.ones(2))
    dist.barrier()  # BARRIER
    assert recorder.write_once()
    dist.all_reduce(torch.ones(3))  # LATER
    assert recorder.write_once()
    print(json.dumps([c["at"] for c in json.load(open(sys.argv[1]))["calls"]]))
    dist.destroy_process_group()
""")


def _line(text: str, mark: str) -> int:
    return next(i for i, line in enumerate(text.splitlines(), 1) if mark in line)


def test_every_call_gets_its_site_from_torchs_frames(tmp_path):
    script = tmp_path / "train.py"
    script.write_text(WITH_TORCH_FRAMES)
    env = {**os.environ, "TORCH_FR_BUFFER_SIZE": "16", "PYTHONPATH": str(REPO)}
    done = subprocess.run([sys.executable, str(script), str(tmp_path / "rec.json")],
                          capture_output=True, text=True, timeout=100, env=env)  # fmt: skip
    assert done.returncode == 0, done.stderr
    sites = json.loads(done.stdout.strip().splitlines()[-1])
    step, barrier, later = (f"{script}:{_line(WITH_TORCH_FRAMES, m)}" for m in ("# STEP", "# BARRIER", "# LATER"))
    assert sites == [f"{step} in step", f"{step} in step", f"{barrier} in <module>",
                     f"{later} in <module>"], sites  # fmt: skip


def test_the_call_a_rank_hangs_in_gets_its_site_without_torchs_frames(launch):
    """collective_mistakes.py skip: rank 0 skips all_reduce #2, rank 1 waits in it until gloo's
    3 s timeout; rank 1's record names the line of that call (no torch.compile here: the site
    comes from the main thread's stack)."""
    logs = launch.cwd / "logs"
    result = launch.run(["--nproc-per-node", "2", "--log-dir", str(logs), str(MISTAKES), "skip",
                         "3"], timeout=100)  # fmt: skip
    assert result.returncode != 0, result.stderr
    (record,) = [p for p in logs.rglob("collectives.json") if p.parent.name == "1"]
    calls = json.loads(record.read_text())["calls"]
    wait_line = _line(MISTAKES.read_text(), "        dist.all_reduce(x)")
    assert [(c["seq"], c["op"]) for c in calls] == [(1, "all_reduce"), (2, "all_reduce")], calls
    assert calls[-1]["at"] == f"{MISTAKES}:{wait_line} in train_step", calls


AFTER_THE_CALL = textwrap.dedent("""
    import json, sys, time
    import torch, torch.distributed as dist
    from torch.utils.data import DataLoader, Dataset
    from meshrun.agent.collective_record import Recorder

    class Slow(Dataset):
        def __len__(self):
            return 2
        def __getitem__(self, i):
            time.sleep(1.0)  # READ
            return torch.ones(2)

    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    recorder = Recorder(sys.argv[1], interval=0.1).start()
    dist.all_reduce(torch.ones(4))  # CALL
    for batch in DataLoader(Slow()):  # the main thread in torch's DataLoader, not in a collective
        pass
    recorder.stop()
    print(json.dumps([c["at"] for c in json.load(open(sys.argv[1]))["calls"]]))
    dist.destroy_process_group()
""")


def test_a_call_that_completed_gets_no_site_from_where_the_rank_went_on(tmp_path):
    """The ring stands still for 2 s after the all_reduce while the main thread is inside
    torch's DataLoader (and the user's slow __getitem__): that is no collective's site."""
    script = tmp_path / "train.py"
    script.write_text(AFTER_THE_CALL)
    env = {**os.environ, "TORCH_FR_BUFFER_SIZE": "16", "PYTHONPATH": str(REPO)}
    done = subprocess.run([sys.executable, str(script), str(tmp_path / "rec.json")],
                          capture_output=True, text=True, timeout=100, env=env)  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout.strip().splitlines()[-1]) == [""]
