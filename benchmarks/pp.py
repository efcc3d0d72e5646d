"""meshrun pipeline schedules vs torch.distributed.pipelining's schedules of the same name.

    .venv/bin/python benchmarks/pp.py [--steps 10] [--warmup 3] [--rounds 2]
                                      [--width 512] [--blocks 16] [--batch 1024]

Same model, same split, same data, 2 ranks on gloo (CPU, one thread per rank), for GPipe,
1F1B (2 stages) and interleaved 1F1B (4 stages, 2 per rank), m = 4 microbatches, and the
zero-bubble schedules (backward split into B, the input gradient, and W, the weight
gradient): ZB-H1 (2 stages) against torch's ``ScheduleInterleavedZeroBubble`` with one stage
per rank (torch has no class named ZB-H1; with one stage per rank its action lists are
ZB-H1's, which the benchmark checks), and ZB-V (4 stages in a V) against torch's
``ScheduleZBVZeroBubble`` (same action lists, also checked). The model
is balanced: ``--blocks`` equal residual MLP blocks of ``--width`` and nothing else (input
and target are as wide, the loss is a mean squared error), so stage s of S holds blocks
[n s / S, n (s + 1) / S) and every stage costs the same, as the formulas assume.

Every (schedule, library) run is a fresh pair of processes, so its peak RSS is its own; the
libraries alternate (torch, meshrun, torch, ...) for ``--rounds`` rounds so drift on a shared
machine hits both. Per step, after a barrier, each rank times ``schedule.step`` and
``opt.step()`` (ms/step: median over rounds and timed steps of the slower rank) and every
forward and backward of its stage modules, timed from inside (a wrapper module and two
identity autograd functions at its input and output), identically for both libraries. The
k-th forward (backward) of a stage in a step is microbatch k's: both libraries run a stage's
microbatches in order. A split backward does not pass through those identities in two clean
pieces (stage 0's B computes nothing and its W is the whole backward), so for the
zero-bubble schedules B and W are timed around each library's own B and W call (torch:
``stage.backward_one_chunk(full_backward=False)`` and ``stage.backward_weight_one_chunk``;
meshrun: the runtime's B and W actions, which also issue the gradient's isend).

Two bubbles, medians over steps, both from those compute times (busy_r: rank r's total):

- ``bubble wall`` = ``1 - sum_r busy_r / (p * T)``, T the slower rank's ``schedule.step`` time
  (the optimizer step is not part of the pipeline). Everything that is not stage compute
  counts as bubble: idle time the schedule implies, but also each message's latency, Python
  and autograd glue between stage calls, the loss, and load from other processes.
- ``bubble sched`` = ``simulate(order, cost=measured)``: the same step replayed by
  `meshrun.parallel.pipelining.simulate` with each action costing what it measured in this
  step and communication free, on the action lists of the schedule (torch runs the same
  ones: GPipe and interleaved 1F1B have identical ``pipeline_order`` tables; torch's 1F1B
  runs the standard warm-up / 1F1B / cool-down). This is the bubble of the schedule itself,
  including any imbalance between stages and between F and B; it is what the formula
  ``(p - 1)/(v m + p - 1)`` predicts for equal stage costs. For ZB-H1 and ZB-V the formula
  column is `zero_bubble_formula` at this run's mean F, B and W over all ranks (ZB-H1: idle
  ``(p-1) max(F, B, F+B-W)`` against work ``m(F+B+W)``, the paper's ``(p-1)(F+B-W)`` where W
  is the cheapest, and here W costs about 1.1 F; ZB-V: idle ``(p-1) max(F, B)`` against
  ``2m(F+B+W)`` in chunk costs, the V's forced waits on rank p - 1, which the paper's F = B =
  W case leaves at ``(p-1)F``). Stage 0's B is empty (nothing needs its
  input's gradient) and its W is its whole backward, so its backward is counted as B = W
  (which leaves the timeline as it is: the schedules put stage 0's W right after its B).
  ``sched / formula`` then says how far the timeline under real, unequal costs is from the
  analysis. Actions of equal size still vary from call to call here (two ranks share the
  memory system of a 2-core VM), and a varying cost on the critical path lengthens it, so
  this bubble sits a little above the formula even for a balanced model.

The model is balanced in blocks, not in work: stage 0 computes no input gradient (its first
block's dX is never needed) and the last stage adds the loss, so with the backward split the
ranks' totals differ by 5-7 % (medians, CPU clock: ZB-H1 rank 0 31.7 ms per microbatch, rank
1 33.6 ms). ``bubble sched`` counts the lighter rank's idle time, which no order can remove,
and the formula at the mean costs does not, so their ratio (1.3-1.7) measures the imbalance,
not the schedule. (Which rank is the heavier one varies from run to run, and the heavier
rank's own idle fraction is not the formula's either: in ZB-V, rank p - 1 takes the forced
waits, and a heavier rank 0 idles less.) The comparison for the schedule is therefore
``balanced sched`` / ``balanced formula`` (`balanced_bubble`): the step replayed with each
action at the mean cost of its kind and microbatch over the stages, so every stage costs the
same while F, B and W keep their measured ratios and microbatches their own costs, against
the formula at that step's mean F, B and W; the ratio row gives their per-step ratio
(median). The ``typical step`` row (`typical_bubble`) replays one step at the median cost of
each (kind, microbatch) over every step of the runs, against the formula at those costs:
one step's replay also carries that step's call-to-call variation (a slow call on the
critical path lengthens it, and the formula at mean costs cannot see it), which the median
step drops, so its ratio is the order's alone.

``--clock cpu`` times each action with ``time.thread_time`` (the CPU time of the rank's main
thread, where both libraries compute) instead of the wall clock: on a machine loaded by other
jobs a rank waits for a core in the middle of an action, which the wall clock counts as the
action's cost and the replay then puts on the critical path; the CPU clock leaves that out, so
``bubble sched`` is the schedule's bubble for the work itself. ``bubble wall`` then mixes
the two clocks and is not printed.

``CPU ms/step``: the process CPU time of a step (every thread of the rank: compute, gloo's
I/O threads, Python), median over steps of the larger rank. Unlike wall time it does not
count waiting for a core, so on a loaded machine it still compares the work each library
does per step (it does not see the bubble: an idle rank uses no CPU).

``overhead`` = T minus the simulated makespan: ms per step on the critical path that is not
stage compute (the two bubbles share busy_r, so ``bubble wall = 1 - (1 - bubble sched) *
makespan / T`` exactly). On 2 CPU cores shared by 2 compute threads and 2 gloo I/O threads, a
message costs about 0.05 ms when the receiver posted its buffer before the sender sent, but a
gloo call or transfer that needs a thread which is not on a core can wait for a scheduler
slice (milliseconds). The defaults make a stage's compute large against its messages (16
blocks of 512 and microbatches of 256 rows: with 2 stages, 8 blocks per 0.5 MB message), as on
real hardware, where a transfer costs far less than a stage; with less compute per message
(``--width 1024 --blocks 8 --batch 256``, 4 blocks per 0.25 MB message) the per-message
costs show as more overhead. Run it on a quiet machine: other load counts as overhead too.
"""

