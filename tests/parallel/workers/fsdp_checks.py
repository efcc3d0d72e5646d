"""fully_shard checks, run on every rank of a 2-process gloo group (one launch for all of them).

Each check builds its own models and reports "ok" or the failure text under its name. The
reference is one process on the global batch: the same initial weights, the loss of the whole
batch (the mean of the ranks' equal slices), stepped with Adam. fully_shard ranks step on their
own slices and hold shards, so gradients and parameters are compared shard-wise: rank r's
``p`` against rows ``[r*ceil(d0/N), ...)`` of the reference, every step.

Sizes divide nothing: vocab 11, width 7, hidden 13/15/17, and a (1,)-shaped gain that rank 1
owns no row of.
"""

import copy
import functools
import gc
import math
import os
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import DTensor, Shard

from meshrun.parallel import (
    FSDPModule,
    MixedPrecisionPolicy,
    _comm,
    clip_grad_norm_,
    ddp,
    full_state_dict,
    fully_shard,
)
from tests.parallel.harness import RESULTS_ENV, run_checks

STEPS = 3
GLOBAL_BATCH, SEQ, VOCAB, WIDTH = 8, 5, 11, 7
LR = 1e-2


class Block(nn.Module):
    def __init__(self, hidden, width=WIDTH):
        super().__init__()
        self.ln = nn.LayerNorm(width)
        self.fc1 = nn.Linear(width, hidden)
        self.fc2 = nn.Linear(hidden, width)

    def forward(self, x):
        return x + self.fc2(torch.tanh(self.fc1(self.ln(x))))


class Net(nn.Module):
    def __init__(self, tied=False, n_blocks=3, width=WIDTH, hidden=13):
        super().__init__()
        self.emb = nn.Embedding(VOCAB, width)
        self.blocks = nn.ModuleList(Block(hidden + 2 * i, width) for i in range(n_blocks))
        self.gain = nn.Parameter(torch.ones(1))
        self.head = nn.Linear(width, VOCAB, bias=False)
        if tied:
            self.head.weight = self.emb.weight

    def forward(self, idx, targets):
        x = self.emb(idx)
        for block in self.blocks:
            x = block(x)
        logits = self.head(x * self.gain)
        return F.cross_entropy(logits.reshape(-1, VOCAB).float(), targets.reshape(-1))


def shard(model, **kwargs):
    for block in model.blocks:
        fully_shard(block, **kwargs)
    return fully_shard(model, **kwargs)


def batch(step):
    g = torch.Generator().manual_seed(1000 + step)
    return (torch.randint(VOCAB, (GLOBAL_BATCH, SEQ), generator=g),
            torch.randint(VOCAB, (GLOBAL_BATCH, SEQ), generator=g))


def my_slice(t, ctx):
    per = t.shape[0] // ctx.world_size
    return t[ctx.rank * per:(ctx.rank + 1) * per]


def rows(full, ctx):
    """This rank's torch.chunk rows of a full tensor (what its shard must equal)."""
    c = math.ceil(full.shape[0] / ctx.world_size)
    start = min(ctx.rank * c, full.shape[0])
    return full.narrow(0, start, max(0, min(c, full.shape[0] - start)))


def close(a, b, what, **tol):
    torch.testing.assert_close(a, b, msg=lambda m: f"{what}: {m}", **tol)


def compare_shards(model, ref, ctx, what, grads=True, **tol):
    pairs = list(zip(model.named_parameters(), ref.named_parameters(), strict=True))
    for (name, p), (ref_name, q) in pairs:
        assert name == ref_name, (name, ref_name)
        if grads:
            assert p.grad is not None and q.grad is not None, f"{what}: {name} has no grad"
            close(p.grad, rows(q.grad, ctx), f"{what} grad {name}", **tol)
        close(p.detach(), rows(q.detach(), ctx), f"{what} param {name}", **tol)


def mean_over_ranks(t):
    t = t.detach().float().clone()
    dist.all_reduce(t)
    return t / dist.get_world_size()


