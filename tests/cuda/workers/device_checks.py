"""Strategy checks that put every model and batch on ``ctx.device`` (``cuda:<local rank>``
under nccl), so any tensor the library makes on the CPU by itself meets an NCCL collective or
a CUDA tensor and fails. Also runs on CPU with gloo (device ``cpu``).

Usage: ``device_checks.py [name ...]`` (default: every check the world size allows). Each
check compares with a one-process reference on the same device and reports "ok" or the
traceback under its name (tests/parallel/harness.py `run_checks`).
"""

import copy
import sys
import tempfile

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from meshrun.parallel import (
    ColwiseParallel,
    Mesh,
    PipelineStage,
    RowwiseParallel,
    ScheduleGPipe,
    agree_num_batches,
    checkpoint,
    clip_grad_norm_,
    ddp,
    full_state_dict,
    full_tensor,
    fully_shard,
    init,
    parallelize,
    vocab_parallel_cross_entropy,
)
from tests.parallel.harness import run_checks

STEPS = 3
BATCH = 8


def close(a, b, what, atol=1e-5, rtol=1e-4):
    if a.device != b.device:
        raise AssertionError(f"{what}: on {a.device}, the reference on {b.device}")
    if not torch.allclose(a, b, atol=atol, rtol=rtol):
        raise AssertionError(f"{what}: max |diff| {(a - b).abs().max().item():.3g}")


def data(step, device, n=BATCH, dim=8, out=4):
    g = torch.Generator().manual_seed(1000 + step)  # CPU draws, then moved: same everywhere
    return torch.randn(n, dim, generator=g).to(device), torch.randn(n, out, generator=g).to(device)


def my_slice(t, ctx):
    per = t.shape[0] // ctx.world_size
    return t[ctx.rank * per:(ctx.rank + 1) * per]


def mlp(device, width=16):
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, width), nn.Tanh(), nn.Linear(width, width), nn.Tanh(),
                         nn.Linear(width, 4)).to(device)


def on_device(ctx, module):
    for name, t in [*module.named_parameters(), *module.named_buffers()]:
        assert t.device == ctx.device, f"{name} on {t.device}, expected {ctx.device}"


class WithUnused(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(8, 4)
        self.never = nn.Linear(8, 4)  # no gradient anywhere: ddp's used-flags all-reduce
        self.register_buffer("scale", torch.full((4,), 0.5))  # broadcast every forward

    def forward(self, x):
        return self.fc(x) * self.scale


def check_backend(ctx):
    """init() picks nccl and this rank's GPU when CUDA is there (gloo and the CPU otherwise)."""
    if torch.cuda.is_available():
        assert ctx.backend == "nccl", ctx.backend
        assert ctx.device == torch.device("cuda", ctx.local_rank), ctx.device
        assert torch.cuda.current_device() == ctx.local_rank, torch.cuda.current_device()
    else:
        assert (ctx.backend, ctx.device.type) == ("gloo", "cpu"), (ctx.backend, ctx.device)


def check_ddp(ctx):
    model, ref = mlp(ctx.device), mlp(ctx.device)
    ddp(model, None)
    on_device(ctx, model)
    opt, ref_opt = (torch.optim.SGD(m.parameters(), lr=0.1) for m in (model, ref))
    for step in range(STEPS):
        x, y = data(step, ctx.device)
        opt.zero_grad()
        F.mse_loss(model(my_slice(x, ctx)), my_slice(y, ctx)).backward()
        ref_opt.zero_grad()
        F.mse_loss(ref(x), y).backward()
        for (name, p), q in zip(model.named_parameters(), ref.parameters(), strict=True):
            close(p.grad, q.grad, f"step {step} grad {name}")
        opt.step()
        ref_opt.step()
    torch.manual_seed(0)
    unused = ddp(WithUnused().to(ctx.device), None, find_unused_parameters=True)
    for step in range(2):  # the second backward also rebuilds the buckets (a broadcast)
        x, y = data(step, ctx.device)
        F.mse_loss(unused(my_slice(x, ctx)), my_slice(y, ctx)).backward()
    assert unused.never.weight.grad is None
    assert agree_num_batches(5 + ctx.rank) == 5


def check_fsdp(ctx):
    torch.manual_seed(0)
    full = mlp(ctx.device)
    ref = copy.deepcopy(full)
    for i in (0, 2, 4):
        fully_shard(full[i])
    fully_shard(full)
    on_device(ctx, full)
    opt = torch.optim.Adam(full.parameters(), lr=1e-2)
    ref_opt = torch.optim.Adam(ref.parameters(), lr=1e-2)
    for step in range(STEPS):
        x, y = data(step, ctx.device)
        opt.zero_grad()
        F.mse_loss(full(my_slice(x, ctx)), my_slice(y, ctx)).backward()
        norm = clip_grad_norm_(full.parameters(), 0.5)
        ref_opt.zero_grad()
        F.mse_loss(ref(x), y).backward()
        ref_norm = torch.nn.utils.clip_grad_norm_(ref.parameters(), 0.5)
        close(norm, ref_norm, f"step {step} grad norm")
        opt.step()
        ref_opt.step()
    state = full_state_dict(full)
    if ctx.rank == 0:
        for key, value in ref.state_dict().items():
            close(state[key], value.cpu(), f"full_state_dict {key}")


def check_tp_padded_vocab(ctx):
    """A 65-row vocabulary over 2 ranks: the padded logit of rank 1 is -inf (the pad mask)."""
    torch.manual_seed(0)
    head = nn.Sequential(nn.Linear(4, 65)).to(ctx.device)
    ref = copy.deepcopy(head)
    parallelize(head, None, {"0": ColwiseParallel(vocab_parallel=True)})
    on_device(ctx, head)
    x = torch.randn(3, 4, device=ctx.device)
    target = torch.randint(0, 65, (3,), device=ctx.device)
    logits = head(x)
    assert logits.device == ctx.device, logits.device
    padded = ctx.rank == ctx.world_size - 1 and 65 % ctx.world_size
    assert bool(torch.isinf(logits[:, -1]).all()) == bool(padded), logits[:, -1]
    loss = vocab_parallel_cross_entropy(logits, target, None)
    loss.backward()
    ref_loss = F.cross_entropy(ref(x), target)
    ref_loss.backward()
    close(loss.detach(), ref_loss.detach(), "vocab-parallel loss")
    close(full_tensor(head[0].weight, head[0].weight.grad), ref[0].weight.grad, "head grad")
    emb = nn.Sequential(nn.Embedding(65, 4)).to(ctx.device)
    ref_emb = copy.deepcopy(emb)
    parallelize(emb, None, {"0": RowwiseParallel()})
    ids = torch.randint(0, 65, (2, 5), device=ctx.device)
    close(emb(ids), ref_emb(ids), "vocab-parallel embedding")


def check_tp_mlp(ctx):
    model, ref = mlp(ctx.device), mlp(ctx.device)
    parallelize(model, None, {"0": ColwiseParallel(), "2": RowwiseParallel()})
    on_device(ctx, model)
    for step in range(STEPS):
        x, y = data(step, ctx.device)
        model.zero_grad()
        ref.zero_grad()
        F.mse_loss(model(x), y).backward()
        F.mse_loss(ref(x), y).backward()
        for (name, p), q in zip(model.named_parameters(), ref.parameters(), strict=True):
            grad = full_tensor(p, p.grad) if hasattr(p, "_meshrun_tp_spec") else p.grad
            close(grad, q.grad, f"step {step} grad {name}")


def check_pp(ctx):
    """Two stages on two ranks; the last has no parameters (it must still receive on the
    group's device)."""
    assert ctx.world_size == 2, "check_pp needs 2 ranks"
    torch.manual_seed(0)
    first = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 4)).to(ctx.device)
    ref = copy.deepcopy(first)
    modules = [first, nn.Tanh()]
    stage = PipelineStage(modules[ctx.rank], ctx.rank, 2)
    assert stage.device == ctx.device, (stage.device, ctx.device)
    schedule = ScheduleGPipe(stage, 4, F.mse_loss)
    opt = torch.optim.SGD(first.parameters(), lr=0.1)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    for step in range(STEPS):
        x, y = data(step, ctx.device)
        losses = []
        opt.zero_grad()
        out = schedule.step(x, target=y, losses=losses)
        ref_opt.zero_grad()
        ref_out = torch.tanh(ref(x))
        ref_loss = F.mse_loss(ref_out, y)
        ref_loss.backward()
        if ctx.rank == 1:
            close(out, ref_out.detach(), f"step {step} output")
            close(torch.stack(losses).mean(), ref_loss.detach(), f"step {step} loss")
        else:
            for (name, p), q in zip(first.named_parameters(), ref.parameters(), strict=True):
                close(p.grad, q.grad, f"step {step} grad {name}")
            opt.step()
        ref_opt.step()