import argparse
import os
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

REPO = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(REPO)]
from _common import report_rank, spawn_ranks  # noqa: E402 - beside this file

LIBS = ("torch", "meshrun")
action_clock = time.perf_counter  # what times each action; --clock cpu: time.thread_time
SCHEDULES = {"GPipe": (1, "ScheduleGPipe"), "1F1B": (1, "Schedule1F1B"),
             "Interleaved1F1B": (2, "ScheduleInterleaved1F1B"),
             "ZBH1": (1, "ScheduleZBH1"), "ZBV": (2, "ScheduleZBV")}
TORCH_NAMES = {"ZBH1": "ScheduleInterleavedZeroBubble", "ZBV": "ScheduleZBVZeroBubble"}
SPLIT = ("ZBH1", "ZBV")  # schedules with B and W as separate actions
N_MICRO, P = 4, 2


@dataclass(frozen=True)
class Shape:
    """The benchmark model and batch: ``blocks`` residual blocks of ``width``; ``batch`` rows."""

    width: int = 512
    blocks: int = 16
    batch: int = 1024


class Block(nn.Module):
    def __init__(self, width):
        super().__init__()
        self.fc = nn.Linear(width, width)

    def forward(self, x):
        return x + torch.relu(self.fc(x))


class _BackwardStarts(torch.autograd.Function):
    """Identity at a stage's output; its backward is the first of the stage's backward."""

    @staticmethod
    def forward(ctx, x, clock, stage, copy):
        ctx.clock, ctx.stage = clock, stage
        return x.clone() if copy else x.view_as(x)  # torch's split B detach_()es: no view

    @staticmethod
    def backward(ctx, grad):
        ctx.clock.backward_start.setdefault(ctx.stage, []).append(action_clock())
        return grad, None, None, None