class Collectives:
    """Record every all-gather / reduce-scatter fully_shard issues for its parameters (kind,
    numel, dtype); the data check's one all-gather of input fingerprints (at a root's first
    forward, `meshrun.parallel.data_check`) is switched off meanwhile."""

    def __init__(self, events=None):
        self.calls, self.events = [], events if events is not None else []
        self.names = {"gather": _comm.ALL_GATHER, "reduce_scatter": _comm.REDUCE_SCATTER}

    def __enter__(self):
        self.data_check = os.environ.get("MESHRUN_DATA_CHECK")
        os.environ["MESHRUN_DATA_CHECK"] = "0"
        self.originals = {kind: getattr(dist, name) for kind, name in self.names.items()}
        for kind, name in self.names.items():
            setattr(dist, name, self._recording(kind, self.originals[kind]))
        return self

    def _recording(self, kind, original):
        def record(output, input, *args, **kwargs):
            self.calls.append((kind, output.numel(), input.dtype))
            self.events.append((kind, output.numel()))
            return original(output, input, *args, **kwargs)
        return record

    def __exit__(self, *exc):
        for kind, name in self.names.items():
            setattr(dist, name, self.originals[kind])
        if self.data_check is None:
            os.environ.pop("MESHRUN_DATA_CHECK", None)
        else:
            os.environ["MESHRUN_DATA_CHECK"] = self.data_check

    def count(self, kind):
        return sum(1 for k, *_ in self.calls if k == kind)


def train(ctx, *, tied=False, steps=STEPS, accumulate=1, mp=None, ref_dtype=None, tol=None,
          param_tol=None, with_ddp=False, optimizer_before=False, **shard_kwargs):
    """Train fully_shard and the reference side by side, comparing every step.

    ``tol``: assert_close tolerances of losses and gradients (and of parameters unless
    ``param_tol`` is given)."""
    tol = tol or {}
    param_tol = param_tol or tol
    torch.manual_seed(0)
    model = Net(tied=tied)
    ref = copy.deepcopy(model)
    ddp_model = ddp(copy.deepcopy(model)) if with_ddp else None
    if optimizer_before:  # Adam's state is created lazily, on the shards
        opt = torch.optim.Adam(model.parameters(), lr=LR)
    shard(model, mp_policy=mp, **shard_kwargs)
    if not optimizer_before:
        opt = torch.optim.Adam(model.parameters(), lr=LR)
    ref_opt = torch.optim.Adam(ref.parameters(), lr=LR)
    ddp_opt = torch.optim.Adam(ddp_model.parameters(), lr=LR) if with_ddp else None
    for step in range(steps):
        opt.zero_grad()
        ref_opt.zero_grad()
        if with_ddp:
            ddp_opt.zero_grad()
        for micro in range(accumulate):
            idx, tgt = batch(10 * step + micro)
            model.set_requires_gradient_sync(micro == accumulate - 1)
            loss = model(my_slice(idx, ctx), my_slice(tgt, ctx))
            loss.backward()
            ref_loss = reference_backward(ref, idx, tgt, ref_dtype)
            close(mean_over_ranks(loss), ref_loss, f"step {step} micro {micro} loss", **tol)
            if with_ddp:
                ddp_model(my_slice(idx, ctx), my_slice(tgt, ctx)).backward()
        compare_shards(model, ref, ctx, f"step {step} before opt", **tol)
        opt.step()
        ref_opt.step()
        compare_shards(model, ref, ctx, f"step {step} after opt", grads=False, **param_tol)
        if with_ddp:
            ddp_opt.step()
            compare_shards(model, ddp_model, ctx, f"step {step} vs ddp", grads=False)
    return model, ref


def reference_backward(ref, idx, tgt, dtype):
    """Reference backward on the global batch; with ``dtype``, compute in it (fp32 masters)."""
    if dtype is None:
        loss = ref(idx, tgt)
        loss.backward()
        return loss.detach()
    low = copy.deepcopy(ref).to(dtype)
    loss = low(idx, tgt)
    loss.backward()
    for q, w in zip(ref.parameters(), low.parameters(), strict=True):
        g = w.grad.float()
        q.grad = g if q.grad is None else q.grad + g
    return loss.detach().float()


# -------------------------------------------------------------------------------------------
# checks