def check_clip_mesh(ctx):
    mesh = Mesh({"dp": ctx.world_size})
    model, ref = mlp(ctx.device), mlp(ctx.device)
    ddp(model, mesh.group("dp"))
    x, y = data(0, ctx.device)
    F.mse_loss(model(my_slice(x, ctx)), my_slice(y, ctx)).backward()
    F.mse_loss(ref(x), y).backward()
    norm = clip_grad_norm_(list(model.parameters()), 0.1, mesh=mesh)
    close(norm, torch.nn.utils.clip_grad_norm_(ref.parameters(), 0.1), "mesh grad norm")


def check_checkpoint(ctx):
    """Save ddp + Adam state, scramble it, load it back (a collective on every rank)."""
    model = mlp(ctx.device)
    ddp(model, None)
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    x, y = data(0, ctx.device)
    F.mse_loss(model(my_slice(x, ctx)), my_slice(y, ctx)).backward()
    opt.step()
    saved = {k: v.clone() for k, v in model.state_dict().items()}
    box = [tempfile.mkdtemp(prefix="meshrun-cuda-ckpt-") if ctx.rank == 0 else None]
    dist.broadcast_object_list(box, group_src=0)
    state = {"model": checkpoint.model_state(model), "step": 3,
             "optim": checkpoint.optimizer_state(opt, model)}
    checkpoint.save(state, f"{box[0]}/step_3")
    with torch.no_grad():
        for p in model.parameters():
            p.add_(1.0)
    state["step"] = 0
    checkpoint.load(state, checkpoint.latest(box[0]))
    assert state["step"] == 3, state["step"]
    for key, value in model.state_dict().items():
        assert value.device == ctx.device, f"{key} loaded onto {value.device}"
        close(value, saved[key], f"loaded {key}", atol=0, rtol=0)


ALL = [check_backend, check_ddp, check_fsdp, check_tp_mlp, check_tp_padded_vocab, check_pp,
       check_clip_mesh, check_checkpoint]
NEEDS_TWO = {"check_pp"}


def main():
    ctx = init(timeout=60)
    names = sys.argv[1:]
    checks = [c for c in ALL if c.__name__ in names] if names else [
        c for c in ALL if ctx.world_size >= 2 or c.__name__ not in NEEDS_TWO]
    if names and len(checks) != len(names):
        raise SystemExit(f"unknown checks in {names}; known: {[c.__name__ for c in ALL]}")
    run_checks(checks)


if __name__ == "__main__":
    main()
