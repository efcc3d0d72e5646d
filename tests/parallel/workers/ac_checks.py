"""Worker: activation checkpointing composed with ddp, fully_shard and parallelize (2 ranks).

Each check trains a 3-block model for 2 SGD steps with `checkpoint_activations` on every
block ("full" or "selective"), under one strategy, and compares the gradients of the first
step and the parameters after each with one process training the same model without
checkpointing on the global batch. FSDP is checked with checkpointing applied before and after
`fully_shard` (the block is the unit either way). TP with `ShardedDropout`: the model with
checkpointing (and the tracker passed) equals the same TP model without it, bit for bit,
dropout masks included.
"""

import copy

import torch
import torch.distributed as dist
from torch import nn

from meshrun.parallel import (
    ColwiseParallel,
    RowwiseParallel,
    ShardedDropout,
    ddp,
    full_tensor,
    fully_shard,
    parallelize,
)
from meshrun.parallel.activation_checkpoint import checkpoint_activations
from tests.parallel.harness import run_checks

TOL = dict(atol=1e-5, rtol=1e-5)
WIDTH, B, T = 16, 4, 6  # B: per rank


class Block(nn.Module):
    def __init__(self, p_drop=0.0):
        super().__init__()
        self.ln = nn.LayerNorm(WIDTH)
        self.fc1 = nn.Linear(WIDTH, 4 * WIDTH)
        self.drop = nn.Dropout(p_drop)
        self.fc2 = nn.Linear(4 * WIDTH, WIDTH)

    def forward(self, x):
        return x + self.fc2(self.drop(torch.nn.functional.gelu(self.fc1(self.ln(x)))))


def model(p_drop=0.0):
    torch.manual_seed(0)
    return nn.Sequential(*[Block(p_drop) for _ in range(3)], nn.Linear(WIDTH, 1))


def batch(step, rank=None):
    g = torch.Generator().manual_seed(100 + step)
    x, y = torch.randn(2 * B, T, WIDTH, generator=g), torch.randn(2 * B, T, 1, generator=g)
    return (x, y) if rank is None else (x[rank * B:(rank + 1) * B], y[rank * B:(rank + 1) * B])


def full(p, t):
    return full_tensor(p, t)  # by its placement record: FSDP rows, TP shards, or t itself


def parity(apply, policy):
    rank = dist.get_rank()
    ref = model()
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    par = apply(copy.deepcopy(ref), policy)
    opt = torch.optim.SGD(par.parameters(), lr=0.1)
    for step in range(2):
        x, y = batch(step, rank)
        opt.zero_grad()
        torch.nn.functional.mse_loss(par(x), y).backward()
        gx, gy = batch(step)
        ref_opt.zero_grad()
        torch.nn.functional.mse_loss(ref(gx), gy).backward()
        if step == 0:
            for (name, p), q in zip(par.named_parameters(), ref.parameters(), strict=True):
                torch.testing.assert_close(full(p, p.grad), q.grad, **TOL,
                                           msg=lambda m, name=name: f"grad {name}: {m}")
        opt.step()
        ref_opt.step()
        for (name, p), q in zip(par.named_parameters(), ref.parameters(), strict=True):
            torch.testing.assert_close(full(p, p.detach()), q.detach(), **TOL,
                                       msg=lambda m, name=name, step=step: f"step {step} {name}: {m}")


def each_block(m, policy):
    for block in list(m)[:3]:
        checkpoint_activations(block, policy)
    return m


def with_ddp(m, policy):
    return ddp(each_block(m, policy))


def fsdp_ac_first(m, policy):
    each_block(m, policy)
    for block in list(m)[:3]:
        fully_shard(block)
    return fully_shard(m)


def fsdp_ac_after(m, policy):
    for block in list(m)[:3]:
        fully_shard(block)
    fully_shard(m)
    return each_block(m, policy)


def tp_plan():
    return {f"{i}.fc1": ColwiseParallel() for i in range(3)} | {
        f"{i}.fc2": RowwiseParallel() for i in range(3)}


def with_tp(m, policy):  # both ranks see the same batch under TP: compare per rank
    parallelize(m, None, tp_plan())
    return each_block(m, policy)


def check_ddp_full(ctx):
    parity(with_ddp, "full")


def check_ddp_selective(ctx):
    parity(with_ddp, "selective")


def check_fsdp_checkpointed_before_sharding(ctx):
    parity(fsdp_ac_first, "full")


def check_fsdp_checkpointed_after_sharding(ctx):
    parity(fsdp_ac_after, "selective")


def check_tp_full(ctx):
    """TP: both ranks train on the same (global) batch; the reference too."""
    ref = model()
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    par = with_tp(copy.deepcopy(ref), "full")
    opt = torch.optim.SGD(par.parameters(), lr=0.1)
    for step in range(2):
        x, y = batch(step)
        for m, o in ((par, opt), (ref, ref_opt)):
            o.zero_grad()
            torch.nn.functional.mse_loss(m(x), y).backward()
            o.step()
        for (name, p), q in zip(par.named_parameters(), ref.parameters(), strict=True):
            torch.testing.assert_close(full(p, p.detach()), q.detach(), **TOL,
                                       msg=lambda m, name=name, step=step: f"step {step} {name}: {m}")


def check_tp_sharded_dropout_replayed(ctx):
    """Dropout between the TP pair draws from the per-rank stream: with the tracker passed,
    checkpointing changes no bit (the recompute draws the forward's masks)."""
    def build(ac):
        m = model(p_drop=0.5)
        plan = tp_plan() | {f"{i}.drop": ShardedDropout() for i in range(3)}
        parallelize(m, None, plan)
        if ac:
            for block in list(m)[:3]:
                checkpoint_activations(block, "full", rng_tracker=m.tp_rng_tracker)
        return m

    grads = []
    for ac in (False, True):
        torch.manual_seed(5)
        m = build(ac)
        x, y = batch(0)
        torch.nn.functional.mse_loss(m(x), y).backward()
        grads.append([p.grad.clone() for p in m.parameters()])
    for a, b in zip(*grads, strict=True):
        assert torch.equal(a, b), f"max |diff| {(a - b).abs().max():.3g}"


def check_fsdp_inside_is_refused(ctx):
    m = model()
    for block in list(m)[:3]:
        fully_shard(block)
    checkpoint_activations(m, "full")
    try:
        m(batch(0, dist.get_rank())[0])
    except RuntimeError as e:
        assert "contains modules given to fully_shard" in str(e), e
    else:
        raise AssertionError("no error")


if __name__ == "__main__":
    run_checks([check_ddp_full, check_ddp_selective, check_fsdp_checkpointed_before_sharding,
                check_fsdp_checkpointed_after_sharding, check_tp_full,
                check_tp_sharded_dropout_replayed, check_fsdp_inside_is_refused])
