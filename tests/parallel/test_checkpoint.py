"""meshrun.parallel.checkpoint: save under one layout, load under another, bit for bit; and a
save killed by SIGKILL leaves the previous checkpoint whole.

The worker (workers/checkpoint_worker.py) fills every parameter and Adam state block with values
that depend only on the name and global shape, saves, and a second launch with another world
size and strategy loads and compares the blocks it holds with those values.
"""

import os
import subprocess
import sys
import textwrap

import pytest

from tests.parallel.harness import REPO, kill_once_writing, launch

WORKER = "checkpoint_worker.py"


def save(tmp_path, n: int, flags: list[str]) -> None:
    launch(WORKER, n, ("save", str(tmp_path), *flags), timeout=120)


def load(tmp_path, n: int, flags: list[str]) -> None:
    """Load what `save` wrote under another layout; every rank checks the blocks it holds."""
    result = launch(WORKER, n, ("load", str(tmp_path), *flags), timeout=120)
    for rank, r in enumerate(result.results):
        assert r.get("roundtrip") == "ok", f"rank {rank}: {r.get('roundtrip')}"


@pytest.mark.timeout(200)
def test_4_to_2_and_3_and_1(tmp_path):
    """pp 2 x tp 2 (fused qkv, padded vocab, stage ownership) -> FSDP over 2 and over 3 ranks
    (uneven rows), and -> one process (one save, each load reads it: loading changes nothing)."""
    save(tmp_path, 4, ["--pp", "2", "--tp", "2"])
    load(tmp_path, 2, ["--dp-mode", "fsdp"])
    load(tmp_path, 3, ["--dp-mode", "fsdp"])
    load(tmp_path, 1, [])


@pytest.mark.timeout(200)
def test_tp_and_fsdp_to_other_tp_and_pipeline(tmp_path):
    """tp 2 with FSDP over dp 2 (an FSDP shard of a TP shard) -> pp 2 x tp 1 x ddp, -> tp 2."""
    save(tmp_path, 4, ["--tp", "2", "--dp-mode", "fsdp"])
    load(tmp_path, 2, ["--pp", "2", "--dp-mode", "ddp"])
    load(tmp_path, 2, ["--tp", "2"])


@pytest.mark.timeout(120)
def test_2_to_1(tmp_path):
    save(tmp_path, 2, ["--dp-mode", "fsdp"])
    load(tmp_path, 1, [])


KILLED_SAVE = textwrap.dedent("""
    import sys, torch
    from meshrun.parallel import checkpoint
    small = {"w": torch.arange(10.0), "step": 1}
    checkpoint.save(small, sys.argv[1] + "/step_1")
    print("first saved", flush=True)
    big = {f"w{i}": torch.randn(4_000_000) for i in range(25)}  # 400 MB: seconds to write
    big["step"] = 2
    checkpoint.save(big, sys.argv[1] + "/step_2")
    print("second saved", flush=True)
""")


@pytest.mark.timeout(120)
def test_kill_during_save_leaves_previous_checkpoint(tmp_path):
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    proc = subprocess.Popen([sys.executable, "-c", KILLED_SAVE, str(tmp_path)], env=env,
                            stdout=subprocess.PIPE, text=True)
    partial = tmp_path / "step_2.partial"
    out = kill_once_writing(proc, partial, timeout=90)
    assert "second saved" not in out

    import torch

    from meshrun.parallel import checkpoint

    assert checkpoint.latest(tmp_path) == str(tmp_path / "step_1")
    assert not (tmp_path / "step_2").exists()
    state = {"w": torch.zeros(10), "step": 0}
    checkpoint.load(state, checkpoint.latest(tmp_path))
    assert torch.equal(state["w"], torch.arange(10.0)) and state["step"] == 1
    checkpoint.save({"w": torch.ones(3), "step": 2}, tmp_path / "step_2")  # clears the partial
    assert not partial.exists() and checkpoint.latest(tmp_path) == str(tmp_path / "step_2")


@pytest.mark.timeout(60)
def test_load_errors_are_the_documented_types(tmp_path):
    import torch
    from torch import nn

    from meshrun.parallel import checkpoint

    model = nn.Linear(7, 13)
    checkpoint.save({"model": checkpoint.model_state(model), "step": 1}, tmp_path / "step_1")
    with pytest.raises(ValueError, match=r"Size mismatch .*\[13, 7\].*\[14, 7\]"):
        checkpoint.load({"model": checkpoint.model_state(nn.Linear(7, 14))}, tmp_path / "step_1")
    with pytest.raises(RuntimeError, match="Missing key in checkpoint state_dict: extra"):
        checkpoint.load({"model": checkpoint.model_state(model), "extra": torch.zeros(2)},
                        tmp_path / "step_1")
    with pytest.raises(FileNotFoundError, match="latest"):
        checkpoint.load({}, checkpoint.latest(tmp_path / "nothing here"))
    with pytest.raises(FileNotFoundError, match="metadata"):
        checkpoint.load({}, tmp_path)