class _BackwardEnds(torch.autograd.Function):
    """Identity at a stage's input; its backward is the last of the stage's backward."""

    @staticmethod
    def forward(ctx, x, anchor, clock, stage):
        ctx.clock, ctx.stage = clock, stage
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        ctx.clock.backward_end.setdefault(ctx.stage, []).append(action_clock())
        return (grad if ctx.needs_input_grad[0] else None), torch.zeros(()), None, None


class Clock:
    """Per stage, this step's forward durations and backward start/end times, in call order."""

    def __init__(self):
        self.forward, self.backward_start, self.backward_end = {}, {}, {}
        self.split = None  # zero-bubble schedules: [(stage, "B" or "W", microbatch, seconds)]

    def costs(self):
        """[(stage, "F"/"B"/"W", microbatch, seconds)]: the k-th call of a stage is microbatch k."""
        out = [(s, "F", k, d) for s, ds in self.forward.items() for k, d in enumerate(ds)]
        if self.split is not None:
            return out + self.split
        for s, starts in self.backward_start.items():
            ends = self.backward_end.get(s, [])
            out += [(s, "B", k, e - b) for k, (b, e) in enumerate(zip(starts, ends, strict=True))]
        return out

    def busy(self):
        return sum(c[3] for c in self.costs())

    def reset(self):
        split = self.split is not None
        self.__init__()
        if split:
            self.split = []

    def timed(self, kind, stage, microbatch, fn, *args, **kwargs):
        t0 = action_clock()
        out = fn(*args, **kwargs)
        self.split.append((stage, kind, microbatch, action_clock() - t0))
        return out


def time_split_actions(lib, stages, clock):
    """Time each B and W around the library's own call (see the module docstring)."""
    clock.split = []
    if lib == "torch":
        for st in stages:
            bwd, wgt, s = st.backward_one_chunk, st.backward_weight_one_chunk, st.stage_index
            st.backward_one_chunk = (lambda i, *a, bwd=bwd, s=s, **k:
                                     clock.timed("B", s, i, bwd, i, *a, **k))
            st.backward_weight_one_chunk = (lambda i, *a, wgt=wgt, s=s, **k:
                                            clock.timed("W", s, i, wgt, i, *a, **k))
        return
    from meshrun.parallel.pipelining import runtime

    for name, kind in (("_backward", "B"), ("_weight", "W")):
        method = getattr(runtime._Step, name)
        setattr(runtime._Step, name, lambda self, action, *a, method=method, kind=kind:
                clock.timed(kind, action.stage, action.microbatch, method, self, action, *a))


class Timed(nn.Module):
    """Runs ``inner`` (stage ``stage``) and records its forward and backward times in ``clock``."""

    def __init__(self, inner, clock, stage, copy=False):
        super().__init__()
        self.inner, self.clock, self.stage, self.copy = inner, clock, stage, copy
        self.anchor = torch.zeros((), requires_grad=True)  # makes the stage-0 input "need" grad

    def forward(self, x):
        t0 = action_clock()
        x = _BackwardEnds.apply(x, self.anchor, self.clock, self.stage)
        y = _BackwardStarts.apply(self.inner(x), self.clock, self.stage, self.copy)
        self.clock.forward.setdefault(self.stage, []).append(action_clock() - t0)
        return y


