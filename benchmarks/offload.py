"""CPU offload's device-memory saving: meshrun fully_shard vs torch FSDP2, each with and without
``CPUOffloadPolicy``, on CUDA.

    .venv/bin/python benchmarks/offload.py [--steps 5] [--warmup 2] [--blocks 8] [--width 2048]
                                           [--world N] [--json PATH] [--device cpu]

The same MLP (``--blocks`` residual blocks ``width -> 4 width -> width``, fp32) on ``--world``
GPUs (default: up to 2), nccl, Adam; every block is sharded, then the root. Each of the four
modes runs in fresh processes, so the CUDA caching allocator's peak belongs to that mode alone.
Columns, max over ranks:

- peak MiB: ``torch.cuda.max_memory_allocated()`` over the whole run (the model was built on
  the device, so its unsharded first copy counts alike in every mode: printed as "model");
- held MiB: ``torch.cuda.memory_allocated()`` between steps (after ``optimizer.step``), what
  the training state costs on the device when no unit is gathered;
- state on device / host MiB: parameters + gradients + optimizer state by where they live;
- ms/step: median of rank 0's wall time of the timed steps (offload trades time for memory).

The target: meshrun's offload holds at most 1.1x what FSDP2's offload holds on the device, and
saves as much against no offload. ``--device cpu`` is a dry run on gloo (device = host: no
device figure, "n/a"), to check the script where there is no GPU. ``--json PATH`` also writes
the numbers (tests/cuda reads them).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
import warnings
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

REPO = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(REPO)]
from _common import report_rank, spawn_ranks  # noqa: E402 - beside this file

MODES = ("torch-fsdp2", "torch-fsdp2+offload", "meshrun-fsdp", "meshrun-fsdp+offload")
MiB = 2 ** 20


class Block(nn.Module):
    def __init__(self, width):
        super().__init__()
        self.fc1 = nn.Linear(width, 4 * width)
        self.fc2 = nn.Linear(4 * width, width)

    def forward(self, x):
        return x + self.fc2(torch.relu(self.fc1(x)))


class MLP(nn.Module):
    def __init__(self, blocks, width):
        super().__init__()
        self.blocks = nn.Sequential(*[Block(width) for _ in range(blocks)])
        self.out = nn.Linear(width, 10)

    def forward(self, x):
        return self.out(self.blocks(x))


def shard(model, mode, world, device_type):
    """Every block, then the root, under ``mode``'s fully_shard (FSDP2's recipe); offload
    with pinned host memory on CUDA (both libraries' default)."""
    offload, pin = mode.endswith("+offload"), device_type == "cuda"
    if mode.startswith("meshrun"):
        from meshrun.parallel import CPUOffloadPolicy, fully_shard

        kwargs = {"offload_policy": CPUOffloadPolicy(pin_memory=pin)} if offload else {}
    else:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import CPUOffloadPolicy, fully_shard

        kwargs = {"mesh": init_device_mesh(device_type, (world,))}
        if offload:
            kwargs["offload_policy"] = CPUOffloadPolicy(pin_memory=pin)
    for block in model.blocks:
        fully_shard(block, **kwargs)
    return fully_shard(model, **kwargs)


def state_by_place(model, opt) -> dict[str, float]:
    """MiB of parameters + gradients + optimizer state on the device and on the host."""
    tensors = [p for p in model.parameters()]
    tensors += [p.grad for p in model.parameters() if p.grad is not None]
    tensors += [v for s in opt.state.values() for v in s.values() if torch.is_tensor(v)]
    out = {"device": 0.0, "host": 0.0}
    for t in tensors:
        local = t.to_local() if hasattr(t, "to_local") else t
        place = "host" if local.device.type == "cpu" else "device"
        out[place] += local.numel() * local.element_size() / MiB
    return out


def worker(rank, mode, port, args, out_dir):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      LOCAL_RANK=str(rank), WORLD_SIZE=str(args.world))
    warnings.filterwarnings("ignore", category=FutureWarning)
    cuda = args.device == "cuda"
    if cuda:
        torch.cuda.set_device(rank)
        device = torch.device("cuda", rank)
    else:
        torch.set_num_threads(1)
        device = torch.device("cpu")
    dist.init_process_group("nccl" if cuda else "gloo")
    torch.manual_seed(0)
    model = MLP(args.blocks, args.width).to(device)
    model_mib = sum(p.numel() * p.element_size() for p in model.parameters()) / MiB
    model = shard(model, mode, args.world, device.type)
    opt = torch.optim.Adam(model.parameters(), lr=1e-4)
    times, held = [], 0.0
    for step in range(args.warmup + args.steps):
        g = torch.Generator().manual_seed(step * args.world + rank)
        x = torch.randn(args.batch, args.width, generator=g).to(device)
        y = torch.randint(10, (args.batch,), generator=g).to(device)
        if cuda:
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        opt.zero_grad(set_to_none=False)
        nn.functional.cross_entropy(model(x), y).backward()
        opt.step()
        if cuda:
            torch.cuda.synchronize()
            held = max(held, torch.cuda.memory_allocated() / MiB)
        if step >= args.warmup:
            times.append(time.perf_counter() - t0)
    peak = torch.cuda.max_memory_allocated() / MiB if cuda else None
    report_rank(out_dir, rank, {"times": times, "peak_mib": peak, "held_mib": held if cuda
                                else None, "model_mib": model_mib,
                                "state": state_by_place(model, opt)})
    dist.destroy_process_group()


