"""Pipeline checks on a 2-process gloo group (one launch for all of them).

Every rank builds the same full model (same seed) and a deep copy as the single-process
reference, trained on the whole batch with a mean-reduced loss. The pipeline ranks keep their
stages of the full model; after each step the loss (mean of the microbatch losses), every local
parameter's gradient and, after an SGD step, every local parameter must match the reference,
and the rank must have run exactly the action list the validator accepted.
"""

import copy

import torch
from torch import nn

from meshrun.parallel.pipelining import (
    PipelineSchedule,
    PipelineStage,
    Schedule1F1B,
    ScheduleGPipe,
    ScheduleInterleaved1F1B,
    ScheduleZBH1,
    ScheduleZBV,
    parse_order,
    split_into_stages,
)
from tests.parallel.harness import run_checks

STEPS = 2
BATCH = 8
DIM, IN, OUT = 16, 6, 3


class Block(nn.Module):
    def __init__(self, dim=DIM):
        super().__init__()
        self.fc = nn.Linear(dim, dim)

    def forward(self, x):
        return x + torch.tanh(self.fc(x))


def make_model(n_blocks):
    torch.manual_seed(0)
    first, last = nn.Linear(IN, DIM), nn.Linear(DIM, OUT)
    blocks = [Block() for _ in range(n_blocks)]
    return nn.Sequential(first, *blocks, last), first, blocks, last


def data(step, batch=BATCH):
    g = torch.Generator().manual_seed(100 + step)
    return torch.randn(batch, IN, generator=g), torch.randn(batch, OUT, generator=g)


def mse(out, y):
    return ((out - y) ** 2).mean()


def close(a, b, what):
    torch.testing.assert_close(a, b, msg=lambda m: f"{what}: {m}")


def local_params(schedule):
    return {id(p) for st in schedule.stages for p in st.submodule.parameters()}


def parity(schedule, full, ref, rank, steps=STEPS, batches=None, between=None):
    """Step the pipeline and the reference side by side; compare everything local.

    ``batches``: the batch size of each step (default BATCH for ``steps`` steps);
    ``between(step)``: called after each step (e.g. an eval with other shapes)."""
    mine = local_params(schedule)
    opt = torch.optim.SGD([p for p in full.parameters() if id(p) in mine], lr=0.1)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    holds_last = any(st.is_last for st in schedule.stages)
    for step, batch in enumerate(batches or [BATCH] * steps):
        x, y = data(step, batch)
        opt.zero_grad()
        losses = []
        out = schedule.step(x, target=y, losses=losses)
        ref_opt.zero_grad()
        ref_out = ref(x)
        ref_loss = mse(ref_out, y)
        ref_loss.backward()
        if schedule.last_actions != schedule.pipeline_order[rank]:
            raise AssertionError(f"rank {rank} ran {list(map(str, schedule.last_actions))}, "
                                 f"expected {list(map(str, schedule.pipeline_order[rank]))}")
        if holds_last:
            assert len(losses) == schedule.n_microbatches, losses
            close(torch.stack(losses).mean(), ref_loss.detach(), f"step {step} loss")
            close(out, ref_out.detach(), f"step {step} output")
        else:
            assert out is None and losses == [], (out, losses)
        for (name, p), (_, q) in zip(full.named_parameters(), ref.named_parameters(),
                                     strict=True):
            if id(p) not in mine:
                assert p.grad is None, f"{name} is not on this rank but got a gradient"
                continue
            close(p.grad, q.grad, f"step {step} grad {name}")
        opt.step()
        ref_opt.step()
        for (name, p), (_, q) in zip(full.named_parameters(), ref.named_parameters(),
                                     strict=True):
            if id(p) in mine:
                close(p.detach(), q.detach(), f"step {step} param {name}")
        if between is not None:
            between(step)


def build(n_stages, rank, world, schedule_cls, n_microbatches, n_blocks=4):
    full, first, blocks, last = make_model(n_blocks)
    ref = copy.deepcopy(full)
    modules = split_into_stages(blocks, n_stages, first=first, last=last)
    if schedule_cls is ScheduleZBV:  # the V: rank r holds stages r and 2p - 1 - r
        stages = [PipelineStage(modules[s], s, n_stages, placement="v")
                  for s in (rank, n_stages - 1 - rank)]
    else:
        stages = [PipelineStage(modules[s], s, n_stages) for s in range(rank, n_stages, world)]
    if schedule_cls in (ScheduleInterleaved1F1B, ScheduleZBV):
        schedule = schedule_cls(stages, n_microbatches, mse)
    else:
        schedule = schedule_cls(stages[0], n_microbatches, mse)
    return schedule, full, ref