def stage_modules(shape, n_stages):
    torch.manual_seed(0)
    blocks = [Block(shape.width) for _ in range(shape.blocks)]
    per = shape.blocks // n_stages
    return [nn.Sequential(*blocks[s * per:(s + 1) * per]) for s in range(n_stages)]


def loss_fn(out, y):
    return ((out - y) ** 2).mean()


def build(lib, name, rank, clock, shape):
    v, cls_name = SCHEDULES[name]
    n_stages = P * v
    modules = stage_modules(shape, n_stages)
    mine = [rank, n_stages - 1 - rank] if name == "ZBV" else list(range(rank, n_stages, P))
    if lib == "torch":
        from torch.distributed import pipelining as pl

        mb = shape.batch // N_MICRO
        stages = []
        for s in mine:
            example = torch.empty(mb, shape.width)
            stages.append(pl.PipelineStage(Timed(modules[s], clock, s, name in SPLIT), s, n_stages,
                                           torch.device("cpu"), input_args=(example,)))
        cls = getattr(pl, TORCH_NAMES.get(name, cls_name))
    else:
        import meshrun.parallel.pipelining as mp_pipeline

        placement = "v" if name == "ZBV" else "loop"
        stages = [mp_pipeline.PipelineStage(Timed(modules[s], clock, s, name in SPLIT), s,
                                            n_stages, placement=placement) for s in mine]
        cls = getattr(mp_pipeline, cls_name)
    params = [p for s in mine for p in modules[s].parameters()]
    if name in SPLIT:
        time_split_actions(lib, stages, clock)
    if v == 1 and not (lib == "torch" and name in TORCH_NAMES):
        schedule = cls(stages[0], N_MICRO, loss_fn=loss_fn)
    else:
        schedule = cls(stages, N_MICRO, loss_fn=loss_fn)
    if lib == "torch" and name in SPLIT:
        check_same_order(name, schedule.pipeline_order)
    return schedule, params


def check_same_order(name, torch_order):
    """torch's compute actions (I written B) must be the lists meshrun's schedule runs."""
    order, _ = order_of(name)
    for r, actions in torch_order.items():
        theirs = [str(a).replace("I", "B") for a in actions if a is not None]
        mine = [str(a) for a in order[r]]
        if theirs != mine:
            raise RuntimeError(f"{name}: torch's rank {r} runs {theirs}, meshrun's {mine}")


def check_ran_order(name, rank, ran):
    """The actions meshrun's runtime ran this step must be the lists the replay uses
    (`order_of`): the bubble is replayed on the order that ran, not only on the intended one."""
    order, _ = order_of(name)
    if [str(a) for a in ran] != [str(a) for a in order[rank]]:
        raise RuntimeError(f"{name}: meshrun's rank {rank} ran {[str(a) for a in ran]}, the "
                           f"replay's order is {[str(a) for a in order[rank]]}")


def worker(rank, lib, name, port, steps, warmup, out_dir, shape, clock="wall"):
    global action_clock
    action_clock = time.thread_time if clock == "cpu" else time.perf_counter
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      LOCAL_RANK=str(rank), WORLD_SIZE=str(P))
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    clock = Clock()
    schedule, params = build(lib, name, rank, clock, shape)
    opt = torch.optim.SGD(params, lr=1e-4)
    g = torch.Generator().manual_seed(0)
    times, pipe, costs, cpu = [], [], [], []
    for _ in range(warmup + steps):
        x = torch.randn(shape.batch, shape.width, generator=g)
        y = torch.randn(shape.batch, shape.width, generator=g)
        dist.barrier()
        clock.reset()
        c0 = time.process_time()
        t0 = time.perf_counter()
        opt.zero_grad(set_to_none=True)
        schedule.step(x, target=y)
        t1 = time.perf_counter()
        opt.step()
        times.append(time.perf_counter() - t0)
        cpu.append(time.process_time() - c0)
        if lib == "meshrun":  # (outside the timed part)
            check_ran_order(name, rank, schedule.last_actions)
        pipe.append(t1 - t0)
        costs.append(clock.costs())
    report_rank(out_dir, rank, {"times": times[warmup:], "pipe": pipe[warmup:],
                                "costs": costs[warmup:], "cpu": cpu[warmup:]})
    dist.destroy_process_group()



