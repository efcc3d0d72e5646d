"""torch.compile per block under ddp, fully_shard, parallelize and in pipeline stages, against
eager (2 ranks).

The pattern (torchtitan's per-block compile): each block's ``forward`` is compiled with
``fullgraph=True``, so the strategy's module hooks (ddp's buffer broadcast, a unit's
all-gather and resharding) run eagerly around the compiled graph, and TP's collectives,
inside the block, are traced into it. ``backend="aot_eager"`` traces forward and backward
through AOTAutograd without inductor's code generation (a cold inductor compile costs many
seconds). The reference is the same strategy in eager mode, from the same weights and data:
losses, gradients and parameters every step, and one graph per block, compiled once.
"""

import copy

import torch
import torch.distributed as dist
from torch import nn
from torch._dynamo.utils import counters

from meshrun.parallel import ColwiseParallel, RowwiseParallel, ddp, fully_shard, parallelize
from meshrun.parallel.pipelining import (
    PipelineStage,
    Schedule1F1B,
    ScheduleZBH1,
    split_into_stages,
)
from tests.parallel.harness import run_checks

STEPS = 3


class Block(nn.Module):
    def __init__(self, width=8, hidden=16):
        super().__init__()
        self.ln = nn.LayerNorm(width)
        self.fc1 = nn.Linear(width, hidden)
        self.fc2 = nn.Linear(hidden, width)

    def forward(self, x):
        return x + self.fc2(torch.nn.functional.gelu(self.fc1(self.ln(x))))


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.blocks = nn.ModuleList([Block()])
        self.head = nn.Linear(8, 4)

    def forward(self, x):
        for block in self.blocks:
            x = block(x)
        return self.head(x)


def compile_blocks(model):
    for block in model.blocks:
        block.forward = torch.compile(block.forward, fullgraph=True, backend="aot_eager")


def parity(ctx, apply, per_rank_batch=True):
    """Eager vs per-block compiled, both under ``apply(model)``, SGD, every step."""
    torch._dynamo.reset()
    counters.clear()
    torch.manual_seed(0)
    eager = Net()
    compiled = copy.deepcopy(eager)
    apply(eager)
    apply(compiled)
    compile_blocks(compiled)
    opts = [torch.optim.SGD(m.parameters(), lr=0.1) for m in (eager, compiled)]
    for step in range(STEPS):
        g = torch.Generator().manual_seed(step)
        x, y = torch.randn(8, 3, 8, generator=g), torch.randn(8, 3, 4, generator=g)
        if per_rank_batch:  # data parallel: each rank its slice; TP: the same batch
            x, y = x[ctx.rank * 4:(ctx.rank + 1) * 4], y[ctx.rank * 4:(ctx.rank + 1) * 4]
        losses = []
        for model, opt in zip((eager, compiled), opts, strict=True):
            opt.zero_grad()
            loss = ((model(x) - y) ** 2).mean()
            loss.backward()
            losses.append(loss.detach())
        torch.testing.assert_close(losses[1], losses[0], rtol=1e-6, atol=1e-6)
        for (name, p), q in zip(compiled.named_parameters(), eager.parameters(), strict=True):
            torch.testing.assert_close(p.grad, q.grad, rtol=1e-5, atol=1e-6,
                                       msg=lambda m, n=name, s=step: f"step {s} grad {n}: {m}")
        for opt in opts:
            opt.step()
    for (name, p), q in zip(compiled.named_parameters(), eager.parameters(), strict=True):
        torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6, msg=lambda m, n=name: f"{n}: {m}")
    graphs = counters["stats"]["unique_graphs"]
    assert graphs == len(compiled.blocks), f"{graphs} graphs for {len(compiled.blocks)} blocks"
    return compiled


def check_compile_ddp(ctx):
    parity(ctx, ddp)


def check_compile_fully_shard(ctx):
    def shard(model):
        for block in model.blocks:
            fully_shard(block)
        fully_shard(model)

    parity(ctx, shard)


def check_compile_parallelize(ctx):
    plan = {"blocks.*.fc1": ColwiseParallel(), "blocks.*.fc2": RowwiseParallel()}
    model = parity(ctx, lambda m: parallelize(m, None, plan), per_rank_batch=False)
    assert model.blocks[0].fc1.weight.shape[0] == 16 // dist.get_world_size()


def pipeline_parity(ctx, schedule_cls):
    """Two stages of two blocks (rank r: stage r), 4 microbatches: eager vs per-block compiled
    schedules from the same weights; the loss (last stage), every local gradient and, after
    SGD, every local parameter, every step."""
    torch._dynamo.reset()
    counters.clear()
    torch.manual_seed(0)
    first, last = nn.Linear(4, 8), nn.Linear(8, 4)
    blocks = [Block() for _ in range(4)]
    eager_parts = nn.ModuleList([first, *blocks, last])
    compiled_parts = copy.deepcopy(eager_parts)
    schedules, stages = [], []
    for parts, compiled in ((eager_parts, False), (compiled_parts, True)):
        body = list(parts[1:-1])
        if compiled:
            for block in body:
                block.forward = torch.compile(block.forward, fullgraph=True, backend="aot_eager")
        module = split_into_stages(body, 2, first=parts[0], last=parts[-1])[ctx.rank]
        stages.append(module)
        schedules.append(schedule_cls(PipelineStage(module, ctx.rank, 2), 4,
                                      lambda out, y: ((out - y) ** 2).mean()))
    opts = [torch.optim.SGD(m.parameters(), lr=0.1) for m in stages]
    for step in range(STEPS):
        g = torch.Generator().manual_seed(step)
        x, y = torch.randn(8, 4, generator=g), torch.randn(8, 4, generator=g)
        losses = [[], []]
        for schedule, opt, out in zip(schedules, opts, losses, strict=True):
            opt.zero_grad()
            schedule.step(x, target=y, losses=out)
        if ctx.rank == 1:  # the last stage
            assert len(losses[1]) == 4, losses
            torch.testing.assert_close(torch.stack(losses[1]), torch.stack(losses[0]),
                                       rtol=1e-6, atol=1e-6)
        for (name, p), q in zip(stages[1].named_parameters(), stages[0].parameters(),
                                strict=True):
            torch.testing.assert_close(p.grad, q.grad, rtol=1e-5, atol=1e-6,
                                       msg=lambda m, n=name, s=step: f"step {s} grad {n}: {m}")
        for opt in opts:
            opt.step()
    for (name, p), q in zip(stages[1].named_parameters(), stages[0].parameters(), strict=True):
        torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6, msg=lambda m, n=name: f"{n}: {m}")
    graphs = counters["stats"]["unique_graphs"]
    assert 1 <= graphs <= 2 and not counters["graph_break"], \
        f"{graphs} graphs, breaks {dict(counters['graph_break'])} for 2 blocks of one class"


def check_compile_pipeline_1f1b(ctx):
    pipeline_parity(ctx, Schedule1F1B)


def check_compile_pipeline_zbh1(ctx):
    """Zero bubble: each block's backward split into B (input) and W (weights)."""
    pipeline_parity(ctx, ScheduleZBH1)


CHECKS = [check_compile_ddp, check_compile_fully_shard, check_compile_parallelize,
          check_compile_pipeline_1f1b, check_compile_pipeline_zbh1]


def main():
    run_checks(CHECKS)


if __name__ == "__main__":
    main()
