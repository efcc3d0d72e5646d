"""Tensor-parallel checks, run on every rank of a 2-process gloo group (one launch for all).

Each check reports "ok" or the failure text under its name. The reference is the same model
(same initial weights) in one process on the same batch: outputs, input gradients, parameter
gradients (gathered with `full_tensor`) and parameters after an optimizer step must match.
Under sequence parallelism the TP model takes and returns this rank's sequence shard; each
rank's loss is the sum over its own tokens, and the reference's is the sum over all tokens.
Collectives are counted by wrapping the c10d functions (the real ones run underneath).
"""

import copy
import sys
from functools import partial
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import Replicate, Shard

from meshrun.parallel import (
    ColwiseParallel,
    Mesh,
    PrepareModuleOutput,
    RNGTracker,
    RowwiseParallel,
    SequenceParallel,
    ShardedDropout,
    full_tensor,
    parallelize,
    vocab_parallel_cross_entropy,
)
from tests.parallel.harness import run_checks

sys.path.insert(0, str(Path(__file__).resolve().parents[3] / "examples"))
import char_lm as lm  # noqa: E402

B, T, C = 2, 8, 16
TOL = dict(atol=2e-5, rtol=1e-4)


# -------------------------------------------------------------------------------------------
# models


class MLPBlock(nn.Module):
    def __init__(self, c=C):
        super().__init__()
        self.ln = nn.LayerNorm(c)
        self.fc1 = nn.Linear(c, 4 * c)
        self.fc2 = nn.Linear(4 * c, c)

    def forward(self, x):
        return x + self.fc2(F.gelu(self.fc1(self.ln(x))))


class AttentionBlock(nn.Module):
    """The attention half of the example's Block (fused qkv, causal, 4 heads)."""

    def __init__(self, c=C, n_head=4):
        super().__init__()
        self.head_dim = c // n_head
        self.ln = nn.LayerNorm(c)
        self.qkv = nn.Linear(c, 3 * c)
        self.proj = nn.Linear(c, c)

    def forward(self, x):
        qkv = self.qkv(self.ln(x))
        b, t, _ = qkv.shape
        q, k, v = (z.view(b, t, -1, self.head_dim).transpose(1, 2) for z in qkv.chunk(3, dim=2))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return x + self.proj(y.transpose(1, 2).reshape(b, t, -1))


def mlp_plan(sp):
    seq = Shard(1) if sp else Replicate()
    plan = {"fc1": ColwiseParallel(input_layouts=seq), "fc2": RowwiseParallel(output_layouts=seq)}
    if sp:
        plan["ln"] = SequenceParallel()
    return plan


def attention_plan(sp):
    seq = Shard(1) if sp else Replicate()
    plan = {"qkv": ColwiseParallel(input_layouts=seq, chunks=3),
            "proj": RowwiseParallel(output_layouts=seq)}
    if sp:
        plan["ln"] = SequenceParallel()
    return plan


def small_lm():
    return lm.CharLM(65, 16, n_layer=2, n_head=4, n_embd=32)  # Tiny Shakespeare's 65 chars


# -------------------------------------------------------------------------------------------
# helpers


def close(a, b, what, **tol):
    torch.testing.assert_close(a, b, msg=lambda m: f"{what}: {m}", **(tol or TOL))


def seq_shard(t, rank, world=2, dim=1):
    return t.chunk(world, dim)[rank]


def gather_seq(t, world=2, dim=1):
    parts = [torch.empty_like(t) for _ in range(world)]
    dist.all_gather(parts, t.detach().contiguous())
    return torch.cat(parts, dim)


def compare_params(model, ref, what, grads=True):
    for (name, p), (rname, q) in zip(model.named_parameters(), ref.named_parameters(),
                                     strict=True):
        assert name == rname, (name, rname)
        if grads:
            close(full_tensor(p, p.grad), q.grad, f"{what}: grad {name}")
        close(full_tensor(p), q.detach(), f"{what}: param {name}")


