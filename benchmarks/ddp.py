"""meshrun.parallel.ddp vs torch's DistributedDataParallel: step time and peak memory.

    .venv/bin/python benchmarks/ddp.py [--steps 30] [--warmup 10] [--rounds 2]

Same model, same data, 2 ranks on gloo (CPU, one thread per rank). Every (model, mode) run is
a fresh pair of processes, so peak RSS belongs to that mode alone; the modes alternate
(torch, meshrun, torch, meshrun, ...) for ``--rounds`` rounds so slow drift on a shared machine
hits both. Step time = median over all timed steps (after warm-up) of rank 0's wall time for
zero_grad + forward + backward (incl. the gradient all-reduce) + optimizer step. Peak RSS =
``ru_maxrss`` of each rank at the end, MiB; the table shows the larger of the two ranks.
Models: an MLP of ~10.5M parameters at batch 32 per rank, and examples/train_char_lm.py's
CharLM at its default size (batch 16 x 64 tokens per rank).
"""

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

REPO = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(REPO), str(REPO / "examples")]
from _common import make_char_lm, report_rank, spawn_ranks  # noqa: E402 - beside this file

MODES = ("torch", "meshrun")


def make_mlp():
    model = nn.Sequential(nn.Linear(1024, 2048), nn.ReLU(), nn.Linear(2048, 2048), nn.ReLU(),
                          nn.Linear(2048, 2048), nn.ReLU(), nn.Linear(2048, 10))

    def batch(step, rank):
        g = torch.Generator().manual_seed(step * 2 + rank)
        return torch.randn(32, 1024, generator=g), torch.randint(10, (32,), generator=g)

    def loss_fn(m, x, y):
        return nn.functional.cross_entropy(m(x), y)

    return model, batch, loss_fn



MODELS = {"mlp-10M": make_mlp, "char-lm": make_char_lm}


def worker(rank, model_name, mode, port, steps, warmup, out_dir):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      LOCAL_RANK=str(rank), WORLD_SIZE="2")
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    # Both modes import both libraries, so peak RSS compares the strategies, not the imports
    # (meshrun.parallel also brings FSDP, TP and pipelining modules: tens of MiB of code).
    from torch.nn.parallel import DistributedDataParallel

    from meshrun.parallel import ddp

    torch.manual_seed(0)
    model, batch, loss_fn = MODELS[model_name]()
    model = DistributedDataParallel(model) if mode == "torch" else ddp(model)
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    times = []
    for step in range(warmup + steps):
        x, y = batch(step, rank)
        t0 = time.perf_counter()
        opt.zero_grad(set_to_none=True)
        loss_fn(model, x, y).backward()
        opt.step()
        times.append(time.perf_counter() - t0)
    n_params = sum(p.numel() for p in model.parameters())
    report_rank(out_dir, rank, {"times": times[warmup:], "params": n_params})
    dist.destroy_process_group()



def run(model_name, mode, steps, warmup):
    return spawn_ranks(2, worker, lambda port, out: (model_name, mode, port, steps, warmup, out))


def main():
    p = argparse.ArgumentParser(description="meshrun ddp vs torch DDP (2 ranks, gloo)")
    p.add_argument("--steps", type=int, default=30, help="timed steps per run")
    p.add_argument("--warmup", type=int, default=10)
    p.add_argument("--rounds", type=int, default=2, help="runs per mode, alternating")
    p.add_argument("--models", nargs="+", choices=list(MODELS), default=list(MODELS))
    args = p.parse_args()
    os.environ["OMP_NUM_THREADS"] = "1"

    print(f"{'model':<9} {'params':>7} {'mode':<8} {'ms/step':>8} {'peak RSS MiB':>13}")
    for model_name in args.models:
        times = {m: [] for m in MODES}
        rss = {m: 0.0 for m in MODES}
        for _ in range(args.rounds):
            for mode in MODES:
                ranks = run(model_name, mode, args.steps, args.warmup)
                times[mode] += ranks[0]["times"]
                rss[mode] = max(rss[mode], *(r["rss_mib"] for r in ranks))
                params = ranks[0]["params"]
        ms = {m: 1000 * statistics.median(times[m]) for m in MODES}
        for mode in MODES:
            print(f"{model_name:<9} {params / 1e6:>6.1f}M {mode:<8} {ms[mode]:>8.1f} "
                  f"{rss[mode]:>13.0f}")
        print(f"{model_name:<9} {'':>7} {'ratio':<8} {ms['meshrun'] / ms['torch']:>7.3f}x "
              f"{rss['meshrun'] / rss['torch']:>12.3f}x")


if __name__ == "__main__":
    main()
