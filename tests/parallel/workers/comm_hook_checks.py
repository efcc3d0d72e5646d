"""DDP communication hook checks, run on every rank of a 2-process gloo group (one launch).

References: a single process on the global batch (the exact average gradient), and torch's
own DistributedDataParallel with torch's own hooks (``fp16_compress_hook``, ``powerSGD_hook``)
on the same weights and data.
"""

import copy
import tempfile

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks as torch_default
from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as torch_powersgd
from torch.nn.parallel import DistributedDataParallel

from meshrun.parallel import checkpoint, ddp, gradient_sync
from meshrun.parallel.comm_hooks import (
    PowerSGDState,
    bf16_compress_hook,
    fp16_compress_hook,
    powerSGD_hook,
)
from tests.parallel.harness import run_checks
from tests.parallel.workers.ddp_checks import MLP, CountAllReduce, data, mse, my_slice


def rel_error(a, b):
    return ((a - b).norm() / b.norm()).item()


def train_pair(make_model, ctx, steps, register, tol_check, lr=0.1):
    """meshrun ddp (with ``register(model)``) beside the single-process reference on the
    global batch; ``tol_check(name, grad, ref_grad, step)`` per parameter and step. The
    reference steps on its own (exact) gradients, the ddp model on its own, from the same
    start, so errors would compound."""
    torch.manual_seed(0)
    model = make_model()
    ref = copy.deepcopy(model)
    ddp(model)
    register(model)
    opt, ref_opt = (torch.optim.SGD(m.parameters(), lr=lr) for m in (model, ref))
    for step in range(steps):
        x, y = data(step)
        opt.zero_grad()
        ref_opt.zero_grad()
        mse(model(my_slice(x, ctx.rank, 2)), my_slice(y, ctx.rank, 2)).backward()
        mse(ref(x), y).backward()
        for (name, p), q in zip(model.named_parameters(), ref.parameters(), strict=True):
            tol_check(name, p.grad, q.grad, step)
        opt.step()
        ref_opt.step()
    return model


# -------------------------------------------------------------------------------------------
# checks


def check_compress_hooks(ctx):
    """fp16 / bf16 (meshrun's, and torch's own fp16 hook run on meshrun's buckets): within
    1e-2 relative of the exact gradient, all-reduced in the half dtype only."""
    hooks = [("fp16", fp16_compress_hook, torch.float16), ("bf16", bf16_compress_hook,
             torch.bfloat16), ("torch fp16", torch_default.fp16_compress_hook, torch.float16)]
    for what, hook, dtype in hooks:
        errors = []

        def within(name, grad, ref_grad, step, what=what, errors=errors):
            err = rel_error(grad, ref_grad)
            errors.append(err)
            assert err < 1e-2, f"{what} step {step} {name}: relative error {err:.2e}"

        with CountAllReduce([]) as counter:
            train_pair(MLP, ctx, 3, lambda m, hook=hook: m.register_comm_hook(None, hook),
                       within)
        dtypes = {d for d, numel in counter.calls}
        assert dtypes == {str(dtype)}, (what, dtypes)
        assert max(errors) > 0, f"{what}: bit-equal to fp32: nothing was compressed"


class TwoRankOne(nn.Module):
    """Two bias-free weights whose gradients are rank 1 on every rank and on average:
    d/dW1 of u . W1 x = u x^T (u fixed, x the rank's data)."""

    def __init__(self):
        super().__init__()
        self.w1 = nn.Linear(16, 8, bias=False)
        self.w2 = nn.Linear(16, 12, bias=False)
        self.register_buffer("u", torch.linspace(-1, 1, 8))
        self.register_buffer("v", torch.linspace(0.5, 2, 12))

    def forward(self, x):
        return (self.w1(x) * self.u).sum(-1) + (self.w2(x) * self.v).sum(-1)


def check_powersgd_rank1_exact(ctx):
    """Rank-1 average gradients, rank 1: PowerSGD is exact (1e-5 without error feedback; with
    it, 1e-4: each rank's error is its deviation from the average, which sums to zero over the
    ranks but grows the local matrices whose cancellation the float sums must carry). Two
    buckets (one per weight) exercise the bucket order; from start_powerSGD_iter on, P and Q
    (8 + 16 and 12 + 16 elements) are all-reduced, not the 128 + 192 of the matrices."""
    for feedback, tol in ((False, 1e-5), (True, 1e-4)):
        state = rank1_run(ctx, feedback, tol)
        assert state.iter == 5, state.iter
        if feedback:
            assert sorted(state.error_dict) == ["w1.weight", "w2.weight"], state.error_dict
            for name, error in state.error_dict.items():
                total = error.clone()
                dist.all_reduce(total)
                assert error.norm() > 1e-3 and total.norm() < 1e-5 * error.norm() * 10, name