class CountCollectives:
    """Wrap c10d's collectives to record (name, numel) of each call; the real ones run."""

    NAMES = ("all_reduce", "all_gather_single", "all_gather_into_tensor", "reduce_scatter_single",
             "reduce_scatter_tensor", "all_gather", "broadcast")

    def __enter__(self):
        self.calls, self.originals = [], {}
        for name in self.NAMES:
            original = getattr(dist, name, None)
            if original is None:
                continue
            self.originals[name] = original

            def counting(tensor, *args, _name=name, _original=original, **kwargs):
                numel = tensor.numel() if isinstance(tensor, torch.Tensor) else None
                if _name.startswith("all_gather_"):
                    numel = args[0].numel()  # the input (one rank's part)
                kind = _name.replace("_single", "").replace("_into_tensor", "").replace(
                    "_tensor", "")
                self.calls.append((kind, numel))
                return _original(tensor, *args, **kwargs)

            setattr(dist, name, counting)
        return self

    def __exit__(self, *exc):
        for name, original in self.originals.items():
            setattr(dist, name, original)

    def kinds(self, start, end, min_numel):
        out = {}
        for kind, numel in self.calls[start:end]:
            if numel is None or numel >= min_numel:
                out[kind] = out.get(kind, 0) + 1
        return out


def block_parity(make, plan_fn, ctx, sp, steps=2):
    """Outputs, input grads, param grads and params after SGD steps vs the reference."""
    torch.manual_seed(0)
    model = make()
    ref = copy.deepcopy(model)
    parallelize(model, None, plan_fn(sp))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    for step in range(steps):
        g = torch.Generator().manual_seed(100 + step)
        x, w = torch.randn(B, T, C, generator=g), torch.randn(B, T, C, generator=g)
        xr = x.clone().requires_grad_()
        yr = ref(xr)
        (yr * w).sum().backward()
        xin = (seq_shard(x, ctx.rank) if sp else x).clone().requires_grad_()
        y = model(xin)
        (y * (seq_shard(w, ctx.rank) if sp else w)).sum().backward()
        close(gather_seq(y) if sp else y, yr.detach(), f"step {step} output")
        close(xin.grad, seq_shard(xr.grad, ctx.rank) if sp else xr.grad,
              f"step {step} input grad")
        compare_params(model, ref, f"step {step}")
        opt.step()
        ref_opt.step()
        opt.zero_grad()
        ref_opt.zero_grad()
        compare_params(model, ref, f"after step {step}", grads=False)
    return model


def lm_parity(ctx, sp, steps=2):
    torch.manual_seed(0)
    model = small_lm()
    ref = copy.deepcopy(model)
    parallelize(model, None, lm.tp_plan(sp))
    model.loss_fn = partial(vocab_parallel_cross_entropy, group=None)
    # SGD, not Adam: the key bias's true gradient is 0 (softmax ignores a per-row shift), and
    # Adam's first step, lr * g / |g|, would turn float32 rounding noise into +-lr
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9, weight_decay=0.1)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1, momentum=0.9, weight_decay=0.1)
    vocab = 65
    for step in range(steps):
        g = torch.Generator().manual_seed(200 + step)
        idx, tgt = torch.randint(vocab, (B, 16), generator=g), torch.randint(vocab, (B, 16),
                                                                             generator=g)
        ref_loss = ref(idx, tgt)
        ref_loss.backward()
        with CountCollectives() as counter:
            loss = model(idx, tgt)
            loss.backward()
        biggest = max(n for _, n in counter.calls if n is not None)
        assert biggest < B * 16 * vocab, f"a collective moved {biggest} >= B*T*V elements"
        close(loss.detach(), ref_loss.detach(), f"step {step} loss")
        compare_params(model, ref, f"step {step}")
        opt.step()
        ref_opt.step()
        opt.zero_grad()
        ref_opt.zero_grad()
        compare_params(model, ref, f"after step {step}", grads=False)
    return model


def expect_error(fn, exc, *fragments):
    try:
        fn()
    except exc as e:
        for fragment in fragments:
            assert fragment in str(e), f"{fragment!r} not in: {e}"
    else:
        raise AssertionError(f"expected {exc.__name__} with {fragments}")


# -------------------------------------------------------------------------------------------
# checks


def check_mlp(ctx):
    model = block_parity(MLPBlock, mlp_plan, ctx, sp=False)
    for name, p in model.named_parameters():  # a shard owns its storage (the full one is freed)
        assert p.untyped_storage().nbytes() == p.numel() * p.element_size(), name
    assert model.fc1.weight.shape == (2 * C, C) and model.fc2.weight.shape == (C, 2 * C)


def check_mlp_sp(ctx):
    block_parity(MLPBlock, mlp_plan, ctx, sp=True)