def check_parity_reshard(ctx):
    """ZeRO-3 == single process == meshrun ddp, every step, Adam, uneven sizes."""
    model, _ = train(ctx, reshard_after_forward=True, with_ddp=True)
    assert isinstance(model, FSDPModule) and isinstance(model.blocks[0], FSDPModule)


def check_parity_no_reshard(ctx):
    """ZeRO-2 (reshard_after_forward=False), optimizer built before fully_shard."""
    train(ctx, reshard_after_forward=False, optimizer_before=True)


def check_accumulation(ctx):
    """Two backwards without sync then one with: no reduce-scatter until the last."""
    with Collectives() as col:
        train(ctx, steps=1, accumulate=3)
    kinds = [k for k, *_ in col.calls]
    assert col.count("reduce_scatter") == 4, kinds  # 4 units, once, in the synced backward
    # 7 gathers per micro-batch (4 forward, 3 backward); none before the third backward
    assert kinds[:kinds.index("reduce_scatter")].count("gather") >= 2 * 7 + 4, kinds


def check_tied(ctx):
    """Tied embedding/head inside one call: one owner, parity (the grad sums both uses)."""
    model, _ = train(ctx, tied=True)
    assert model.head.weight is model.emb.weight
    names = [n for n, _ in model.named_parameters()]
    assert "head.weight" not in names and "emb.weight" in names, names


def check_shared_across_calls(ctx):
    torch.manual_seed(0)
    model = Net(tied=True)
    fully_shard(model.head)
    try:
        fully_shard(model)
    except ValueError as e:
        msg = str(e)
        assert "'emb.weight'" in msg and "'head.weight'" in msg and "one call" in msg, msg
    else:
        raise AssertionError("a parameter shared across two fully_shard calls must raise")
    model = Net()
    fully_shard(model)
    try:
        fully_shard(model.blocks[0])
    except ValueError as e:
        assert "bottom-up" in str(e) and "'ln.weight'" in str(e), e
    else:
        raise AssertionError("fully_shard top-down must raise")


def check_mixed_precision(ctx):
    """bf16 compute, fp32 reduce, fp32 masters: against a reference that also computes in bf16.

    Tolerance: both sides round activations and gradients to bf16 (8 bits of mantissa,
    relative 2**-8 = 0.4%), but at different points (per-rank slices of 4 vs the batch of 8;
    rank sums in fp32), so losses and gradients are compared at 1e-2 relative, not fp32's
    1e-5 (measured: they agree to 2e-3). Adam divides by sqrt(v): a gradient element within
    that noise of zero may flip sign and move its parameter by up to 2 * lr in one step, so
    parameters get atol = 2 * lr, and their mean deviation must stay under lr / 10.
    """
    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    with Collectives() as col:
        model, ref = train(ctx, mp=mp, ref_dtype=torch.bfloat16, tol=dict(rtol=1e-2, atol=5e-3),
                           param_tol=dict(rtol=0, atol=2 * LR))
    dtypes = {(kind, str(dtype)) for kind, _, dtype in col.calls}
    assert dtypes == {("gather", "torch.bfloat16"), ("reduce_scatter", "torch.float32")}, dtypes
    for p in model.parameters():
        assert p.dtype == torch.float32 and p.grad.dtype == torch.float32, (p.dtype, p.grad.dtype)
    diffs = [(p.detach() - rows(q.detach(), ctx)).abs().flatten()
             for p, q in zip(model.parameters(), ref.parameters(), strict=True)]
    mean = torch.cat(diffs).mean().item()
    assert mean < LR / 10, f"mean |param - ref| {mean} >= lr/10"


def check_collective_counts(ctx):
    """Per step: one gather per unit in forward, one per resharded unit in backward, one
    reduce-scatter per unit; no_grad forward: gathers only. 3 blocks + root = 4 units."""
    x, y = batch(0)
    for reshard, gathers in ((True, 4 + 3), (False, 4)):
        torch.manual_seed(0)
        model = shard(Net(), reshard_after_forward=reshard)
        for _ in range(2):  # the first step, and one with prefetching
            with Collectives() as col:
                model(my_slice(x, ctx), my_slice(y, ctx)).backward()
            assert (col.count("gather"), col.count("reduce_scatter")) == (gathers, 4), col.calls
        with Collectives() as col, torch.no_grad():
            model(my_slice(x, ctx), my_slice(y, ctx))
        assert (col.count("gather"), col.count("reduce_scatter")) == (4, 0), col.calls