def check_gpipe(ctx):
    parity(*build(2, ctx.rank, 2, ScheduleGPipe, 4)[:3], ctx.rank)


def check_1f1b(ctx):
    parity(*build(2, ctx.rank, 2, Schedule1F1B, 4), ctx.rank)


def check_1f1b_many_microbatches(ctx):
    parity(*build(2, ctx.rank, 2, Schedule1F1B, 8), ctx.rank)


def check_interleaved(ctx):
    schedule, full, ref = build(4, ctx.rank, 2, ScheduleInterleaved1F1B, 4)
    assert [st.stage_index for st in schedule.stages] == [ctx.rank, ctx.rank + 2]
    parity(schedule, full, ref, ctx.rank)


def check_interleaved_eight_stages(ctx):
    """v = 4 chunks per rank (8 stages of one block), m = 2 microbatches."""
    parity(*build(8, ctx.rank, 2, ScheduleInterleaved1F1B, 2, n_blocks=8), ctx.rank)


def check_zbh1(ctx):
    """ZB-H1: B (input gradient) and W (weight gradient) as separate actions; rank 1
    postpones one W."""
    schedule, full, ref = build(2, ctx.rank, 2, ScheduleZBH1, 4)
    assert sum(a.kind == "W" for a in schedule.pipeline_order[ctx.rank]) == 4
    parity(schedule, full, ref, ctx.rank)


def check_zbv(ctx):
    """ZB-V: 4 stages on 2 ranks in a V (rank 0: stages 0 and 3, so the loss is on rank 0;
    rank 1: stages 1 and 2, handed over locally); m = 4 microbatches; then an eval."""
    schedule, full, ref = build(4, ctx.rank, 2, ScheduleZBV, 4)
    assert [st.stage_index for st in schedule.stages] == [ctx.rank, 3 - ctx.rank]
    parity(schedule, full, ref, ctx.rank, steps=3)
    x, y = data(9)
    losses = []
    out = schedule.eval(x, target=y, losses=losses)
    if ctx.rank == 0:  # holds the last stage (3)
        with torch.no_grad():
            close(out, ref(x), "zbv eval output")


CUSTOM = {0: "0F0 0F1 0F2 0B0 0F3 0B1 0B2 0B3", 1: "1F0 1B0 1F1 1B1 1F2 1F3 1B2 1B3"}


def check_custom_order(ctx):
    full, first, blocks, last = make_model(4)
    ref = copy.deepcopy(full)
    modules = split_into_stages(blocks, 2, first=first, last=last)
    stage = PipelineStage(modules[ctx.rank], ctx.rank, 2)
    schedule = PipelineSchedule(stage, 4, mse, order=parse_order(CUSTOM))
    parity(schedule, full, ref, ctx.rank)
    assert " ".join(map(str, schedule.last_actions)) == CUSTOM[ctx.rank]


def check_eval(ctx):
    schedule, full, ref = build(4, ctx.rank, 2, ScheduleInterleaved1F1B, 4)
    x, y = data(0)
    losses = []
    out = schedule.eval(x, target=y, losses=losses)
    assert all(p.grad is None for p in full.parameters()), "eval produced gradients"
    assert all(a.kind == "F" for a in schedule.last_actions)
    if ctx.rank == 1:  # holds the last stage (3)
        with torch.no_grad():
            ref_out = ref(x)
            ref_losses = [mse(ref_out[i * 2:(i + 1) * 2], y[i * 2:(i + 1) * 2])
                          for i in range(4)]
        close(out, ref_out, "eval output")
        close(torch.stack(losses), torch.stack(ref_losses), "eval losses")
    else:
        assert out is None


def check_eval_shapes_differ_from_training(ctx):
    """Shapes are fixed per mode: the first step fixes the training shapes, the first eval
    its own, so evals of another batch size between steps still give the reference's
    gradients, outputs and eval losses (another size within a mode is an error: see
    pp_mismatch.py's "changed")."""
    schedule, full, ref = build(4, ctx.rank, 2, ScheduleInterleaved1F1B, 2)

    def evaluate(step):
        x, y = data(50 + step, 6)
        losses = []
        out = schedule.eval(x, target=y, losses=losses)
        if ctx.rank == 1:  # holds the last stage (3)
            with torch.no_grad():
                ref_out = ref(x)
            half = x.shape[0] // 2
            close(out, ref_out, f"eval after step {step}: output")
            close(torch.stack(losses), torch.stack([mse(ref_out[:half], y[:half]),
                                                    mse(ref_out[half:], y[half:])]),
                  f"eval after step {step}: losses")

    parity(schedule, full, ref, ctx.rank, batches=[8, 8, 8, 8], between=evaluate)