def rank1_run(ctx, feedback, tol):
    torch.manual_seed(0)
    model = TwoRankOne()
    ref = copy.deepcopy(model)
    ddp(model, bucket_cap_mb=1e-5, first_bucket_cap_mb=1e-5)
    state = PowerSGDState(None, matrix_approximation_rank=1, start_powerSGD_iter=2,
                          use_error_feedback=feedback)
    model.register_comm_hook(state, powerSGD_hook)
    opt, ref_opt = (torch.optim.SGD(m.parameters(), lr=0.05) for m in (model, ref))
    for step in range(5):
        g = torch.Generator().manual_seed(step)
        x = torch.randn(2, 16, generator=g)  # one sample per rank
        opt.zero_grad()
        ref_opt.zero_grad()
        with CountAllReduce([]) as counter:
            model(x[ctx.rank:ctx.rank + 1]).mean().backward()
        (ref(x).sum() / 2).backward()
        for (name, p), q in zip(model.named_parameters(), ref.parameters(), strict=True):
            torch.testing.assert_close(p.grad, q.grad, rtol=tol, atol=tol / 10,
                                       msg=lambda m, n=name, s=step: f"step {s} {n}: {m}")
        sizes = sorted(numel for _, numel in counter.calls)
        expect = [128, 192] if step < 2 else [8, 12, 16, 16]
        assert sizes == expect, (step, sizes)
        opt.step()
        ref_opt.step()
    return state


def powersgd_vs_torch(ctx, steps=6, **settings):
    """meshrun's PowerSGD vs torch's DDP + torch's powerSGD_hook, same settings and seed, two
    microbatches a step (the first without gradient sync): gradients equal every step, and
    after start_powerSGD_iter unequal to the exact average (it did compress)."""
    torch.manual_seed(0)
    mine = MLP()
    theirs = copy.deepcopy(mine)
    exact = copy.deepcopy(mine)
    ddp(mine)
    mine.register_comm_hook(PowerSGDState(None, **settings), powerSGD_hook)
    theirs = DistributedDataParallel(theirs)
    theirs.register_comm_hook(torch_powersgd.PowerSGDState(None, **settings),
                              torch_powersgd.powerSGD_hook)
    opts = [torch.optim.SGD(m.parameters(), lr=0.1) for m in (mine, theirs, exact)]
    start = settings["start_powerSGD_iter"]
    for step in range(steps):
        for opt in opts:
            opt.zero_grad()
        for micro in range(2):
            x, y = data(10 * step + micro)
            xs, ys = my_slice(x, ctx.rank, 2), my_slice(y, ctx.rank, 2)
            with gradient_sync(mine, micro == 1):
                mse(mine(xs), ys).backward()
            with (theirs.no_sync() if micro == 0 else _nothing()):
                mse(theirs(xs), ys).backward()
            mse(exact(x), y).backward()  # the exact average: the global batch
        for (name, p), q, e in zip(mine.named_parameters(), theirs.module.parameters(),
                                   exact.parameters(), strict=True):
            torch.testing.assert_close(p.grad, q.grad, rtol=1e-5, atol=1e-6,
                                       msg=lambda m, n=name, s=step: f"{settings} step {s} {n}: {m}")
            if step >= start and p.dim() == 2 and name != "fc3.weight":
                assert rel_error(p.grad, e.grad) > 1e-3, f"step {step} {name} uncompressed"
        for opt in opts:
            opt.step()
        with torch.no_grad():  # all three from the same weights: compare one step at a time
            for p, q in zip(theirs.module.parameters(), mine.parameters(), strict=True):
                p.copy_(q)
            for p, q in zip(exact.parameters(), mine.parameters(), strict=True):
                p.copy_(q)


class _nothing:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


def check_powersgd_matches_torch(ctx):
    powersgd_vs_torch(ctx, matrix_approximation_rank=1, start_powerSGD_iter=2)
    powersgd_vs_torch(ctx, matrix_approximation_rank=4, start_powerSGD_iter=3,
                      min_compression_rate=1)  # r > 2: QR; fc1 and fc2 compressed
    powersgd_vs_torch(ctx, matrix_approximation_rank=2, start_powerSGD_iter=2,
                      warm_start=False, random_seed=7)  # Q drawn afresh every step


def run_powersgd(ctx, steps, directory=None, save_at=None, load_from=None, seed=0,
                 load_hook_state=True, **settings):
    """Train the MLP with PowerSGD and SGD with momentum; save after step ``save_at`` or
    start from ``load_from``; return the parameters after ``steps``."""
    torch.manual_seed(seed)  # another seed for a resumed run: the load must overwrite it all
    model = ddp(MLP())
    state = PowerSGDState(None, random_seed=seed, **settings)
    model.register_comm_hook(state, powerSGD_hook)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    first = 0
    if load_from is not None:
        saved = {"model": checkpoint.model_state(model),
                 "optim": checkpoint.optimizer_state(opt, model), "step": 0}
        if load_hook_state:
            saved["comm_hook"] = state
        checkpoint.load(saved, load_from)
        first = saved["step"] + 1
    for step in range(first, steps):
        x, y = data(step)
        opt.zero_grad()
        mse(model(my_slice(x, ctx.rank, 2)), my_slice(y, ctx.rank, 2)).backward()
        opt.step()
        if step == save_at:
            checkpoint.save({"model": checkpoint.model_state(model),
                             "optim": checkpoint.optimizer_state(opt, model), "step": step,
                             "comm_hook": state}, f"{directory}/step_{step}")
    return [p.detach().clone() for p in model.parameters()], state