def run(lib, name, steps, warmup, shape, clock="wall"):
    return spawn_ranks(P, worker, lambda port, out: (lib, name, port, steps, warmup, out, shape,
                                                     clock))


def order_of(name):
    from meshrun.parallel.pipelining import (
        gpipe_order,
        interleaved_1f1b_order,
        one_f_one_b_order,
        zb_h1_order,
        zbv_order,
    )

    v = SCHEDULES[name][0]
    if name == "GPipe":
        return gpipe_order(P, N_MICRO), P
    if name == "1F1B":
        return one_f_one_b_order(P, N_MICRO), P
    if name == "ZBH1":
        return zb_h1_order(P, N_MICRO), P
    if name == "ZBV":
        return zbv_order(P, N_MICRO), 2 * P
    return interleaved_1f1b_order(P, N_MICRO, v), P * v


def mean_costs(steps):
    """Mean F, B and W (seconds) of the stage calls in ``steps`` (a list, per step, of
    ``(stage, kind, microbatch, seconds)``). Stage 0's B is empty (nothing needs its input's
    gradient) and its W is its whole backward; that backward is counted half as B and half as
    W, which leaves the timeline as it is (the schedules put stage 0's W right after its B)."""
    costs = {kind: [] for kind in "FBW"}
    backward = {}  # (step, microbatch) -> stage 0's B + W
    for i, calls in enumerate(steps):
        for s, kind, m, d in calls:
            if s == 0 and kind != "F":
                backward[i, m] = backward.get((i, m), 0.0) + d
            else:
                costs[kind].append(d)
    for d in backward.values():
        costs["B"].append(d / 2)
        costs["W"].append(d / 2)
    return {kind: statistics.mean(values) for kind, values in costs.items()}


def formula_bubble(name, ranks, steps):
    """The formula's bubble; for ZB-H1 and ZB-V at this run's mean F, B and W (`mean_costs`
    over all ranks and steps)."""
    from meshrun.parallel.pipelining import bubble_formula, zero_bubble_formula

    v = SCHEDULES[name][0]
    if name not in SPLIT:
        return bubble_formula(P, N_MICRO, v)
    mean = mean_costs([c for r in ranks for c in r["costs"][:steps]])
    return zero_bubble_formula(name.lower(), P, N_MICRO, forward=mean["F"],
                               backward_input=mean["B"], weight=mean["W"])


def balanced_costs(name, ranks, i):
    """Step i's cost of each (kind, microbatch), the mean over the stages (stage 0's backward
    counted as B = W, as in `mean_costs`)."""
    per_call = {}  # (kind, microbatch) -> its costs over the stages
    backward = {}  # microbatch -> stage 0's B + W
    for r in ranks:
        for s, kind, m, d in r["costs"][i]:
            if name in SPLIT and s == 0 and kind != "F":
                backward[m] = backward.get(m, 0.0) + d
            else:
                per_call.setdefault((kind, m), []).append(d)
    for m, d in backward.items():
        per_call.setdefault(("B", m), []).append(d / 2)
        per_call.setdefault(("W", m), []).append(d / 2)
    return {key: statistics.mean(values) for key, values in per_call.items()}


def replay_balanced(name, cost):
    """(replayed bubble, formula bubble) with every action of a (kind, microbatch) costing
    ``cost[(kind, microbatch)]`` on every stage: the formula is `bubble_formula` or
    `zero_bubble_formula` at the mean F, B and W of ``cost``."""
    from meshrun.parallel.pipelining import bubble_formula, simulate, zero_bubble_formula

    order, n_stages = order_of(name)
    sim = simulate(order, n_stages, cost=lambda a: cost[(a.kind, a.microbatch)])
    if name not in SPLIT:
        return sim.bubble_fraction, bubble_formula(P, N_MICRO, SCHEDULES[name][0])
    kinds = {kind: statistics.mean(d for (k, _), d in cost.items() if k == kind)
             for kind in "FBW"}
    return sim.bubble_fraction, zero_bubble_formula(
        name.lower(), P, N_MICRO, forward=kinds["F"], backward_input=kinds["B"],
        weight=kinds["W"])