class First(nn.Module):
    """Returns a float activation and an integer mask: a tuple crosses the stage boundary."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(IN, DIM)

    def forward(self, x):
        return torch.tanh(self.fc(x)), (x[:, :1] > 0).long()


class Last(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(DIM, OUT)

    def forward(self, h, mask):
        return self.fc(h) * (1 + mask)


def check_tuple_and_int_tensors(ctx):
    torch.manual_seed(0)
    full = nn.ModuleList([First(), Last()])
    ref = copy.deepcopy(full)
    schedule = Schedule1F1B(PipelineStage(full[ctx.rank], ctx.rank, 2), 2, mse)

    class Ref(nn.Module):
        def __init__(self, pair):
            super().__init__()
            self.pair = pair

        def forward(self, x):
            return self.pair[1](*self.pair[0](x))

    parity(schedule, full, Ref(ref), ctx.rank, batches=[8, 8, 8])  # a float and an int tensor


def check_scale_grads_false(ctx):
    """scale_grads=False: the gradient of the sum of microbatch losses (torch's flag)."""
    full, first, blocks, last = make_model(2)
    ref = copy.deepcopy(full)
    modules = split_into_stages(blocks, 2, first=first, last=last)
    schedule = ScheduleGPipe(PipelineStage(modules[ctx.rank], ctx.rank, 2), 4, mse,
                             scale_grads=False)
    x, y = data(0)
    schedule.step(x, target=y)
    ref_out = ref(x)
    sum(mse(ref_out[i * 2:(i + 1) * 2], y[i * 2:(i + 1) * 2]) for i in range(4)).backward()
    mine = local_params(schedule)
    for (name, p), (_, q) in zip(full.named_parameters(), ref.named_parameters(), strict=True):
        if id(p) in mine:
            close(p.grad, q.grad, f"grad {name}")


class FailOnce(nn.Module):
    """Raises in the forward of microbatch ``fail_at`` of the next step (then never again)."""

    def __init__(self, inner, fail_at):
        super().__init__()
        self.inner, self.fail_at, self.calls = inner, fail_at, 0

    def forward(self, x):
        self.calls += 1
        if self.calls == self.fail_at + 1:
            raise RuntimeError("a bad microbatch")
        return self.inner(x)


def check_refusals(ctx):
    """What cannot run is said at once, on the ranks that can tell (the breaker's cases): a
    batch (stage 0's rank) or target (the last stage's) of other microbatch shapes than the
    first step's, before any message, so the schedule stays usable; an empty batch; a new
    n_microbatches; and a step after one that failed midway (on a pipeline of one rank: a
    peer of the failed step would wait for its message)."""
    schedule, _, _ = build(2, ctx.rank, 2, Schedule1F1B, 2)
    x, y = data(0)
    schedule.step(x, target=y)
    small_x, small_y = data(1, batch=6)
    try:
        schedule.step(small_x, target=small_y)
        raise AssertionError("a smaller batch ran")
    except RuntimeError as e:
        what = "batch" if ctx.rank == 0 else "target"
        assert f"this step's {what} microbatches are [(3, " in str(e), e
    schedule.step(x, target=y)  # nothing was sent: the next step of the old shape runs
    for bad in (lambda: schedule.step(x[:0], target=y[:0]),):
        try:
            bad()
            raise AssertionError("an empty batch ran")
        except ValueError as e:
            assert "empty batch" in str(e), e
    try:
        schedule.n_microbatches = 4
        raise AssertionError("n_microbatches changed")
    except AttributeError as e:
        assert "fixed at 2" in str(e), e
    alone = [torch.distributed.new_group([r]) for r in range(2)][ctx.rank]
    full, first, blocks, last = make_model(2)
    modules = split_into_stages(blocks, 2, first=first, last=last)
    modules[1] = FailOnce(modules[1], fail_at=1)
    stages = [PipelineStage(modules[s], s, 2, group=alone) for s in range(2)]
    one_rank = ScheduleInterleaved1F1B(stages, 2, mse)
    try:
        one_rank.step(x, target=y)
        raise AssertionError("the failing microbatch ran")
    except RuntimeError as e:
        assert "a bad microbatch" in str(e), e
    try:
        one_rank.step(x, target=y)
        raise AssertionError("a schedule whose step failed midway ran again")
    except RuntimeError as e:
        assert "an earlier step failed midway" in str(e), e


CHECKS = [check_gpipe, check_1f1b, check_1f1b_many_microbatches, check_interleaved,
          check_interleaved_eight_stages, check_zbh1, check_zbv, check_custom_order, check_eval,
          check_tuple_and_int_tensors, check_scale_grads_false,
          check_eval_shapes_differ_from_training, check_refusals]


def main():
    run_checks(CHECKS)


if __name__ == "__main__":
    main()
