"""meshrun pipeline schedules vs torch.distributed.pipelining's schedules of the same name.

    .venv/bin/python benchmarks/pp.py [--steps 10] [--warmup 3] [--rounds 2]

Same model, same split, same data, 2 ranks on gloo (CPU, one thread per rank), for GPipe,
1F1B (2 stages) and interleaved 1F1B (4 stages, 2 per rank), m = 4 microbatches. The model
is balanced: an input projection, 8 equal residual MLP blocks, an output projection; stage s
gets blocks [k s, k (s+1)) with the projections on the first and last stage.

Every (schedule, library) run is a fresh pair of processes, so its peak RSS is its own; the
libraries alternate (torch, meshrun, torch, ...) for ``--rounds`` rounds so drift on a shared
machine hits both. Per step, after a barrier, each rank times ``schedule.step`` (ms/step is the
median over rounds and timed steps of the slower rank) and the time its stages compute:
forward and backward of each stage module are timed from inside (a wrapper module and two
identity autograd functions at its input and output), identically for both libraries.
Measured bubble = ``1 - sum_r busy_r / (p * step time)`` (median over steps), next to the
formula ``(p - 1)/(v m + p - 1)``; the difference is communication, Python overhead and load.
"""

import argparse
import json
import os
import resource
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn

REPO = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(REPO)]
from _common import free_port  # noqa: E402 - beside this file

LIBS = ("torch", "meshrun")
SCHEDULES = {"GPipe": (1, "ScheduleGPipe"), "1F1B": (1, "Schedule1F1B"),
             "Interleaved1F1B": (2, "ScheduleInterleaved1F1B")}
WIDTH, N_BLOCKS, BATCH, N_MICRO, P = 1024, 8, 256, 4, 2


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(WIDTH, WIDTH)

    def forward(self, x):
        return x + torch.relu(self.fc(x))


class _BackwardStarts(torch.autograd.Function):
    """Identity at a stage's output; its backward is the first of the stage's backward."""

    @staticmethod
    def forward(ctx, x, clock):
        ctx.clock = clock
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        ctx.clock.backward_start.append(time.perf_counter())
        return grad, None


class _BackwardEnds(torch.autograd.Function):
    """Identity at a stage's input; its backward is the last of the stage's backward."""

    @staticmethod
    def forward(ctx, x, anchor, clock):
        ctx.clock = clock
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        ctx.clock.backward_end.append(time.perf_counter())
        return (grad if ctx.needs_input_grad[0] else None), torch.zeros(()), None


class Clock:
    def __init__(self):
        self.forward_time, self.backward_start, self.backward_end = 0.0, [], []

    def busy(self):
        return self.forward_time + sum(self.backward_end) - sum(self.backward_start)

    def reset(self):
        self.__init__()


class Timed(nn.Module):
    """Runs ``inner`` and records its forward and backward compute time in ``clock``."""

    def __init__(self, inner, clock):
        super().__init__()
        self.inner, self.clock = inner, clock
        self.anchor = torch.zeros((), requires_grad=True)  # makes the stage-0 input "need" grad

    def forward(self, x):
        t0 = time.perf_counter()
        x = _BackwardEnds.apply(x, self.anchor, self.clock)
        y = _BackwardStarts.apply(self.inner(x), self.clock)
        self.clock.forward_time += time.perf_counter() - t0
        return y


def stage_modules(n_stages):
    torch.manual_seed(0)
    blocks = [Block() for _ in range(N_BLOCKS)]
    per = N_BLOCKS // n_stages
    modules = []
    for s in range(n_stages):
        layers = blocks[s * per:(s + 1) * per]
        if s == 0:
            layers = [nn.Linear(256, WIDTH)] + layers
        if s == n_stages - 1:
            layers = layers + [nn.Linear(WIDTH, 16)]
        modules.append(nn.Sequential(*layers))
    return modules


def loss_fn(out, y):
    return ((out - y) ** 2).mean()


