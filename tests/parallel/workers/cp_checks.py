"""Context-parallel checks, run on every rank of a 2- or 4-process gloo group (one launch).

The reference is ``F.scaled_dot_product_attention`` on the whole sequence in this process
(every rank draws the same seeded q, k, v and output gradient); the CP call gets this rank's
shard in the layout, and its output and its dq/dk/dv must equal this rank's shard of the
reference's (norm-relative error <= 1e-5 in float32, 1e-10 in float64), causal and not.
"""

import sys
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F

from meshrun.parallel import Mesh
from meshrun.parallel.cp import (
    context_parallel_attention,
    position_ids,
    ring_attention,
    shard_sequence,
    ulysses_attention,
    unshard_sequence,
)
from tests.parallel.harness import run_checks

sys.path.insert(0, str(Path(__file__).resolve().parents[3] / "examples"))

B, H, D = 2, 4, 8
SDPA = F.scaled_dot_product_attention  # the reference, also inside context_parallel_attention
TOL = {torch.float32: 1e-5, torch.float64: 1e-10}


def rel_err(got, want):
    return ((got - want).norm() / want.norm()).item()


def parity(attention, layout, group=None, seq=32, seed=0, heads=H):
    """Compare ``attention`` with full SDPA for causal in (False, True), float32 and 64."""
    cp, rank = dist.get_world_size(group), dist.get_rank(group)
    failures = []
    for causal in (False, True):
        for dtype in (torch.float32, torch.float64):
            gen = torch.Generator().manual_seed(seed + 10 * causal)
            q, k, v, dout = (torch.randn(B, heads, seq, D, generator=gen, dtype=dtype)
                             for _ in range(4))
            full = [t.clone().requires_grad_() for t in (q, k, v)]
            ref = SDPA(*full, is_causal=causal)
            ref.backward(dout)
            mine = [shard_sequence(t, rank, cp, layout, dim=2).requires_grad_()
                    for t in (q, k, v)]
            out = attention(*mine, group, causal=causal, layout=layout)
            out.backward(shard_sequence(dout, rank, cp, layout, dim=2))
            pairs = [("out", out, ref)] + [(f"d{n}", t.grad, f.grad)
                                            for n, t, f in zip("qkv", mine, full, strict=True)]
            for name, got, want in pairs:
                err = rel_err(got.detach(), shard_sequence(want.detach(), rank, cp, layout,
                                                           dim=2))
                if not err <= TOL[dtype]:
                    failures.append(f"{name} causal={causal} {dtype}: relative error {err:.2e}")
    assert not failures, "; ".join(failures)


def check_ring_zigzag(ctx):
    parity(ring_attention, "zigzag")


def check_ring_contiguous(ctx):
    parity(ring_attention, "contiguous")


def check_ring_matmul_blocks(ctx):
    """The ring's own matmul blocks (its path off CPU), not torch's fused CPU kernel."""
    from meshrun.parallel.cp import ring

    ring.use_fused_kernel = False
    try:
        parity(ring_attention, "zigzag")
        parity(ring_attention, "contiguous")
    finally:
        ring.use_fused_kernel = True


def check_ulysses_zigzag(ctx):
    parity(ulysses_attention, "zigzag")


def check_ulysses_contiguous(ctx):
    parity(ulysses_attention, "contiguous")


def check_bfloat16(ctx):
    """bf16 shards (the ring accumulates in fp32, its dK/dV travel in fp32): within bf16's
    rounding (2e-2 relative) of full fp32 SDPA on the same values; output and grads stay bf16."""
    cp, rank = dist.get_world_size(), dist.get_rank()
    gen = torch.Generator().manual_seed(5)
    q, k, v, dout = (torch.randn(B, H, 32, D, generator=gen).bfloat16().float()
                     for _ in range(4))
    full = [t.clone().requires_grad_() for t in (q, k, v)]
    ref = SDPA(*full, is_causal=True)
    ref.backward(dout)
    for attention in (ring_attention, ulysses_attention):
        mine = [shard_sequence(t, rank, cp, "zigzag", dim=2).bfloat16().requires_grad_()
                for t in (q, k, v)]
        out = attention(*mine, causal=True, layout="zigzag")
        out.backward(shard_sequence(dout, rank, cp, "zigzag", dim=2).bfloat16())
        assert out.dtype == mine[0].grad.dtype == torch.bfloat16
        for got, want in [(out, ref)] + [(t.grad, f.grad) for t, f in zip(mine, full,
                                                                          strict=True)]:
            err = rel_err(got.detach().float(), shard_sequence(want.detach(), rank, cp,
                                                               "zigzag", dim=2))
            assert err < 2e-2, f"{attention.__name__}: relative error {err:.2e}"


