"""The strategies and the example on CUDA with nccl, one GPU per rank, through the test
harness (``python -m meshrun --nproc-per-node N ...``). Skipped without CUDA (conftest.py).

The workers in tests/parallel/workers build their models and batches on the CPU (their
parity tests run on gloo), so they cannot run on nccl as they are; workers/device_checks.py
runs the same kinds of checks with everything on ``ctx.device``, so a tensor that the library
makes on the CPU by itself fails here. NCCL cannot put two ranks on one GPU: nproc is at most
the GPU count, and what needs two ranks is skipped on one GPU.
"""

import json
import re
from pathlib import Path

import pytest
import torch

from tests.parallel.harness import launch  # REPO on sys.path: conftest.py

REPO = Path(__file__).resolve().parents[2]
CHECKS = REPO / "tests" / "cuda" / "workers" / "device_checks.py"
EXAMPLE = REPO / "examples" / "train_char_lm.py"
# global batch 8 everywhere: one process accumulates 2 microbatches of 4, dp 2 runs 1 each
ARGS = ("--steps", "3", "--batch-size", "4", "--global-batch-size", "8", "--log-every", "1")


def losses(output):
    found = [float(x) for x in re.findall(r"step \d+ \| loss ([0-9.]+)", output)]
    assert len(found) == 3, output
    return found


@pytest.mark.gpus(1)
@pytest.mark.timeout(200)
def test_strategies_on_cuda():
    """ddp, fully_shard, TP (padded vocabulary), PP (2 GPUs), clipping on a mesh and a
    checkpoint round trip, each against a one-process reference on the same GPU."""
    nproc = min(2, torch.cuda.device_count())
    run = launch(CHECKS, nproc, timeout=180, check=False)
    assert run.returncode == 0, run.output
    for rank, result in enumerate(run.results):
        assert result, f"rank {rank} reported nothing:\n{run.output}"
        failed = {name: text for name, text in result.items() if text != "ok"}
        assert not failed, f"rank {rank}: " + "\n".join(f"{k}:\n{v}" for k, v in failed.items())


@pytest.fixture(scope="module")
def one_process():
    return losses(launch(EXAMPLE, 1, ARGS, timeout=150).output)


@pytest.mark.gpus(1)
@pytest.mark.timeout(300)
def test_example_checkpoint_and_resume_one_gpu(tmp_path, one_process):
    """World of one under the launcher: nccl, the per-step stop flag all-reduced on the GPU,
    a checkpoint saved and resumed from."""
    ckpt = ("--checkpoint-dir", str(tmp_path), "--checkpoint-every", "2")
    first = launch(EXAMPLE, 1, (*ARGS, *ckpt), timeout=150).output
    assert losses(first) == pytest.approx(one_process, abs=1e-3)
    resumed = launch(EXAMPLE, 1, (*ARGS[:1], "4", *ARGS[2:], *ckpt), timeout=150).output
    assert "resumed from step 3" in resumed, resumed


@pytest.mark.gpus(2)
@pytest.mark.timeout(300)
@pytest.mark.parametrize("flags", [
    ("--dp-mode", "ddp"), ("--dp-mode", "torch-ddp"), ("--parallel", "fsdp"),
    ("--tp", "2"), ("--parallel", "tp", "--sequence-parallel"), ("--pp", "2"),
], ids=["ddp", "torch-ddp", "fsdp", "tp", "tp-sp", "pp"])
def test_example_on_two_gpus(tmp_path, one_process, flags):
    """Two GPUs: each strategy of the example (tp: the 65-character vocabulary is padded, so
    rank 1 masks a logit), with a checkpoint each step, matches one process on one GPU."""
    output = launch(EXAMPLE, 2, (*ARGS, *flags, "--checkpoint-dir", str(tmp_path),
                                 "--checkpoint-every", "1"), timeout=150).output
    assert losses(output) == pytest.approx(one_process, abs=2e-3)


@pytest.mark.gpus(1)
@pytest.mark.timeout(400)
def test_offload_keeps_the_training_state_off_the_device(tmp_path):
    """CPU offload's device-memory saving, measured by benchmarks/offload.py (meshrun and
    torch FSDP2, each with and without CPUOffloadPolicy): with offload no parameter, gradient
    or optimizer state stays on the device, and what a step leaves allocated there is at most
    half of no offload's (fp32 Adam: params + grads + 2 moments = 4 copies of the shards)."""
    import subprocess
    import sys

    out = tmp_path / "offload.json"
    run = subprocess.run([sys.executable, str(REPO / "benchmarks" / "offload.py"), "--steps",
                          "2", "--warmup", "1", "--blocks", "4", "--width", "2048", "--json",
                          str(out)], capture_output=True, text=True, timeout=380)
    assert run.returncode == 0, run.stdout + run.stderr
    print(run.stdout)
    got = json.loads(out.read_text())
    for lib in ("meshrun-fsdp", "torch-fsdp2"):
        plain, off = got[lib], got[lib + "+offload"]
        assert off["state_device_mib"] == 0, (lib, off)
        assert off["held_mib"] <= 0.5 * plain["held_mib"], (lib, plain, off)
    assert got["meshrun-fsdp+offload"]["held_mib"] <= 1.1 * got["torch-fsdp2+offload"][
        "held_mib"] + 16, got