def build(lib, name, rank, clock):
    v, cls_name = SCHEDULES[name]
    n_stages = P * v
    modules = stage_modules(n_stages)
    mine = [s for s in range(rank, n_stages, P)]
    if lib == "torch":
        from torch.distributed import pipelining as pl

        mb = BATCH // N_MICRO
        stages = []
        for s in mine:
            example = torch.empty(mb, 256 if s == 0 else WIDTH)
            stages.append(pl.PipelineStage(Timed(modules[s], clock), s, n_stages,
                                           torch.device("cpu"), input_args=(example,)))
        cls = getattr(pl, cls_name)
    else:
        import meshrun.parallel.pipelining as mp_pipeline

        stages = [mp_pipeline.PipelineStage(Timed(modules[s], clock), s, n_stages)
                  for s in mine]
        cls = getattr(mp_pipeline, cls_name)
    params = [p for s in mine for p in modules[s].parameters()]
    if v == 1:
        return cls(stages[0], N_MICRO, loss_fn=loss_fn), params
    return cls(stages, N_MICRO, loss_fn=loss_fn), params


def worker(rank, lib, name, port, steps, warmup, out_dir):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      LOCAL_RANK=str(rank), WORLD_SIZE=str(P))
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    clock = Clock()
    schedule, params = build(lib, name, rank, clock)
    opt = torch.optim.SGD(params, lr=1e-4)
    g = torch.Generator().manual_seed(0)
    times, busy = [], []
    for _ in range(warmup + steps):
        x, y = torch.randn(BATCH, 256, generator=g), torch.randn(BATCH, 16, generator=g)
        dist.barrier()
        clock.reset()
        t0 = time.perf_counter()
        opt.zero_grad(set_to_none=True)
        schedule.step(x, target=y)
        opt.step()
        times.append(time.perf_counter() - t0)
        busy.append(clock.busy())
    rss_mib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    Path(out_dir, f"rank{rank}.json").write_text(json.dumps(
        {"times": times[warmup:], "busy": busy[warmup:], "rss_mib": rss_mib}))
    dist.destroy_process_group()



def run(lib, name, steps, warmup):
    with tempfile.TemporaryDirectory() as out:
        mp.spawn(worker, args=(lib, name, free_port(), steps, warmup, out), nprocs=P)
        return [json.loads(Path(out, f"rank{r}.json").read_text()) for r in range(P)]


def main():
    p = argparse.ArgumentParser(description="meshrun pipeline vs torch.distributed.pipelining")
    p.add_argument("--steps", type=int, default=10, help="timed steps per run")
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--rounds", type=int, default=2, help="runs per library, alternating")
    p.add_argument("--schedules", nargs="+", choices=list(SCHEDULES), default=list(SCHEDULES))
    args = p.parse_args()
    os.environ["OMP_NUM_THREADS"] = "1"
    print(f"2 ranks, gloo, m={N_MICRO} microbatches of {BATCH // N_MICRO} x 256 -> "
          f"{N_BLOCKS} blocks of {WIDTH} -> 16; load average {os.getloadavg()[0]:.1f}\n")
    print("| schedule | library | ms/step | peak RSS MiB | bubble measured | bubble formula |")
    print("|---|---|---:|---:|---:|---:|")
    for name in args.schedules:
        v = SCHEDULES[name][0]
        times = {lib: [] for lib in LIBS}
        bubbles = {lib: [] for lib in LIBS}
        rss = {lib: 0.0 for lib in LIBS}
        for _ in range(args.rounds):
            for lib in LIBS:
                ranks = run(lib, name, args.steps, args.warmup)
                for i in range(args.steps):
                    step = max(r["times"][i] for r in ranks)
                    times[lib].append(step)
                    bubbles[lib].append(1 - sum(r["busy"][i] for r in ranks) / (P * step))
                rss[lib] = max(rss[lib], *(r["rss_mib"] for r in ranks))
        formula = (P - 1) / (v * N_MICRO + P - 1)
        ms = {lib: 1000 * statistics.median(times[lib]) for lib in LIBS}
        for lib in LIBS:
            print(f"| {name} | {lib} | {ms[lib]:.1f} | {rss[lib]:.0f} | "
                  f"{statistics.median(bubbles[lib]):.3f} | {formula:.3f} |")
        print(f"| {name} | ratio meshrun/torch | {ms['meshrun'] / ms['torch']:.3f}x | "
              f"{rss['meshrun'] / rss['torch']:.3f}x | | |")


if __name__ == "__main__":
    main()