def check_attention(ctx):
    model = block_parity(AttentionBlock, attention_plan, ctx, sp=False)
    assert model.qkv.weight.shape == (3 * C // 2, C)


def check_attention_sp(ctx):
    block_parity(AttentionBlock, attention_plan, ctx, sp=True)


def check_char_lm(ctx):
    model = lm_parity(ctx, sp=False)
    assert model.tok_emb.weight.shape == (33, 32), model.tok_emb.weight.shape  # 65 -> 66 / 2
    assert model.head.weight.shape == (33, 32) and model.head.bias.shape == (33,)
    assert full_tensor(model.head.weight).shape == (65, 32)


def check_char_lm_sp(ctx):
    lm_parity(ctx, sp=True)


def check_vocab_loss(ctx):
    """== F.cross_entropy (mean/sum/none, ignore_index, -inf padding); 2 small all-reduces."""
    g = torch.Generator().manual_seed(7)
    n, vocab = 12, 65
    logits = torch.randn(n, vocab, generator=g) * 3
    target = torch.randint(vocab, (n,), generator=g)
    target[[0, 5]] = -100
    padded = torch.cat([logits, torch.full((n, 1), float("-inf"))], 1)  # 66 = 2 x 33
    for reduction in ("mean", "sum", "none"):
        ref_in = logits.clone().requires_grad_()
        ref = F.cross_entropy(ref_in, target, reduction=reduction)
        local = padded.chunk(2, 1)[ctx.rank].clone().requires_grad_()
        with CountCollectives() as counter:
            loss = vocab_parallel_cross_entropy(local, target, None, reduction=reduction)
            forward_calls = list(counter.calls)
            loss.backward(torch.ones_like(loss))
        ref.backward(torch.ones_like(ref))
        close(loss.detach(), ref.detach(), f"{reduction} loss")
        close(local.grad, torch.cat([ref_in.grad, torch.zeros(n, 1)], 1).chunk(2, 1)[ctx.rank],
              f"{reduction} grad")
        assert forward_calls == [("all_reduce", n), ("all_reduce", 2 * n)], forward_calls
        assert counter.calls == forward_calls, f"backward communicated: {counter.calls}"
    expect_error(lambda: vocab_parallel_cross_entropy(local, target[:3], None), ValueError,
                 "target shape")


def check_collective_counts(ctx):
    """Per transformer layer: 2 AR fwd + 2 AR bwd; SP: 2 AG + 2 RS fwd, 4 AG + 2 RS bwd."""
    activation = B * T * C // 2  # the smallest activation-sized message (a sequence shard)
    for sp, fwd_expected, bwd_expected, small_bwd in (
            (False, {"all_reduce": 2}, {"all_reduce": 2}, 0),
            (True, {"all_gather": 2, "reduce_scatter": 2},
             {"all_gather": 4, "reduce_scatter": 2}, 4)):
        torch.manual_seed(0)
        block = lm.Block(C, 4)
        seq = Shard(1) if sp else Replicate()
        plan = {"qkv": ColwiseParallel(input_layouts=seq, chunks=3),
                "proj": RowwiseParallel(output_layouts=seq),
                "mlp.0": ColwiseParallel(input_layouts=seq),
                "mlp.2": RowwiseParallel(output_layouts=seq)}
        if sp:
            plan.update({"ln1": SequenceParallel(), "ln2": SequenceParallel()})
        parallelize(block, None, plan)
        x = torch.randn(B, T // 2 if sp else T, C, requires_grad=True)
        with CountCollectives() as counter:
            y = block(x)
            mark = len(counter.calls)
            y.sum().backward()
        fwd = counter.kinds(0, mark, activation)
        bwd = counter.kinds(mark, None, activation)
        small = [c for c in counter.calls[mark:] if c[1] < activation]
        assert all(n >= activation for _, n in counter.calls[:mark]), counter.calls[:mark]
        assert fwd == fwd_expected, f"sp={sp} forward {fwd} (calls {counter.calls[:mark]})"
        assert bwd == bwd_expected, f"sp={sp} backward {bwd} (calls {counter.calls[mark:]})"
        assert len(small) == small_bwd and all(k == "all_reduce" for k, _ in small), small


def check_tied(ctx):
    """An embedding tied to the output layer: one vocab shard shared by both; parity."""

    class TiedLM(nn.Module):
        def __init__(self):
            super().__init__()
            self.emb = nn.Embedding(65, C)
            self.fc = nn.Linear(C, C)
            self.out = nn.Linear(C, 65, bias=False)
            self.out.weight = self.emb.weight

        def forward(self, idx):
            return self.out(torch.tanh(self.fc(self.emb(idx))))

    torch.manual_seed(0)
    model = TiedLM()
    ref = copy.deepcopy(model)
    parallelize(model, None, {"emb": RowwiseParallel(), "out": ColwiseParallel()})
    assert model.out.weight is model.emb.weight and model.emb.weight.shape == (33, C)
    opt, ref_opt = (torch.optim.SGD(m.parameters(), lr=0.1) for m in (model, ref))
    idx, tgt = torch.randint(65, (B, T)), torch.randint(65, (B, T))
    for step in range(2):
        loss = vocab_parallel_cross_entropy(model(idx), tgt, None)
        ref_loss = F.cross_entropy(ref(idx).flatten(0, 1), tgt.flatten())
        loss.backward()
        ref_loss.backward()
        close(loss.detach(), ref_loss.detach(), f"step {step} loss")
        compare_params(model, ref, f"step {step}")
        opt.step()
        ref_opt.step()
        opt.zero_grad()
        ref_opt.zero_grad()
    # tied to a module outside the plan, or sharded differently: refused, naming both
    bad = TiedLM()
    expect_error(lambda: parallelize(bad, None, {"emb": RowwiseParallel()}), ValueError,
                 "emb.weight", "out.weight", "not sharded by the plan")
    bad = TiedLM()
    expect_error(lambda: parallelize(bad, None, {"emb": ColwiseParallel(),
                                                 "out": ColwiseParallel(vocab_parallel=True)}),
                 ValueError, "emb.weight", "out.weight", "sharded differently")


def check_refusals(ctx):
    expect_error(lambda: parallelize(nn.Sequential(nn.Linear(4, 7)), None,
                                     {"0": ColwiseParallel()}),
                 ValueError, "0: out_features=7", "TP degree 2")
    expect_error(lambda: parallelize(nn.Sequential(nn.Linear(5, 4)), None,
                                     {"0": RowwiseParallel()}), ValueError, "in_features=5")
    expect_error(lambda: parallelize(MLPBlock(), None, {"blocks.*.fc1": ColwiseParallel()}),
                 ValueError, "'blocks.*.fc1' matches no submodule")
    expect_error(lambda: parallelize(MLPBlock(), None, {"ln": ColwiseParallel()}),
                 ValueError, "ln: ColwiseParallel applies to nn.Linear")
    expect_error(lambda: parallelize(MLPBlock(), None, {"fc*": ColwiseParallel(),
                                                        "fc2": RowwiseParallel()}),
                 ValueError, "matched by two plan keys")
    once = parallelize(MLPBlock(), None, mlp_plan(False))
    expect_error(lambda: parallelize(once, None, mlp_plan(False)), RuntimeError, "already")
    # padding: only vocabularies; a 65-row embedding is padded to 66 with zero rows
    emb = parallelize(nn.Sequential(nn.Embedding(65, 4)), None, {"0": RowwiseParallel()})[0]
    assert emb.weight.shape == (33, 4) and full_tensor(emb.weight).shape == (65, 4)
    if ctx.rank == 1:
        assert torch.all(emb.weight[-1] == 0), "the padded row must be zero"
    head = parallelize(nn.Sequential(nn.Linear(4, 65)), None,
                       {"0": ColwiseParallel(vocab_parallel=True)})
    logits = head(torch.randn(3, 4))
    assert logits.shape == (3, 33)
    assert torch.isinf(logits[:, -1]).all() == (ctx.rank == 1), "padded logits must be -inf"


def check_layouts(ctx):
    """Colwise with Replicate() output (fused chunks reordered), Rowwise with Replicate() input."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(C, 3 * C), nn.Linear(3 * C, C))
    ref = copy.deepcopy(model)
    parallelize(model, None, {"0": ColwiseParallel(output_layouts=Replicate(), chunks=3),
                              "1": RowwiseParallel(input_layouts=Replicate())})
    x = torch.randn(B, T, C)
    close(model[0](x), ref[0](x), "gathered colwise output")
    y, yr = model(x), ref(x)
    close(y, yr, "output")
    y.sum().backward()
    yr.sum().backward()
    compare_params(model, ref, "layouts")
    # ColwiseParallel on an Embedding (columns), PrepareModuleOutput gathering a sharded output
    torch.manual_seed(0)
    model = nn.Sequential(nn.Sequential(nn.Embedding(10, C), nn.Linear(C, 2 * C)))
    ref = copy.deepcopy(model)
    parallelize(model, None, {
        "0.0": ColwiseParallel(output_layouts=Replicate()), "0.1": ColwiseParallel(),
        "0": PrepareModuleOutput(output_layouts=Shard(-1), desired_output_layouts=Replicate())})
    assert model[0][0].weight.shape == (10, C // 2)
    ids = torch.randint(10, (B, T))
    y, yr = model(ids), ref(ids)
    close(y, yr, "embedding + gathered output")
    (y * y).sum().backward()
    (yr * yr).sum().backward()
    compare_params(model, ref, "embedding layouts")


def check_dropout_rng(ctx):
    """Sharded dropout: per-rank masks; replicated dropout: identical on every rank."""

    class DropMLP(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc1 = nn.Linear(C, 4 * C)
            self.drop_hidden = nn.Dropout(0.5)  # sharded: between fc1 and fc2
            self.fc2 = nn.Linear(4 * C, C)
            self.drop_out = nn.Dropout(0.5)  # replicated: after the all-reduce

        def forward(self, x):
            return self.drop_out(self.fc2(self.drop_hidden(self.fc1(x))))

    torch.manual_seed(0)
    model = DropMLP()
    with torch.no_grad():
        model.fc1.weight.fill_(0.1)
        model.fc1.bias.fill_(1.0)
    parallelize(model, None, {"fc1": ColwiseParallel(), "drop_hidden": ShardedDropout(),
                              "fc2": RowwiseParallel()})
    hidden = []
    model.drop_hidden.register_forward_hook(lambda m, a, out: hidden.append(out))
    default_before = torch.get_rng_state()
    x = torch.ones(4, 64, C)
    y = model(x)
    default_after = torch.get_rng_state()
    mask = (hidden[0] != 0).float()
    masks = [torch.empty_like(mask) for _ in range(2)]
    dist.all_gather(masks, mask)
    assert not torch.equal(masks[0], masks[1]), "sharded dropout must differ across TP ranks"
    keep = torch.cat(masks).mean().item()
    assert 0.45 < keep < 0.55, f"keep fraction {keep}"
    outs = [torch.empty_like(y) for _ in range(2)]
    dist.all_gather(outs, y.detach())
    close(outs[1], outs[0], "replicated dropout output across TP ranks")
    # the fork left the default stream where one draw (the replicated dropout) put it
    torch.set_rng_state(default_before)
    nn.Dropout(0.5)(torch.ones_like(y))
    assert torch.equal(torch.get_rng_state(), default_after), "the fork moved the default stream"
    tracker = RNGTracker(None, seed=5)
    with tracker.fork():
        a = torch.rand(3)
    b_outside = torch.rand(3)
    with tracker.fork():
        b = torch.rand(3)
    assert not torch.equal(a, b) and not torch.equal(a, b_outside)
    # replicated dropout with different default streams on the TP ranks: refused
    torch.manual_seed(ctx.rank)
    expect_error(lambda: parallelize(DropMLP(), None, {"fc1": ColwiseParallel(),
                                                       "fc2": RowwiseParallel()}),
                 ValueError, "torch.manual_seed")


def check_mesh(ctx):
    mesh = Mesh({"tp": 2})
    torch.manual_seed(0)
    model = MLPBlock()
    ref = copy.deepcopy(model)
    parallelize(model, mesh, mlp_plan(False))
    x = torch.randn(B, T, C)
    close(model(x), ref(x), "output with a Mesh")
    expect_error(lambda: parallelize(MLPBlock(), Mesh({"dp": 1, "pp": 2}), mlp_plan(False)),
                 KeyError, "none is named 'tp'")


CHECKS = [check_mlp, check_mlp_sp, check_attention, check_attention_sp, check_char_lm,
          check_char_lm_sp, check_vocab_loss, check_collective_counts, check_tied,
          check_refusals, check_layouts, check_dropout_rng, check_mesh]


def main():
    torch.set_num_threads(1)
    run_checks(CHECKS, before_each=lambda: torch.manual_seed(0))


if __name__ == "__main__":
    main()