def balanced_bubble(name, ranks, i):
    """(replayed bubble, formula bubble) of step i with the stages' imbalance taken out.

    Each action is replayed at the mean cost of its (kind, microbatch) over all stages
    (`balanced_costs`), so every stage costs the same, as the formulas assume, while F, B and
    W keep their measured ratios and each microbatch its own cost. The formula is then
    `bubble_formula` or `zero_bubble_formula` at the step's mean F, B and W: their ratio is
    the schedule's order against the analysis at these costs."""
    return replay_balanced(name, balanced_costs(name, ranks, i))


def typical_bubble(name, runs, steps):
    """(replayed bubble, formula bubble) of the typical step of ``runs`` (each a list of the
    ranks' results over ``steps`` steps): each (kind, microbatch) at the median over all
    steps of its `balanced_costs`. One step's replay also carries that step's call-to-call
    variation (a slow call on the critical path lengthens it, which a formula at mean costs
    cannot see); the median step keeps each microbatch's typical cost and drops that
    noise, so its ratio to the formula is the schedule's order alone."""
    per_step = [balanced_costs(name, ranks, i) for ranks in runs for i in range(steps)]
    cost = {key: statistics.median(c[key] for c in per_step) for key in per_step[0]}
    return replay_balanced(name, cost)


def schedule_bubble(name, ranks, i):
    """(bubble, makespan) of step i replayed by `simulate` with its measured costs."""
    from meshrun.parallel.pipelining import simulate

    order, n_stages = order_of(name)
    cost = {(s, kind, m): d for r in ranks for s, kind, m, d in r["costs"][i]}
    expected = {(a.stage, a.kind, a.microbatch) for actions in order.values() for a in actions}
    if set(cost) != expected:
        raise RuntimeError(f"{name}: step {i} timed {len(cost)} stage calls, expected "
                           f"{len(expected)} (one forward and one backward, and W where "
                           f"split, per stage and microbatch)")
    sim = simulate(order, n_stages, cost=lambda a: cost[(a.stage, a.kind, a.microbatch)])
    return sim.bubble_fraction, sim.makespan


