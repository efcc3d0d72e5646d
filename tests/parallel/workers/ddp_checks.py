"""DDP checks, run on every rank of a 2-process gloo group (one launch for all of them).

Each check builds its own models and reports "ok" or the failure text under its name. The
reference is one process on the global batch: the same initial weights, the loss averaged over
the ranks' slices (equal to the full-batch mean for equal slices), stepped with SGD; DDP ranks
step on their own slices. Losses, grads and params must match every step.
"""

import copy
import importlib

import torch
import torch.distributed as dist
from torch import nn

from meshrun.parallel import Mesh, agree_num_batches, ddp
from tests.parallel.harness import run_checks

STEPS = 3
GLOBAL_BATCH = 8


class MLP(nn.Module):
    def __init__(self, width=16):
        super().__init__()
        self.fc1 = nn.Linear(8, width)
        self.fc2 = nn.Linear(width, width)
        self.fc3 = nn.Linear(width, 4)

    def forward(self, x):
        return self.fc3(torch.tanh(self.fc2(torch.tanh(self.fc1(x)))))


class Reversed(nn.Module):
    """Registered in the opposite order of use: gradients arrive in registration order."""

    def __init__(self):
        super().__init__()
        self.last = nn.Linear(16, 4)
        self.first = nn.Linear(8, 16)

    def forward(self, x):
        return self.last(torch.tanh(self.first(x)))


class Unused(nn.Module):
    """`never` gets no gradient anywhere; `rank0_only` only on the slice where use_extra."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(8, 4)
        self.never = nn.Linear(8, 4)
        self.rank0_only = nn.Linear(4, 4)

    def forward(self, x, use_extra):
        y = self.fc(x)
        return self.rank0_only(y) if use_extra else y


class Scaled(nn.Module):
    """A buffer saved for backward: an in-place buffer broadcast would break autograd."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(8, 4)
        self.register_buffer("scale", torch.full((4,), 0.5))

    def forward(self, x):
        return self.fc(x) * self.scale


def data(step, n=GLOBAL_BATCH, dim=8):
    g = torch.Generator().manual_seed(1000 + step)
    return torch.randn(n, dim, generator=g), torch.randn(n, 4, generator=g)


def my_slice(t, rank, world):
    per = t.shape[0] // world
    return t[rank * per:(rank + 1) * per]


def mse(out, y):
    return ((out - y) ** 2).mean()


def close(a, b, what, **tol):
    torch.testing.assert_close(a, b, msg=lambda m: f"{what}: {m}", **tol)


def compare(model, ref, step, **tol):
    for (name, p), (_, q) in zip(model.named_parameters(), ref.named_parameters(), strict=True):
        if (p.grad is None) != (q.grad is None):
            raise AssertionError(f"step {step}: {name}.grad None mismatch: ddp "
                                 f"{p.grad is None}, ref {q.grad is None}")
        if p.grad is not None:
            close(p.grad, q.grad, f"step {step} grad {name}", **tol)
        close(p.detach(), q.detach(), f"step {step} param {name}", **tol)


def parity(make_model, ctx, steps=STEPS, tol=None, **ddp_kwargs):
    """Train DDP and reference side by side; return the DDP model."""
    torch.manual_seed(0)
    model = make_model()
    ref = copy.deepcopy(model)
    ddp(model, **ddp_kwargs)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    for step in range(steps):
        x, y = data(step)
        loss = mse(model(my_slice(x, ctx.rank, ctx.world_size)),
                   my_slice(y, ctx.rank, ctx.world_size))
        opt.zero_grad()
        loss.backward()
        ref_loss = mse(ref(x), y)
        ref_opt.zero_grad()
        ref_loss.backward()
        mean_loss = loss.detach().clone()
        dist.all_reduce(mean_loss)
        close(mean_loss / ctx.world_size, ref_loss.detach(), f"step {step} loss", **(tol or {}))
        compare(model, ref, step, **(tol or {}))
        opt.step()
        ref_opt.step()
        compare(model, ref, step, **(tol or {}))
    return model