def main():
    p = argparse.ArgumentParser(description="CPU offload: device memory, meshrun vs FSDP2")
    p.add_argument("--steps", type=int, default=5, help="timed steps per mode")
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--blocks", type=int, default=8)
    p.add_argument("--width", type=int, default=2048)
    p.add_argument("--batch", type=int, default=64, help="samples per rank and step")
    p.add_argument("--world", type=int, default=None, help="ranks (default: up to 2 GPUs)")
    p.add_argument("--device", choices=("cuda", "cpu"), default="cuda",
                   help="cpu: a dry run on gloo, without device figures")
    p.add_argument("--json", type=Path, default=None, help="also write the numbers here")
    args = p.parse_args()
    if args.device == "cuda" and not torch.cuda.is_available():
        print("benchmarks/offload.py: needs a CUDA GPU (torch.cuda.is_available() is False); "
              "--device cpu runs it as a dry run without device figures", file=sys.stderr)
        return 2
    gpus = torch.cuda.device_count() if args.device == "cuda" else 2
    args.world = args.world or min(2, gpus)
    if args.world > gpus:
        print(f"benchmarks/offload.py: --world {args.world} needs {args.world} GPUs, this "
              f"machine has {gpus}", file=sys.stderr)
        return 2
    os.environ["OMP_NUM_THREADS"] = "1"
    results = {}
    for mode in MODES:
        ranks = spawn_ranks(args.world, worker, lambda port, out, m=mode: (m, port, args, out))
        results[mode] = {
            "ms_per_step": 1000 * statistics.median(ranks[0]["times"]),
            "peak_mib": None if ranks[0]["peak_mib"] is None
            else max(r["peak_mib"] for r in ranks),
            "held_mib": None if ranks[0]["held_mib"] is None
            else max(r["held_mib"] for r in ranks),
            "state_device_mib": max(r["state"]["device"] for r in ranks),
            "state_host_mib": max(r["state"]["host"] for r in ranks),
            "model_mib": ranks[0]["model_mib"],
        }
    name = torch.cuda.get_device_name(0) if args.device == "cuda" else "CPU (dry run)"
    print(f"`python benchmarks/offload.py --steps {args.steps} --warmup {args.warmup} "
          f"--blocks {args.blocks} --width {args.width} --batch {args.batch} --world "
          f"{args.world}{' --device cpu' if args.device == 'cpu' else ''}` ({args.world} x "
          f"{name}; model {results[MODES[0]]['model_mib']:.0f} MiB fp32)\n")
    print("| mode | peak MiB | held MiB | vs FSDP2 same offload | state on device MiB | "
          "state on host MiB | ms/step |")
    print("|---|---|---|---|---|---|---|")

    def mib(x):
        return "n/a" if x is None else f"{x:.0f}"

    for mode in MODES:
        r = results[mode]
        peer = results["torch-fsdp2" + ("+offload" if mode.endswith("+offload") else "")]
        ratio = "n/a" if r["held_mib"] is None else f"{r['held_mib'] / peer['held_mib']:.2f}x"
        print(f"| {mode} | {mib(r['peak_mib'])} | {mib(r['held_mib'])} | {ratio} | "
              f"{r['state_device_mib']:.0f} | {r['state_host_mib']:.0f} | "
              f"{r['ms_per_step']:.1f} |")
    if args.json is not None:
        args.json.write_text(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