def check_subgroup(ctx):
    """A cp group inside a {"dp", "cp"} mesh (peers are global ranks): each dp row its own
    data; 2 ranks: the mesh is {"dp": 1, "cp": 2}."""
    world = dist.get_world_size()
    mesh = Mesh({"dp": world // 2, "cp": 2}, device_type="cpu")
    for attention in (ring_attention, ulysses_attention):
        parity(attention, "zigzag", group=mesh.group("cp"), seed=100 + mesh.rank("dp"))


def check_flat_group(ctx):
    """Mesh.group(("dp", "cp")): the ranks that differ only in dp and cp (here: the same tp
    coordinate of a {"dp", "cp", "tp"} mesh), members in rank order."""
    world = dist.get_world_size()
    tp = 2 if world == 4 else 1
    mesh = Mesh({"dp": world // (2 * tp), "cp": 2, "tp": tp}, device_type="cpu")
    group = mesh.group(("dp", "cp"))
    assert mesh.group(("dp", "cp")) is group  # made once
    members = [None] * dist.get_world_size(group)
    dist.all_gather_object(members, dist.get_rank(), group=group)
    assert members == [r for r in range(world) if r % tp == dist.get_rank() % tp], members


def check_char_lm_ddp(ctx):
    """The example's CharLM under its own parallelize_lm with --cp, against the unsplit model
    in one process (compose_checks.parity: loss, every gradient and parameter for 2 SGD
    steps, the global clip's norm). 2 ranks: cp 2 (ring) x ddp; 4 ranks: tp 2 x cp 2, without
    and with sequence parallelism."""
    from tests.parallel.workers.compose_checks import parity as model_parity

    if dist.get_world_size() == 4:
        for sp in (False, True):
            model_parity(pp=1, tp=2, dp=1, mode="ddp", cp=2, cp_mode="ring", sp=sp)
    else:
        model_parity(pp=1, tp=1, dp=1, mode="ddp", cp=2, cp_mode="ring")


def check_char_lm_fsdp(ctx):
    """As above with fsdp over the flattened dp x cp group. 2 ranks: cp 2 (Ulysses); 4 ranks:
    dp 2 x cp 2 (ring)."""
    from tests.parallel.workers.compose_checks import parity as model_parity

    if dist.get_world_size() == 4:
        model_parity(pp=1, tp=1, dp=2, mode="fsdp", cp=2, cp_mode="ring")
    else:
        model_parity(pp=1, tp=1, dp=1, mode="fsdp", cp=2, cp_mode="ulysses")


def check_char_lm_pp(ctx):
    """--cp under a pipeline (the first stage's Embed takes the cp positions, each stage's
    ring runs between the ranks holding it), against the unsplit model: 2 ranks: pp 2 is all
    there is, so cp 2 alone with Ulysses; 4 ranks: pp 2 x cp 2 (1F1B, ring) with ddp."""
    from tests.parallel.workers.compose_checks import parity as model_parity

    if dist.get_world_size() == 4:
        model_parity(pp=2, tp=1, dp=1, mode="ddp", cp=2, cp_mode="ring")
        model_parity(pp=2, tp=1, dp=1, mode="fsdp", cp=2, cp_mode="ulysses",
                     schedule="gpipe")
    else:
        model_parity(pp=1, tp=1, dp=1, mode="ddp", cp=2, cp_mode="ulysses")


def check_sdpa_routing(ctx):
    """Inside context_parallel_attention, F.scaled_dot_product_attention on shards is CP
    attention (parity with full SDPA, through the example model's own SDPA call site);
    outside, it is torch's again."""
    import char_lm.model as model

    def through_sdpa(q, k, v, group, *, causal, layout):
        assert F.scaled_dot_product_attention is not SDPA
        return F.scaled_dot_product_attention(q, k, v, is_causal=causal) if not causal \
            else model.causal_attention(q, k, v)

    for mode in ("ring", "ulysses"):
        for layout in ("zigzag", "contiguous"):
            with context_parallel_attention(mode=mode, layout=layout):
                parity(through_sdpa, layout)
            assert F.scaled_dot_product_attention is SDPA
    expect_error(lambda: context_parallel_attention(mode="striped").__enter__(), "ring")


def check_layouts(ctx):
    """The zigzag of 8 tokens over 2 ranks by hand; shard / unshard round trips."""
    assert position_ids(8, 0, 2).tolist() == [0, 1, 6, 7]
    assert position_ids(8, 1, 2).tolist() == [2, 3, 4, 5]
    assert position_ids(8, 1, 2, "contiguous").tolist() == [4, 5, 6, 7]
    x = torch.randn(3, 24, 5)
    for cp in (1, 2, 3, 4):
        for layout in ("zigzag", "contiguous"):
            shards = [shard_sequence(x, r, cp, layout) for r in range(cp)]
            assert torch.equal(unshard_sequence(shards, layout), x), (cp, layout)
            got = torch.cat([position_ids(24, r, cp, layout) for r in range(cp)])
            assert sorted(got.tolist()) == list(range(24)), (cp, layout)


def expect_error(fn, *needles):
    try:
        fn()
    except ValueError as e:
        for needle in needles:
            assert needle in str(e), f"{needle!r} not in {e}"
        return
    raise AssertionError(f"no ValueError (expected one naming {needles})")


def check_errors(ctx):
    cp = dist.get_world_size()
    q = torch.randn(B, H, 3, D)  # odd: the zigzag cannot split it
    expect_error(lambda: ring_attention(q, q, q, causal=True), "cannot be split", "zigzag",
                 "multiple of")
    expect_error(lambda: ulysses_attention(q, q, q), "cannot be split")
    expect_error(lambda: shard_sequence(torch.zeros(1, 2 * cp + 1), 0, cp), "multiple of")
    q = torch.randn(B, 2 * cp - 1, 4, D)  # heads cp does not divide
    expect_error(lambda: ulysses_attention(q, q, q, layout="contiguous"), "heads",
                 "ring_attention")
    ring_attention(q, q, q, layout="contiguous")  # any head count
    q = torch.randn(B, H, 4, D)
    mask = torch.ones(4, 4, dtype=torch.bool)
    for fn in (ring_attention, ulysses_attention):
        expect_error(lambda fn=fn: fn(q, q, q, attn_mask=mask), "attn_mask", "causal=True")
    expect_error(lambda: ring_attention(q, q, q, layout="striped"), "unknown layout")
    expect_error(lambda: ring_attention(q, q, q, dropout_p=0.1), "dropout_p")


def check_example_refusals(ctx):
    """The example's --cp flags it cannot run: one line naming the fix each."""
    import char_lm as lm
    import train_char_lm as train

    for flags, fragment in [
        (dict(block_size=30), "--block-size 30 must be a multiple of 4"),
        (dict(cp_mode="ulysses"), "must divide the 3 attention heads"),
        (dict(dp_mode="torch-ddp"), "--cp needs --dp-mode ddp or fsdp"),
        (dict(compile=True), "drop --compile"),
    ]:
        args = train.parse_args([])
        vars(args).update(cp=2, **flags)
        problem = lm.layout_problem(args, ctx.world_size, n_head=3)
        assert problem and fragment in problem, f"{fragment!r} not in {problem!r}"


if __name__ == "__main__":
    run_checks([check_ring_zigzag, check_ring_contiguous, check_ring_matmul_blocks,
                check_ulysses_zigzag,
                check_ulysses_contiguous, check_bfloat16, check_subgroup, check_flat_group,
                check_char_lm_ddp, check_char_lm_fsdp, check_char_lm_pp,
                check_sdpa_routing, check_layouts, check_errors,
                check_example_refusals])