def check_prefetch(ctx):
    """From the second step on: block i+1's gather is issued before block i's forward ends,
    and in backward block i-1's gather is issued before block i's backward ends (its first
    layer's input gradient; without prefetch it would come after)."""
    torch.manual_seed(0)
    model = shard(Net())
    numel = {name: m._fsdp_unit.world_size * m._fsdp_unit.layout.shard_numel
             for name, m in model.named_modules() if isinstance(m, FSDPModule)}
    assert len(set(numel.values())) == len(numel), numel  # each unit has its own gather size
    events = []
    for i, block in enumerate(model.blocks):
        block.register_forward_hook(lambda m, a, o, i=i: events.append(("end", i)))
        block.fc1.register_full_backward_hook(lambda m, gi, go, i=i: events.append(("bwd", i)))
    x, y = batch(0)
    for attempt in range(2):
        events.clear()
        with Collectives(events):
            model(my_slice(x, ctx), my_slice(y, ctx)).backward()
        if attempt == 0:
            continue
        gathers = {name: [j for j, e in enumerate(events) if e == ("gather", n)]
                   for name, n in numel.items()}
        for i in range(len(model.blocks)):
            assert len(gathers[f"blocks.{i}"]) == 2, events  # forward, and again in backward
            if i + 1 < len(model.blocks):  # [0]: the forward gather of the next block
                assert gathers[f"blocks.{i + 1}"][0] < events.index(("end", i)), (i, events)
            if i > 0:  # [1]: the backward gather of the previous block
                assert gathers[f"blocks.{i - 1}"][1] < events.index(("bwd", i)), (i, events)


def check_memory(ctx):
    """After a step: no unsharded storage alive; each rank holds ~1/N of params and state.

    Two views: the units' own tensors (freed storage), and every tensor storage the garbage
    collector can reach, measured before the model exists and after each step: the growth must
    be the shards + gradients + Adam state, with less slack than the smallest unit's unsharded
    parameters (so one leaked unsharded unit, or a leaked gather buffer, fails)."""
    make = functools.partial(Net, width=64, hidden=301)  # ~41K parameters per block
    torch.manual_seed(0)
    total = sum(p.numel() for p in make().parameters())
    x, y = batch(0)
    baseline = live_tensor_bytes()
    torch.manual_seed(0)
    model = shard(make())
    opt = torch.optim.Adam(model.parameters(), lr=LR)
    units = [m._fsdp_unit for m in model.modules() if isinstance(m, FSDPModule)]
    smallest_unit = min(4 * sum(s.shape.numel() for s in u.layout.slots) for u in units)
    for step in range(2):
        loss = model(my_slice(x, ctx), my_slice(y, ctx))
        for unit in units:  # ZeRO-3: blocks freed after forward, the root kept for backward
            alive = [t.untyped_storage().nbytes() > 0 for t in unit.full]
            assert all(alive) if unit is units[0] else not any(alive), (step, alive)
        opt.zero_grad()
        loss.backward()
        opt.step()
        del loss
        for unit in units:
            assert unit.gather is None and unit.grad_accum is None
            assert all(t.untyped_storage().nbytes() == 0 for t in unit.full), "unsharded alive"
        local = sum(p.numel() for p in model.parameters())
        held = 4 * (sum(u.layout.shard_numel for u in units) * 2 + 2 * local)  # + grads, Adam
        grown = live_tensor_bytes() - baseline
        assert grown < held + smallest_unit / 2, (
            f"step {step}: tensors grew by {grown} B; shards + grads + Adam state are {held} B, "
            f"the smallest unit unsharded {smallest_unit} B")
    grads = sum(p.grad.numel() for p in model.parameters())
    state = sum(t.numel() for s in opt.state.values() for t in s.values() if t.dim() > 0)
    counts = torch.tensor([local])
    dist.all_reduce(counts)
    assert counts.item() == total, (counts.item(), total)  # shards partition the model
    padded = sum(u.layout.shard_numel for u in units)
    one_row_each = sum(slot.row_numel for u in units for slot in u.layout.slots)
    assert local <= padded <= total / ctx.world_size + one_row_each, (local, padded, total)
    assert grads == local and state == 2 * local, (grads, state, local)
    print(f"check_memory rank {ctx.rank}: tensors grew {grown} B for a model of {4 * total} B "
          f"(shards + grads + Adam {held} B)", flush=True)


