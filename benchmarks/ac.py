"""Activation checkpointing: meshrun `checkpoint_activations` vs torch's `checkpoint_wrapper`.

    .venv/bin/python benchmarks/ac.py [--steps 10] [--warmup 3] [--rounds 3] [--layers 8]

One process, one thread, examples/char_lm's CharLM (``--layers`` blocks of 256 channels, 8
heads, batch 16 x 128 tokens), AdamW. Each block is checkpointed: meshrun's
``checkpoint_activations(block, "full" | "selective")`` against torch's
``checkpoint_wrapper(block)`` (non-reentrant, torch.distributed.algorithms, the one torchtitan
and FSDP users apply; full only: torch has no module-level selective wrapper, torchtitan
builds its own from ``create_selective_checkpoint_contexts``), and the model with none.
Columns:

- held MiB: bytes allocated during the forward and not yet freed when it returns (what the
  backward needs, plus the loss), from torch's CPU profiler (``profile_memory=True``);
- ms/step: median over the timed steps of forward + backward + optimizer step;
- vs none: that mode's value over the unchecked model's (memory saved, compute paid).

The modes alternate for ``--rounds`` rounds (fresh model each), so drift on a shared machine
hits all of them; the last column of the second table is meshrun full / torch full.
Target (issue 21): meshrun's full checkpointing holds no more than torch's and steps within
1.1x of it.
"""

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE.parent), str(HERE.parent / "examples"), str(HERE)]
from _common import print_end, print_start  # noqa: E402

MODES = ["none", "meshrun full", "torch full", "meshrun selective"]


def build(mode: str, layers: int):
    from char_lm.model import CharLM
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

    from meshrun.parallel import checkpoint_activations

    torch.manual_seed(0)
    model = CharLM(65, 128, n_layer=layers, n_head=8, n_embd=256)
    if mode.startswith("meshrun"):
        for block in model.blocks:
            checkpoint_activations(block, mode.split()[1])
    elif mode == "torch full":
        model.blocks = torch.nn.Sequential(*[checkpoint_wrapper(b) for b in model.blocks])
    return model


def held_mib(model, x, y) -> float:
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        loss = model(x, y)
    del loss
    return sum(e.self_cpu_memory_usage for e in prof.key_averages()) / 2**20


def run(mode: str, args) -> tuple[float, float]:
    model = build(mode, args.layers)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    g = torch.Generator().manual_seed(1)
    x = torch.randint(65, (16, 128), generator=g)
    y = torch.randint(65, (16, 128), generator=g)
    held = held_mib(model, x, y)
    times = []
    for i in range(args.warmup + args.steps):
        t0 = time.perf_counter()
        opt.zero_grad(set_to_none=True)
        model(x, y).backward()
        opt.step()
        if i >= args.warmup:
            times.append((time.perf_counter() - t0) * 1000)
    return held, statistics.median(times)


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--layers", type=int, default=8)
    args = p.parse_args()
    began = print_start()
    torch.set_num_threads(1)
    held = {m: [] for m in MODES}
    ms = {m: [] for m in MODES}
    for _ in range(args.rounds):
        for mode in MODES:
            h, t = run(mode, args)
            held[mode].append(h)
            ms[mode].append(t)
    med = {m: (statistics.median(held[m]), statistics.median(ms[m])) for m in MODES}
    base_h, base_t = med["none"]
    print(f"## Activation checkpointing, {args.layers} blocks of 256 channels, batch 16 x 128, "
          f"1 thread, medians of {args.rounds} rounds\n")
    print("| mode | held MiB | vs none | ms/step | vs none |")
    print("|---|---|---|---|---|")
    for m in MODES:
        h, t = med[m]
        print(f"| {m} | {h:.1f} | {h / base_h:.2f}x | {t:.0f} | {t / base_t:.2f}x |")
    mh, mt = med["meshrun full"]
    th, tt = med["torch full"]
    print("\n| ratio | value | target | verdict |\n|---|---|---|---|")
    for what, value, target in (("held, meshrun full / torch full", mh / th, 1.0),
                                ("ms/step, meshrun full / torch full", mt / tt, 1.1)):
        print(f"| {what} | {value:.2f}x | <= {target}x | "
              f"{'met' if value <= target else 'missed'} |")
    print()
    print_end(began)


if __name__ == "__main__":
    main()
