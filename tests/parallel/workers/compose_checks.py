"""N-D composition (pipeline x data x tensor parallel on one mesh) of examples/train_char_lm.py
(its char_lm package).

Run with 2 ranks (``checks_2``) or 4 (``checks_4``): each check builds a small CharLM, applies
the example's own `parallelize_lm` for one ``(pp, tp, dp)`` and trains 2 SGD steps with the
example's `forward_backward` and `clip_gradients`, against the unsplit model in one process on
the global batch (same initial weights). Compared every step: the loss as the example logs it
(all-reduced over the ranks that hold it), the total gradient norm returned by the global clip
against ``torch.nn.utils.clip_grad_norm_`` (clipping active), and the full gradients and
parameters. Full tensors are rebuilt from every rank's blocks (`placement.pieces`: TP shards,
FSDP rows, pipeline stages), each block weighted by 1 / (number of ranks holding it), and
summed by one all-reduce over the world. ``check_refusals``: a mesh that does not fit the
world, torch-ddp with --tp, and --pp-schedule without --pp are one clear error each. The
zero-bubble schedules (B and W split) are checked with ddp (ZB-H1) and fsdp (ZB-H1, ZB-V, one
reduce-scatter per unit and step) over dp (pp 2 x dp 2), with context parallelism (pp 2 x cp
2, ZB-H1: ring attention with ddp, Ulysses with fsdp) and with TP (pp 2 x tp 2, ZB-H1 with
sequence parallelism, ZB-V).
"""

import copy
import math
import sys
from pathlib import Path

import torch
import torch.distributed as dist

from meshrun.parallel import clip_grad_norm_
from meshrun.parallel.fsdp import unit as fsdp_unit
from meshrun.parallel.placement import global_shape, pieces, sharded_over
from tests.parallel.harness import run_checks

sys.path.insert(0, str(Path(__file__).resolve().parents[3] / "examples"))
import char_lm as lm  # noqa: E402
import train_char_lm as train  # noqa: E402

VOCAB, T, B, STEPS = 65, 8, 4, 2  # 65 chars: padded to 66 under tp 2; B: per dp rank
MAX_NORM = 0.5  # below the initial gradient norm (checked), so the clip scales
TOL = dict(atol=3e-5, rtol=1e-4)
DATA = torch.randint(VOCAB, (5000,), generator=torch.Generator().manual_seed(7))


def close(a, b, what):
    torch.testing.assert_close(a, b, **TOL, msg=lambda m: f"{what}: {m}")


def full_tensors(par, grads: bool) -> dict[str, torch.Tensor]:
    """Every parameter (or gradient) of the whole CharLM, rebuilt on every rank."""
    mine = {id(p) for p in par.modules.parameters()}
    stage_ranks = dist.get_world_size() // par.mesh.size("pp")
    names, fulls = [], []
    for name, p in par.lm.named_parameters():
        full = torch.zeros(global_shape(p))
        local = p.grad if grads else p.detach()
        if id(p) in mine and local is not None:
            weight = math.prod(dist.get_world_size(g) for g in sharded_over(p)) / stage_ranks
            for piece in pieces(p):
                full[piece.region] += piece.view(local) * weight
        names.append(name)
        fulls.append(full)
    flat = torch.cat([f.reshape(-1) for f in fulls])
    dist.all_reduce(flat)
    return dict(zip(names, flat.split([f.numel() for f in fulls]), strict=True))


def compare(par, ref, what, grads):
    full = full_tensors(par, grads)
    for name, q in ref.named_parameters():
        close(full[name].view_as(q), (q.grad if grads else q).detach(), f"{what} {name}")