def live_tensor_bytes():
    """Bytes of every distinct tensor storage reachable by the garbage collector."""
    gc.collect()
    storages = {}
    for obj in gc.get_objects():
        if torch.is_tensor(obj) and not isinstance(obj, DTensor):
            storage = obj.untyped_storage()
            storages[storage.data_ptr()] = storage.nbytes()
    return sum(storages.values())


def check_clip_grad_norm(ctx):
    for norm_type in (2.0, float("inf")):
        torch.manual_seed(0)
        model = Net()
        ref = copy.deepcopy(model)
        shard(model)
        x, y = batch(3)
        model(my_slice(x, ctx), my_slice(y, ctx)).backward()
        ref(x, y).backward()
        norm = clip_grad_norm_(model.parameters(), 0.05, norm_type)
        ref_norm = torch.nn.utils.clip_grad_norm_(ref.parameters(), 0.05, norm_type)
        assert ref_norm > 0.05, ref_norm  # it does clip
        close(norm, ref_norm, f"total norm {norm_type}")
        compare_shards(model, ref, ctx, f"clipped {norm_type}")


def results_dir(name):
    path = Path(os.environ[RESULTS_ENV]) / name
    path.mkdir(exist_ok=True)
    return path


def check_sharded_state_dict(ctx):
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    model, ref = train(ctx, tied=True, steps=1)
    sd = model.state_dict()
    assert list(sd) == list(ref.state_dict()), (list(sd), list(ref.state_dict()))
    for key, value in sd.items():
        full = ref.state_dict()[key]
        assert isinstance(value, DTensor) and tuple(value.placements) == (Shard(0),), key
        assert value.shape == full.shape, (key, value.shape, full.shape)
        close(value.to_local(), rows(full, ctx), f"local {key}")
    ckpt = results_dir("dcp")
    dcp.save(sd, checkpoint_id=str(ckpt))
    saved = {n: p.detach().clone() for n, p in model.named_parameters()}
    x, y = batch(50)
    model(my_slice(x, ctx), my_slice(y, ctx)).backward()
    torch.optim.SGD(model.parameters(), lr=1.0).step()  # move away from the checkpoint
    target = model.state_dict()
    dcp.load(target, checkpoint_id=str(ckpt))  # in place, into the shards
    for name, p in model.named_parameters():
        close(p.detach(), saved[name], f"after dcp.load {name}")
    fresh = shard(Net(tied=True))  # another init: load_state_dict of DTensors
    fresh.load_state_dict(model.state_dict())
    compare_shards(fresh, ref, ctx, "load_state_dict(sharded)", grads=False)
    dist.barrier()
    if ctx.rank == 0:  # DCP reshards: the same checkpoint read back as full tensors
        dcp_to_torch_save(str(ckpt), str(ckpt / "full.pt"))
        full = torch.load(ckpt / "full.pt")
        for key, value in ref.state_dict().items():
            close(full[key], value, f"dcp_to_torch_save {key}")


def check_full_state_dict(ctx):
    model, ref = train(ctx, tied=True, steps=1)
    full = full_state_dict(model)
    if ctx.rank == 0:
        assert list(full) == list(ref.state_dict()), list(full)
        for key, value in ref.state_dict().items():
            assert full[key].device.type == "cpu" and not isinstance(full[key], DTensor), key
            close(full[key], value, f"full {key}")
        torch.save(full, results_dir("full") / "model.pt")
    else:
        assert full == {}, list(full)
    dist.barrier()
    torch.manual_seed(1 + ctx.rank)  # different init everywhere: the load must overwrite it
    fresh = shard(Net(tied=True))
    fresh.load_state_dict(torch.load(results_dir("full") / "model.pt", mmap=True))
    compare_shards(fresh, ref, ctx, "load_state_dict(full)", grads=False)


