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

    .venv/bin/python benchmarks/ddp.py --hooks none fp16 bf16 powersgd [--rank 4]

Communication hooks instead: for each hook, torch's DDP with torch's hook (``none``: torch's
``allreduce_hook``, so both sides go through a Python hook) beside meshrun's ``ddp`` with
meshrun's (`meshrun.parallel.comm_hooks`), alternating, as above: step time, and the bytes
handed to ``all_reduce`` per step (counted by wrapping ``torch.distributed.all_reduce``, which
both sides' hooks call; mean over the timed steps). PowerSGD: ``matrix_approximation_rank``
``--rank``, ``start_powerSGD_iter=2`` (the warm-up steps cover the start), torch's other
defaults on both sides. torch's ``bf16_compress_hook`` refuses gloo (it needs NCCL or XCCL),
so torch's ``fp16_compress_hook`` stands in for it (same bytes, same casts). PowerSGD runs with
every gradient in one bucket on both sides: torch's
``powerSGD_hook`` issues its P and Q all-reduces from future callbacks (on gloo's threads), so
with two buckets or more the ranks can issue them in different orders, and gloo aborts
("Received data size doesn't match expected size. Is there a distributed collective
mismatch"; 3 of 3 runs on the MLP here). meshrun's issues them on the training thread in bucket
order, so it runs with any buckets.

    .venv/bin/python benchmarks/ddp.py --record [--rounds 4]
    .venv/bin/python benchmarks/ddp.py --desync [--rounds 4]

The collective record's cost (`meshrun.agent.collectives`, on by default under meshrun):
meshrun's ``ddp`` with the record off, then on (torch's flight recorder with 64 entries, and
the thread that copies it to a file every 0.5 s), alternating, ``--rounds`` runs each: the
median step time of each side, their ratio, and the run-to-run noise (the spread of the
per-run medians within each side), so a cost below the noise reads as such.

``--desync``: the cost of torch's ``TORCH_DISTRIBUTED_DEBUG=DETAIL`` fingerprint check before
every collective (what ``meshrun --desync-check`` set before issue 48; meshrun's own check
now: ``benchmarks/desync.py``): microseconds per ``all_reduce`` of 256 floats on
2 ranks (1000 calls, median of ``--rounds`` runs each side, alternating), and meshrun ``ddp``'s
step time, with the check off and on.
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
from _common import make_char_lm, print_end, print_start, report_rank, spawn_ranks  # noqa: E402 - beside this file

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


HOOKS = ("none", "fp16", "bf16", "powersgd")


def register_hook(model, mode, hook, rank_r):
    """torch's hook on torch's DDP, or meshrun's on meshrun's ddp (``hook`` in HOOKS)."""
    if mode == "torch":
        from torch.distributed.algorithms.ddp_comm_hooks import default_hooks as lib
        from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as psgd
    else:
        from meshrun.parallel import comm_hooks as lib
        psgd = lib
    if hook == "powersgd":
        model.register_comm_hook(psgd.PowerSGDState(None, matrix_approximation_rank=rank_r,
                                                    start_powerSGD_iter=2),
                                 psgd.powerSGD_hook)
    else:
        if mode == "torch" and hook == "bf16":  # torch's needs NCCL or XCCL: the nearest
            hook = "fp16"  # (same bytes, same casts) stands in; the table says so
        model.register_comm_hook(None, {"none": lib.allreduce_hook,
                                        "fp16": lib.fp16_compress_hook,
                                        "bf16": lib.bf16_compress_hook}[hook])


class ByteCounter:
    """Wraps ``torch.distributed.all_reduce``: ``bytes`` handed to it since the last reset."""

    def __init__(self):
        self.bytes, self.original = 0, dist.all_reduce

        def counting(tensor, *args, **kwargs):
            self.bytes += tensor.numel() * tensor.element_size()
            return self.original(tensor, *args, **kwargs)

        dist.all_reduce = counting


def worker(rank, model_name, mode, port, steps, warmup, out_dir, hook=None, rank_r=4,
           record=False, desync=False):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      LOCAL_RANK=str(rank), WORLD_SIZE="2")
    torch.set_num_threads(1)
    if desync:  # torch's DETAIL check (read at torch's import)
        os.environ["TORCH_DISTRIBUTED_DEBUG"] = "DETAIL"
        dist.set_debug_level_from_env()
    if record:  # as meshrun's worker site starts it: the ring before the group, then the copy
        from meshrun.agent.collective_record import RING_ENTRIES, Recorder

        os.environ["TORCH_FR_BUFFER_SIZE"] = str(RING_ENTRIES)
        Recorder(str(Path(out_dir) / f"collectives{rank}.json")).start()
    dist.init_process_group("gloo")
    # Both modes import both libraries, so peak RSS compares the strategies, not the imports
    # (meshrun.parallel also brings FSDP, TP and pipelining modules: tens of MiB of code).
    from torch.nn.parallel import DistributedDataParallel

    from meshrun.parallel import ddp

    torch.manual_seed(0)
    model, batch, loss_fn = MODELS[model_name]()
    if hook == "powersgd":  # one bucket on both sides: see the module docstring
        import meshrun.parallel.ddp as meshrun_ddp

        meshrun_ddp.DIRECT_MIN_BYTES = 1 << 62
        one = dict(bucket_cap_mb=100_000)
        model = DistributedDataParallel(model, **one) if mode == "torch" else \
            ddp(model, **one, first_bucket_cap_mb=100_000)
    else:
        model = DistributedDataParallel(model) if mode == "torch" else ddp(model)
    counter = None
    if hook is not None:
        register_hook(model, mode, hook, rank_r)
        counter = ByteCounter()
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    times, sent = [], []
    for step in range(warmup + steps):
        x, y = batch(step, rank)
        if counter is not None:
            counter.bytes = 0
        t0 = time.perf_counter()
        opt.zero_grad(set_to_none=True)
        loss_fn(model, x, y).backward()
        opt.step()
        times.append(time.perf_counter() - t0)
        sent.append(counter.bytes if counter is not None else 0)
    n_params = sum(p.numel() for p in model.parameters())
    report_rank(out_dir, rank, {"times": times[warmup:], "params": n_params,
                                "bytes": statistics.mean(sent[warmup:])})
    dist.destroy_process_group()



def run(model_name, mode, steps, warmup, hook=None, rank_r=4, record=False, desync=False):
    return spawn_ranks(2, worker, lambda port, out: (model_name, mode, port, steps, warmup, out,
                                                      hook, rank_r, record, desync))


def collective_worker(rank, port, out_dir, desync, calls):
    """``calls`` all_reduces of 256 floats; reports the mean microseconds per call."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      WORLD_SIZE="2")
    if desync:
        os.environ["TORCH_DISTRIBUTED_DEBUG"] = "DETAIL"
        dist.set_debug_level_from_env()
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    assert (dist.get_debug_level() == dist.DebugLevel.DETAIL) == desync
    x = torch.ones(256)
    for _ in range(50):
        dist.all_reduce(x)
    t0 = time.perf_counter()
    for _ in range(calls):
        dist.all_reduce(x)
    report_rank(out_dir, rank, {"us": 1e6 * (time.perf_counter() - t0) / calls})
    dist.destroy_process_group()


def desync_table(args):
    """Per-collective and per-step cost of torch's fingerprint check (TORCH_DISTRIBUTED_DEBUG)."""
    us = {False: [], True: []}
    for _ in range(args.rounds):
        for desync in (False, True):
            ranks = spawn_ranks(2, collective_worker, lambda port, out, d=desync:
                                (port, out, d, 1000))  # fmt: skip
            us[desync].append(ranks[0]["us"])
    off, on = statistics.median(us[False]), statistics.median(us[True])
    print(f"{'all_reduce of 256 floats':<26} {'check off us':>13} {'check on us':>12} "
          f"{'ratio':>7} {'added us':>9}")
    print(f"{'':<26} {off:>13.1f} {on:>12.1f} {on / off:>6.2f}x {on - off:>9.1f}", flush=True)
    print(f"{'model':<26} {'check off ms':>13} {'check on ms':>12} {'ratio':>7}")
    for model_name in args.models:
        times = {False: [], True: []}
        for _ in range(args.rounds):
            for desync in (False, True):
                ranks = run(model_name, "meshrun", args.steps, args.warmup, desync=desync)
                times[desync] += ranks[0]["times"]
        ms = {d: 1000 * statistics.median(times[d]) for d in times}
        print(f"{model_name:<26} {ms[False]:>13.1f} {ms[True]:>12.1f} "
              f"{ms[True] / ms[False]:>6.3f}x", flush=True)


def record_table(args):
    """Per model: meshrun ddp's ms/step with the collective record off and on, alternating."""
    print(f"{'model':<9} {'record off ms':>14} {'record on ms':>13} {'ratio':>7} "
          f"{'noise off':>10} {'noise on':>9}")
    for model_name in args.models:
        times = {False: [], True: []}
        medians = {False: [], True: []}
        for _ in range(args.rounds):
            for record in (False, True):
                ranks = run(model_name, "meshrun", args.steps, args.warmup, record=record)
                times[record] += ranks[0]["times"]
                medians[record].append(statistics.median(ranks[0]["times"]))
        ms = {r: 1000 * statistics.median(times[r]) for r in times}
        noise = {r: max(medians[r]) / min(medians[r]) - 1 for r in medians}
        print(f"{model_name:<9} {ms[False]:>14.1f} {ms[True]:>13.1f} "
              f"{ms[True] / ms[False]:>6.3f}x {100 * noise[False]:>9.1f}% "
              f"{100 * noise[True]:>8.1f}%", flush=True)


def hook_table(args):
    """Per model and hook: ms/step and all_reduce bytes/step, torch and meshrun alternating."""
    print(f"{'model':<9} {'hook':<9} {'torch ms':>9} {'meshrun ms':>11} {'ratio':>7} "
          f"{'torch MB/step':>14} {'meshrun MB/step':>16} {'ratio':>7}")
    for model_name in args.models:
        for hook in args.hooks:
            times = {m: [] for m in MODES}
            sent = {m: 0.0 for m in MODES}
            for _ in range(args.rounds):
                for mode in MODES:
                    ranks = run(model_name, mode, args.steps, args.warmup, hook, args.rank)
                    times[mode] += ranks[0]["times"]
                    sent[mode] = ranks[0]["bytes"] / 1e6
            ms = {m: 1000 * statistics.median(times[m]) for m in MODES}
            label = "bf16 (1)" if hook == "bf16" else hook
            print(f"{model_name:<9} {label:<9} {ms['torch']:>9.1f} {ms['meshrun']:>11.1f} "
                  f"{ms['meshrun'] / ms['torch']:>6.3f}x {sent['torch']:>14.3f} "
                  f"{sent['meshrun']:>16.3f} {sent['meshrun'] / sent['torch']:>6.3f}x",
                  flush=True)


def main():
    p = argparse.ArgumentParser(description="meshrun ddp vs torch DDP (2 ranks, gloo)")
    p.add_argument("--steps", type=int, default=30, help="timed steps per run")
    p.add_argument("--warmup", type=int, default=10)
    p.add_argument("--rounds", type=int, default=2, help="runs per mode, alternating")
    p.add_argument("--models", nargs="+", choices=list(MODELS), default=list(MODELS))
    p.add_argument("--hooks", nargs="+", choices=HOOKS, default=None,
                   help="instead: the communication hook table, these hooks")
    p.add_argument("--rank", type=int, default=4, help="with --hooks: PowerSGD's "
                   "matrix_approximation_rank")
    p.add_argument("--record", action="store_true",
                   help="instead: meshrun ddp with the collective record off vs on")
    p.add_argument("--desync", action="store_true",
                   help="instead: the cost of torch's DETAIL fingerprint check")
    args = p.parse_args()
    os.environ["OMP_NUM_THREADS"] = "1"
    if args.desync:
        began = print_start()
        desync_table(args)
        print_end(began)
        return
    if args.record:
        began = print_start()
        record_table(args)
        print_end(began)
        return
    if args.hooks:
        began = print_start()
        hook_table(args)
        if "bf16" in args.hooks:
            print("(1) torch's bf16_compress_hook needs NCCL or XCCL; on gloo its "
                  "fp16_compress_hook (the same bytes and casts) is the torch column")
        print_end(began)
        return

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