def check_powersgd_checkpoint(ctx):
    """save, load, train on == train on, bit for bit (error feedback, Q, iteration and random
    state restored); loading without the hook's state differs (the state matters)."""
    with tempfile.TemporaryDirectory() as tmp:
        box = [tmp]
        dist.broadcast_object_list(box)  # rank 0's directory for every rank
        for settings in (dict(matrix_approximation_rank=2, start_powerSGD_iter=2),
                         dict(matrix_approximation_rank=1, start_powerSGD_iter=2,
                              warm_start=False)):
            directory = f"{box[0]}/{len(settings)}"
            through, state = run_powersgd(ctx, 8, directory, save_at=4, **settings)
            assert state.error_dict and state.iter == 8, (sorted(state.error_dict), state.iter)
            resumed, again = run_powersgd(ctx, 8, load_from=f"{directory}/step_4", seed=1,
                                          **settings)
            assert again.iter == 8, again.iter
            for a, b in zip(through, resumed, strict=True):
                assert torch.equal(a, b), (settings, (a - b).abs().max().item())
            forgot, _ = run_powersgd(ctx, 8, load_from=f"{directory}/step_4", seed=1,
                                     load_hook_state=False, **settings)
            assert not all(torch.equal(a, b) for a, b in zip(through, forgot, strict=True)), \
                "the resumed run without the hook's state must differ"


class ScaledMLP(MLP):
    """The input scaled by a 1-D parameter first: its gradient arrives last, alone in the last
    of one-parameter buckets, with nothing PowerSGD compresses."""

    def __init__(self):
        super().__init__()
        self.scale = nn.Parameter(torch.ones(8))

    def forward(self, x):
        return super().forward(x * self.scale)


def check_powersgd_counts_steps_at_an_uncompressed_last_bucket(ctx):
    torch.manual_seed(0)
    model = ddp(ScaledMLP(), bucket_cap_mb=1e-6, first_bucket_cap_mb=1e-6)
    state = PowerSGDState(None, start_powerSGD_iter=2)
    model.register_comm_hook(state, powerSGD_hook)
    for step in range(5):
        x, y = data(step)
        mse(model(my_slice(x, ctx.rank, 2)), my_slice(y, ctx.rank, 2)).backward()
        assert state.iter == step + 1, (step, state.iter)
    last = model._meshrun_ddp.buckets[-1]
    assert [model._meshrun_ddp.names[i] for i in last.params] == ["scale"], last.params
    assert state.error_dict, "nothing was compressed"


def check_hook_contract(ctx):
    """A hook returning a plain tensor works; wrong results and a second hook are errors."""
    def mean_by_hand(group, bucket):
        out = bucket.buffer().clone()
        dist.all_reduce(out)
        return out / 2

    train_pair(MLP, ctx, 2, lambda m: m.register_comm_hook(None, mean_by_hand),
               lambda n, g, r, s: torch.testing.assert_close(g, r))
    model = ddp(MLP())
    model.register_comm_hook(None, lambda group, bucket: bucket.buffer()[:3])
    x, y = data(0)
    try:
        mse(model(my_slice(x, ctx.rank, 2)), my_slice(y, ctx.rank, 2)).backward()
    except ValueError as e:
        assert "3 elements" in str(e) and "bucket 0" in str(e), e
    else:
        raise AssertionError("a hook returning a wrongly sized tensor must raise")
    for make in (lambda: ddp(MLP(), grad_compression="fp16"), lambda: model):
        try:
            make().register_comm_hook(None, fp16_compress_hook)
        except RuntimeError as e:
            assert "one hook per module" in str(e), e
        else:
            raise AssertionError("a second hook must raise")
    try:
        PowerSGDState(None, start_powerSGD_iter=1)
    except ValueError as e:
        assert "start_powerSGD_iter must be > 1" in str(e), e
    else:
        raise AssertionError("start_powerSGD_iter=1 with error feedback must raise")


CHECKS = [check_compress_hooks, check_powersgd_rank1_exact, check_powersgd_matches_torch,
          check_powersgd_checkpoint, check_powersgd_counts_steps_at_an_uncompressed_last_bucket,
          check_hook_contract]


def main():
    run_checks(CHECKS)


if __name__ == "__main__":
    main()