def parity(pp, tp, dp, mode="fsdp", schedule="1f1b", n_layer=2, inf_norm=False,
           count_syncs=False, cp=1, cp_mode="ring", sp=False):
    args = train.parse_args(["--pp", str(pp), "--tp", str(tp), "--dp", str(dp), "--dp-mode", mode,
                          "--pp-schedule", schedule, "--pp-microbatches", "2",
                          "--cp", str(cp), "--cp-mode", cp_mode, "--block-size", str(T)]
                         + ["--sequence-parallel"] * sp)
    torch.manual_seed(0)
    model = lm.CharLM(VOCAB, T, n_layer=n_layer, n_head=2, n_embd=16)
    ref = copy.deepcopy(model)
    par = lm.parallelize_lm(model, args)
    assert par.dp_size == dp, par.dp_size
    # SGD, not Adam: Adam's first step, lr * g / |g|, turns rounding noise of zero gradients
    # (the key bias) into +-lr
    opt = torch.optim.SGD(par.modules.parameters(), lr=0.1, momentum=0.9)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1, momentum=0.9)
    syncs = []
    original = fsdp_unit.reduce_scatter_flat
    if count_syncs:
        fsdp_unit.reduce_scatter_flat = lambda *a, **k: syncs.append(1) or original(*a, **k)
    try:
        for step in range(STEPS):
            ids = lm.window_ids(step * B * dp, B * dp, (len(DATA) - 1) // T, 1)
            mine = lm.microbatches(ids, par.dp_rank, par.dp_size, 1)
            gx, gy = lm.windows(DATA, ids, T)  # the global batch
            opt.zero_grad(set_to_none=True)
            syncs.clear()
            batches = [lm.windows(DATA, part, T) for part in mine]
            loss = lm.forward_backward(par, batches, B * dp, torch.device("cpu")).clone()
            dist.all_reduce(loss)  # as the example logs it: the dp shares add up, x tp
            ref_opt.zero_grad(set_to_none=True)
            ref_loss = ref(gx, gy)
            ref_loss.backward()
            close(loss / (tp * cp), ref_loss.detach(), f"step {step} loss")
            compare(par, ref, f"step {step} grad", grads=True)
            if count_syncs:  # one reduce-scatter per unit and step, not per microbatch
                units = sum(1 for m in par.modules.modules()  # (a unit without its own
                            if hasattr(m, "_fsdp_unit") and m._fsdp_unit.params)  # params: none)
                assert len(syncs) == units, f"{len(syncs)} reduce-scatters for {units} units"
            if inf_norm:  # max_norm inf: nothing scaled
                total = clip_grad_norm_(list(par.modules.parameters()), math.inf, math.inf,
                                        mesh=par.mesh)
                ref_max = max(q.grad.abs().max() for q in ref.parameters())
                close(total, ref_max, f"step {step} inf norm")
            total = lm.clip_gradients(par, MAX_NORM)
            ref_total = torch.nn.utils.clip_grad_norm_(ref.parameters(), MAX_NORM)
            assert step > 0 or ref_total > MAX_NORM, f"no clipping: norm {ref_total}"
            close(total, ref_total, f"step {step} total norm")
            opt.step()
            ref_opt.step()
            compare(par, ref, f"after step {step} param", grads=False)
    finally:
        fsdp_unit.reduce_scatter_flat = original


# 2 ranks


def check_pp2(ctx):
    parity(pp=2, tp=1, dp=1)


def check_tp2(ctx):
    parity(pp=1, tp=2, dp=1)


def check_dp2_fsdp(ctx):
    parity(pp=1, tp=1, dp=2, mode="fsdp")


def check_dp2_ddp(ctx):
    parity(pp=1, tp=1, dp=2, mode="ddp")


def check_refusals(ctx):
    for flags, fragment in [
        (dict(pp=2, tp=2), "--pp 2 x --tp 2 = 4 must divide the world size 2"),
        (dict(tp=2, dp=2), "--pp 1 x --dp 2 x --tp 2 = 4 ranks, but the world size is 2"),
        (dict(tp=2, dp_mode="torch-ddp"), "torch-ddp (torch's DistributedDataParallel"),
        (dict(pp=2, pp_schedule="interleaved1f1b", dp=1),
         "--pp 2: 2 pipeline ranks x 2 stages (interleaved1f1b) = 4 stages, but the model has"),
        (dict(pp_schedule="zbh1"), "--pp-schedule zbh1 schedules a pipeline, but there is none "
                                   "(--pp 1): add --pp N"),
    ]:
        args = train.parse_args([])
        vars(args).update(flags)
        # a model of 2 blocks of 2 heads: 4 (interleaved) stages do not fit
        problem = lm.layout_problem(args, ctx.world_size, n_layer=2, n_head=2)
        assert problem and fragment in problem, f"{fragment!r} not in {problem!r}"
        try:  # parallelize_lm refuses too, from the model it is given
            lm.parallelize_lm(lm.CharLM(VOCAB, T, n_layer=2, n_head=2, n_embd=16), args)
        except SystemExit as e:
            assert fragment in str(e), f"{fragment!r} not in {e}"
        else:
            raise AssertionError(f"{flags}: no error")


# 4 ranks


def check_pp2_tp2(ctx):
    parity(pp=2, tp=2, dp=1, inf_norm=True)


def check_pp2_dp2_fsdp(ctx):  # FSDP under pipeline microbatching: sync on the last only
    parity(pp=2, tp=1, dp=2, mode="fsdp", count_syncs=True)


def check_pp2_dp2_fsdp_interleaved(ctx):  # two stages (two FSDP roots) per rank
    parity(pp=2, tp=1, dp=2, mode="fsdp", schedule="interleaved1f1b", n_layer=4)


def check_tp2_dp2_fsdp(ctx):  # FSDP rows of TP shards
    parity(pp=1, tp=2, dp=2, mode="fsdp")


def check_pp2_dp2_ddp_zbh1(ctx):  # W's accumulate in no_sync; ddp reduces after the last W
    parity(pp=2, tp=1, dp=2, mode="ddp", schedule="zbh1")


def check_pp2_dp2_fsdp_zbh1(ctx):  # B keeps the unsharded parameters; the last W syncs
    parity(pp=2, tp=1, dp=2, mode="fsdp", schedule="zbh1", count_syncs=True)


def check_pp2_dp2_fsdp_zbv(ctx):  # two FSDP roots per rank, each synced after its last W
    parity(pp=2, tp=1, dp=2, mode="fsdp", schedule="zbv", n_layer=4, count_syncs=True)


def check_pp2_cp2_zbh1(ctx):  # W's under ring (ddp) and Ulysses (fsdp) attention
    parity(pp=2, tp=1, dp=1, mode="ddp", cp=2, cp_mode="ring", schedule="zbh1")
    parity(pp=2, tp=1, dp=1, mode="fsdp", cp=2, cp_mode="ulysses", schedule="zbh1")


def check_pp2_tp2_zbh1_sp(ctx):  # B and W through TP's collectives (sequence parallel)
    parity(pp=2, tp=2, dp=1, schedule="zbh1", sp=True)


def check_pp2_tp2_zbv(ctx):  # two TP stages per rank in a V
    parity(pp=2, tp=2, dp=1, schedule="zbv", n_layer=4)


checks_2 = [check_pp2, check_tp2, check_dp2_fsdp, check_dp2_ddp, check_refusals]
checks_4 = [check_pp2_tp2, check_pp2_dp2_fsdp, check_pp2_dp2_fsdp_interleaved,
            check_tp2_dp2_fsdp, check_pp2_dp2_ddp_zbh1, check_pp2_dp2_fsdp_zbh1,
            check_pp2_dp2_fsdp_zbv, check_pp2_cp2_zbh1, check_pp2_tp2_zbh1_sp,
            check_pp2_tp2_zbv]

if __name__ == "__main__":
    run_checks(checks_2 if sys.argv[1] == "2" else checks_4)