class CountAllReduce:
    """Patch dist.all_reduce to record (dtype, numel) and a shared event log."""

    def __init__(self, events):
        self.calls, self.events, self.original = [], events, dist.all_reduce

    def __enter__(self):
        def counting(tensor, *args, **kwargs):
            self.calls.append((str(tensor.dtype), tensor.numel()))
            self.events.append("all_reduce")
            return self.original(tensor, *args, **kwargs)

        dist.all_reduce = counting
        return self

    def __exit__(self, *exc):
        dist.all_reduce = self.original


# -------------------------------------------------------------------------------------------
# checks


def check_wrap(ctx):
    torch.manual_seed(ctx.rank)  # different weights per rank: ddp must broadcast rank 0's
    model = nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4))
    keys = list(model.state_dict())
    assert ddp(model) is model, "ddp must return the same module"
    assert list(model.state_dict()) == keys, f"state_dict keys changed: {list(model.state_dict())}"
    flat = torch.cat([t.detach().flatten().float() for t in model.state_dict().values()])
    gathered = [torch.empty_like(flat) for _ in range(ctx.world_size)]
    dist.all_gather(gathered, flat)
    close(gathered[1], gathered[0], "params/buffers after wrap")
    try:
        ddp(model)
    except RuntimeError as e:
        assert "already" in str(e), e
    else:
        raise AssertionError("a second ddp() on the same module must raise")


def check_default(ctx):
    model = parity(MLP, ctx)
    assert model._meshrun_ddp.num_buckets == 1, model._meshrun_ddp.num_buckets


def check_tiny_buckets(ctx):
    events = []
    torch.manual_seed(0)
    model = parity(MLP, ctx, bucket_cap_mb=1e-5, first_bucket_cap_mb=1e-5)
    reducer = model._meshrun_ddp
    assert reducer.num_buckets >= 5, reducer.num_buckets
    x, y = data(99)
    with CountAllReduce(events) as counter:
        mse(model(my_slice(x, ctx.rank, 2)), my_slice(y, ctx.rank, 2)).backward()
    assert len(counter.calls) == reducer.num_buckets, (counter.calls, reducer.num_buckets)


def check_rebuild_order(ctx):
    model = parity(Reversed, ctx, bucket_cap_mb=1e-5, first_bucket_cap_mb=1e-5)
    reducer = model._meshrun_ddp
    first = [reducer.names[i] for i in reducer.buckets[0].params]
    assert reducer.rebuilt and first[0].startswith("last."), first


def check_overlap(ctx):
    """The first bucket's all_reduce is issued before backward reaches the first layer."""
    events = []
    torch.manual_seed(0)
    model = ddp(MLP(), bucket_cap_mb=1e-5, first_bucket_cap_mb=1e-5)
    model.fc1.weight.register_post_accumulate_grad_hook(lambda p: events.append("fc1_grad"))
    x, y = data(0)
    for _ in range(2):  # before and after the rebuild
        events.clear()
        with CountAllReduce(events):
            mse(model(my_slice(x, ctx.rank, 2)), my_slice(y, ctx.rank, 2)).backward()
        assert "fc1_grad" in events and events.index("all_reduce") < events.index("fc1_grad"), \
            events


def check_no_sync(ctx):
    torch.manual_seed(0)
    model = MLP()
    ref = copy.deepcopy(model)
    ddp(model)
    opt, ref_opt = (torch.optim.SGD(m.parameters(), lr=0.1) for m in (model, ref))
    for step in range(STEPS):
        opt.zero_grad()
        ref_opt.zero_grad()
        for micro in range(3):  # two accumulating backwards, then one synchronised
            x, y = data(10 * step + micro)
            loss = mse(model(my_slice(x, ctx.rank, 2)), my_slice(y, ctx.rank, 2))
            if micro < 2:
                with model.no_sync():
                    loss.backward()
            else:
                loss.backward()
            mse(ref(x), y).backward()
        compare(model, ref, step)
        opt.step()
        ref_opt.step()
        compare(model, ref, step)