def check_two_forwards(ctx):
    """Two ZeRO-3 forwards, one backward of the sum: both graphs re-gather what they saved."""
    torch.manual_seed(0)
    model = Net()
    ref = copy.deepcopy(model)
    shard(model)
    for step in range(2):
        (x1, y1), (x2, y2) = batch(step), batch(step + 50)
        loss = (model(my_slice(x1, ctx), my_slice(y1, ctx))
                + model(my_slice(x2, ctx), my_slice(y2, ctx)))
        loss.backward()
        (ref(x1, y1) + ref(x2, y2)).backward()
        compare_shards(model, ref, ctx, f"step {step}")


def check_frozen(ctx):
    """requires_grad=False parameters inside a unit: no grad, not stepped, others exact."""
    torch.manual_seed(0)
    model = Net()
    model.blocks[1].fc1.weight.requires_grad_(False)
    model.emb.weight.requires_grad_(False)
    ref = copy.deepcopy(model)
    shard(model)
    opt = torch.optim.Adam([p for p in model.parameters() if p.requires_grad], lr=LR)
    ref_opt = torch.optim.Adam([p for p in ref.parameters() if p.requires_grad], lr=LR)
    for step in range(2):
        x, y = batch(step)
        opt.zero_grad()
        ref_opt.zero_grad()
        model(my_slice(x, ctx), my_slice(y, ctx)).backward()
        ref(x, y).backward()
        assert model.emb.weight.grad is None and model.blocks[1].fc1.weight.grad is None
        opt.step()
        ref_opt.step()
        for (name, p), q in zip(model.named_parameters(), ref.parameters(), strict=True):
            close(p.detach(), rows(q.detach(), ctx), f"step {step} param {name}")
            if p.requires_grad:
                close(p.grad, rows(q.grad, ctx), f"step {step} grad {name}")


def check_mesh_group(ctx):
    """An explicit group from a Mesh axis (the dp axis of a 1-D mesh here)."""
    from meshrun.parallel import Mesh

    mesh = Mesh({"dp": ctx.world_size})
    train(ctx, steps=2, group=mesh.group("dp"))


def check_matches_torch_fsdp2(ctx):
    """Same shards as torch FSDP2 after Adam steps; a meshrun DCP checkpoint loads into FSDP2."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard as torch_fully_shard

    torch.manual_seed(0)
    model = Net(tied=True)
    theirs = copy.deepcopy(model)
    shard(model)
    mesh = init_device_mesh("cpu", (ctx.world_size,))
    for block in theirs.blocks:
        torch_fully_shard(block, mesh=mesh)
    torch_fully_shard(theirs, mesh=mesh)
    opts = [torch.optim.Adam(m.parameters(), lr=LR) for m in (model, theirs)]
    for step in range(STEPS):
        x, y = batch(step)
        for m, opt in zip((model, theirs), opts, strict=True):
            opt.zero_grad()
            m(my_slice(x, ctx), my_slice(y, ctx)).backward()
            opt.step()
        for (name, p), q in zip(model.named_parameters(), theirs.parameters(), strict=True):
            close(p.detach(), q.detach().to_local(), f"step {step} vs FSDP2 {name}")
    ckpt = results_dir("dcp_fsdp2")
    dcp.save(model.state_dict(), checkpoint_id=str(ckpt))
    torch.manual_seed(7)
    fresh = Net(tied=True)
    for block in fresh.blocks:
        torch_fully_shard(block, mesh=mesh)
    torch_fully_shard(fresh, mesh=mesh)
    sd = fresh.state_dict()
    dcp.load(sd, checkpoint_id=str(ckpt))
    fresh.load_state_dict(sd)
    for (name, p), q in zip(model.named_parameters(), fresh.parameters(), strict=True):
        close(p.detach(), q.detach().to_local(), f"FSDP2 loaded from meshrun checkpoint: {name}")


CHECKS = [check_parity_reshard, check_parity_no_reshard, check_accumulation, check_tied,
          check_shared_across_calls, check_mixed_precision, check_collective_counts,
          check_prefetch, check_memory, check_clip_grad_norm, check_sharded_state_dict,
          check_full_state_dict, check_two_forwards, check_frozen, check_mesh_group,
          check_matches_torch_fsdp2]


def main():
    run_checks(CHECKS)


if __name__ == "__main__":
    main()