def main():
    p = argparse.ArgumentParser(description="meshrun pipeline vs torch.distributed.pipelining")
    p.add_argument("--steps", type=int, default=10, help="timed steps per run")
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--rounds", type=int, default=2, help="runs per library, alternating")
    p.add_argument("--schedules", nargs="+", choices=list(SCHEDULES), default=list(SCHEDULES))
    p.add_argument("--clock", choices=("wall", "cpu"), default="wall",
                   help="what times each action for the replay (cpu: on a loaded machine)")
    default = Shape()
    p.add_argument("--width", type=int, default=default.width,
                   help=f"width of each block (default {default.width})")
    p.add_argument("--blocks", type=int, default=default.blocks,
                   help=f"number of equal blocks, a multiple of 4 (default {default.blocks})")
    p.add_argument("--batch", type=int, default=default.batch,
                   help=f"batch size, split into {N_MICRO} microbatches (default {default.batch})")
    args = p.parse_args()
    if args.blocks % 4 or args.batch % N_MICRO:
        p.error(f"--blocks must be a multiple of 4 (the interleaved run has 4 stages) and "
                f"--batch a multiple of {N_MICRO} (got --blocks {args.blocks}, --batch {args.batch})")
    shape = Shape(args.width, args.blocks, args.batch)
    os.environ["OMP_NUM_THREADS"] = "1"
    print(f"2 ranks, gloo, m={N_MICRO} microbatches of {shape.batch // N_MICRO} x {shape.width}, "
          f"{shape.blocks} equal blocks of {shape.width}; action clock {args.clock}; "
          f"load average {os.getloadavg()[0]:.1f}\n")
    print("| schedule | library | ms/step | CPU ms/step | peak RSS MiB | bubble wall | "
          "bubble sched | bubble formula | balanced sched | balanced formula | overhead ms/step |")
    print("|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for name in args.schedules:
        times = {lib: [] for lib in LIBS}
        cpus = {lib: [] for lib in LIBS}
        walls = {lib: [] for lib in LIBS}
        scheds = {lib: [] for lib in LIBS}
        overheads = {lib: [] for lib in LIBS}
        balanced = {lib: [] for lib in LIBS}  # the stage-balanced replay's bubble, per step
        balanced_formulas = {lib: [] for lib in LIBS}  # the formula at that step's costs
        rss = {lib: 0.0 for lib in LIBS}
        formulas = []
        runs = {lib: [] for lib in LIBS}  # every run's ranks, for the typical step
        for _ in range(args.rounds):
            for lib in LIBS:
                ranks = run(lib, name, args.steps, args.warmup, shape, args.clock)
                runs[lib].append(ranks)
                for i in range(args.steps):
                    times[lib].append(max(r["times"][i] for r in ranks))
                    cpus[lib].append(max(r["cpu"][i] for r in ranks))
                    pipe = max(r["pipe"][i] for r in ranks)
                    busy = sum(c[3] for r in ranks for c in r["costs"][i])
                    walls[lib].append(1 - busy / (P * pipe))
                    bubble, makespan = schedule_bubble(name, ranks, i)
                    scheds[lib].append(bubble)
                    even, even_formula = balanced_bubble(name, ranks, i)
                    balanced[lib].append(even)
                    balanced_formulas[lib].append(even_formula)
                    overheads[lib].append(pipe - makespan)
                rss[lib] = max(rss[lib], *(r["rss_mib"] for r in ranks))
                formulas.append(formula_bubble(name, ranks, args.steps))
        formula = statistics.median(formulas)
        ms = {lib: 1000 * statistics.median(times[lib]) for lib in LIBS}
        cpu = {lib: 1000 * statistics.median(cpus[lib]) for lib in LIBS}
        for lib in LIBS:
            wall = f"{statistics.median(walls[lib]):.3f}" if args.clock == "wall" else "-"
            over = (f"{1000 * statistics.median(overheads[lib]):.1f}" if args.clock == "wall"
                    else "-")  # both need action costs on the wall clock
            print(f"| {name} | {lib} | {ms[lib]:.1f} | {cpu[lib]:.1f} | {rss[lib]:.0f} | "
                  f"{wall} | {statistics.median(scheds[lib]):.3f} | {formula:.3f} | "
                  f"{statistics.median(balanced[lib]):.3f} | "
                  f"{statistics.median(balanced_formulas[lib]):.3f} | {over} |")
        sched = {lib: statistics.median(scheds[lib]) for lib in LIBS}
        even = {lib: statistics.median(a / f for a, f in zip(
            balanced[lib], balanced_formulas[lib], strict=True)) for lib in LIBS}
        print(f"| {name} | ratio meshrun/torch | {ms['meshrun'] / ms['torch']:.3f}x | "
              f"{cpu['meshrun'] / cpu['torch']:.3f}x | {rss['meshrun'] / rss['torch']:.3f}x | | "
              f"{sched['meshrun'] / sched['torch']:.3f}x | sched/formula: "
              f"{sched['meshrun'] / formula:.2f} (torch {sched['torch'] / formula:.2f}) | | "
              f"sched/formula: {even['meshrun']:.2f} (torch {even['torch']:.2f}) | |")
        typical = {lib: typical_bubble(name, runs[lib], args.steps) for lib in LIBS}
        print(f"| {name} | typical step (median costs) | | | | | | | "
              f"{typical['meshrun'][0]:.3f} (torch {typical['torch'][0]:.3f}) | "
              f"{typical['meshrun'][1]:.3f} (torch {typical['torch'][1]:.3f}) | "
              f"sched/formula: {typical['meshrun'][0] / typical['meshrun'][1]:.2f} "
              f"(torch {typical['torch'][0] / typical['torch'][1]:.2f}) |")


if __name__ == "__main__":
    main()