def check_unused(ctx):
    """find_unused_parameters=True: parity, and `never` keeps grad None on every rank."""
    torch.manual_seed(0)
    model = Unused()
    ref = copy.deepcopy(model)
    ddp(model, find_unused_parameters=True)
    opt, ref_opt = (torch.optim.SGD(m.parameters(), lr=0.1) for m in (model, ref))
    for step in range(STEPS):
        x, y = data(step)
        opt.zero_grad()
        ref_opt.zero_grad()
        mse(model(my_slice(x, ctx.rank, 2), ctx.rank == 0), my_slice(y, ctx.rank, 2)).backward()
        ref_loss = sum(mse(ref(my_slice(x, r, 2), r == 0), my_slice(y, r, 2)) for r in range(2))
        (ref_loss / 2).backward()
        assert model.never.weight.grad is None
        compare(model, ref, step)
        opt.step()
        ref_opt.step()
        compare(model, ref, step)


def check_unused_error(ctx):
    torch.manual_seed(0)
    model = ddp(Unused())
    x, y = data(0)
    try:
        mse(model(my_slice(x, ctx.rank, 2), False), my_slice(y, ctx.rank, 2)).backward()
    except RuntimeError as e:
        msg = str(e)
        assert "never.weight" in msg and "rank0_only.bias" in msg, msg
        assert "find_unused_parameters=True" in msg, msg
        assert "fc.weight" not in msg, msg
    else:
        raise AssertionError("an unused parameter must raise without find_unused_parameters")


def check_two_forwards(ctx):
    torch.manual_seed(0)
    model = Scaled()
    ref = copy.deepcopy(model)
    ddp(model)
    opt, ref_opt = (torch.optim.SGD(m.parameters(), lr=0.1) for m in (model, ref))
    for step in range(STEPS):
        x1, y1 = data(step)
        x2, y2 = data(step + 50)
        opt.zero_grad()
        ref_opt.zero_grad()
        s = (slice(ctx.rank * 4, ctx.rank * 4 + 4),)
        (mse(model(x1[s]), y1[s]) + mse(model(x2[s]), y2[s])).backward()
        (mse(ref(x1), y1) + mse(ref(x2), y2)).backward()
        compare(model, ref, step)
        opt.step()
        ref_opt.step()


def check_batchnorm_buffers(ctx):
    """Buffers: rank 0's broadcast before each grad-enabled forward; not under no_grad."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 4), nn.BatchNorm1d(4))
    ref = copy.deepcopy(model)  # rank 0's view: BN trained on rank 0's slices only
    ddp(model)
    for step in range(STEPS):
        x, _ = data(step)
        model(my_slice(x, ctx.rank, 2)).sum().backward()
        with torch.no_grad():
            ref(my_slice(x, 0, 2))
    bn, ref_bn = model[1], ref[1]
    if ctx.rank == 0:
        close(bn.running_mean, ref_bn.running_mean, "rank 0 running_mean")
        close(bn.running_var, ref_bn.running_var, "rank 0 running_var")
    assert int(bn.num_batches_tracked) == STEPS
    stats = torch.stack([bn.running_mean, bn.running_var])
    theirs = [torch.empty_like(stats) for _ in range(2)]
    dist.all_gather(theirs, stats)
    assert not torch.allclose(theirs[0], theirs[1]), "ranks normalise their own slices"
    model.eval()
    with torch.no_grad():  # no broadcast without grad
        model(torch.zeros(2, 8))
    dist.all_gather(theirs, torch.stack([bn.running_mean, bn.running_var]))
    assert not torch.allclose(theirs[0], theirs[1]), "no_grad forward must not broadcast"
    model(torch.zeros(2, 8))  # eval, grad enabled: broadcast, no update
    dist.all_gather(theirs, torch.stack([bn.running_mean, bn.running_var]))
    close(theirs[1], theirs[0], "buffers after a grad-enabled forward")


def check_uneven(ctx):
    torch.manual_seed(0)
    model = ddp(MLP())
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    local = 5 if ctx.rank == 0 else 3
    n = agree_num_batches(local)
    assert n == 3, n
    for step in range(n):
        x, y = data(step)
        opt.zero_grad()
        mse(model(my_slice(x, ctx.rank, 2)), my_slice(y, ctx.rank, 2)).backward()
        opt.step()
    flat = torch.cat([p.detach().flatten() for p in model.parameters()])
    theirs = [torch.empty_like(flat) for _ in range(2)]
    dist.all_gather(theirs, flat)
    close(theirs[1], theirs[0], "params after uneven epoch")


def check_compression(ctx):
    for name, dtype in (("bf16", "torch.bfloat16"), ("fp16", "torch.float16")):
        events = []
        with CountAllReduce(events) as counter:
            parity(MLP, ctx, tol=dict(atol=1e-2, rtol=1e-2), grad_compression=name)
        dtypes = {d for d, numel in counter.calls if numel > 1}  # numel 1: the loss
        assert dtype in dtypes and "torch.float32" not in dtypes, (name, dtypes)


def check_mesh_group(ctx):
    mesh = Mesh({"dp": 2})
    assert (mesh.size("dp"), mesh.rank("dp")) == (2, ctx.rank)
    parity(MLP, ctx, group=mesh.group("dp"), bucket_cap_mb=1e-5, first_bucket_cap_mb=1e-5)
    mesh2 = Mesh({"pp": 1, "tp": 2})
    assert mesh2.size("pp") == 1 and mesh2.rank("tp") == ctx.rank
    t = torch.ones(1)
    dist.all_reduce(t, group=mesh2.group("tp"))
    assert t.item() == 2
    try:
        Mesh({"dp": 2, "tp": 2})
    except ValueError as e:
        assert "dp=2 x tp=2" in str(e) and "world size is 2" in str(e), e
    else:
        raise AssertionError("a mesh of 4 on a world of 2 must raise")


def check_direct(ctx):
    """Large parameters are all-reduced in their own .grad (no bucket buffer): the same
    parity, no_sync, unused-parameter, compression and rebuild behaviour as bucketed ones."""
    ddp_module = importlib.import_module("meshrun.parallel.ddp")  # not the ddp() function
    saved = ddp_module.DIRECT_MIN_BYTES
    ddp_module.DIRECT_MIN_BYTES = 256  # the weights here (>= 4x16 floats) are direct
    try:
        model = parity(MLP, ctx)
        reducer = model._meshrun_ddp
        direct = sorted(reducer.names[b.params[0]] for b in reducer.buckets if b.direct)
        assert direct == ["fc1.weight", "fc2.weight", "fc3.weight"], direct
        shared = [[reducer.names[i] for i in b.params] for b in reducer.buckets if not b.direct]
        assert len(shared) == 1 and all(n.endswith(".bias") for n in shared[0]), shared
        assert all(b.buffer is None for b in reducer.buckets if b.direct), "buffer kept alive"
        for name, p in model.named_parameters():  # autograd's tensors, not bucket views
            assert p.grad._base is None, name
        check_no_sync(ctx)
        check_compression(ctx)
        check_rebuild_order(ctx)
        check_overlap(ctx)
        ddp_module.DIRECT_MIN_BYTES = 64  # Unused: every weight, none of the biases
        check_unused(ctx)  # incl. rank0_only.weight: a zero buffer on rank 1, then assigned
    finally:
        ddp_module.DIRECT_MIN_BYTES = saved


CHECKS = [check_wrap, check_default, check_tiny_buckets, check_rebuild_order, check_overlap,
          check_no_sync, check_unused, check_unused_error, check_two_forwards,
          check_batchnorm_buffers, check_uneven, check_compression, check_mesh_group,
          check_direct]


def main():
    run_checks(CHECKS)


if __name__ == "__main__":
    main()
