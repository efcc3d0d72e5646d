"""Pipeline x data parallel on 4 ranks: Mesh {"pp": 2, "dp": 2}, meshrun ddp on each stage.

Each dp rank runs the schedule with 4 microbatches on its half of the global batch; the
reference is the unsplit model on the whole global batch (losses, gradients and parameters
compared every step). Gradients must be synchronised over dp exactly once per step:

- 1F1B: the backwards of the first 3 microbatches run inside ``no_sync``;
- ZB-H1 and ZB-V (backward split into B and W): every W accumulates inside ``no_sync`` and
  the all-reduce comes once, after the stage's last W. Counted with a comm hook
  (``register_comm_hook``) that records each bucket it reduces and the W's run before it:
  each bucket of each stage module once per step, and only once all 4 W's of its stage ran
  (the reduction must wait for the last W, which produces the last weight gradients).
- ZB-H1 under fully_shard (a unit per block, then the stage module) applied before the
  schedule is built: the construction check took fully_shard for ddp on a submodule and
  refused it (the example applies data parallelism after the schedule, so it never showed).
"""

import copy
import traceback

import torch
import torch.distributed as dist

from meshrun.parallel import Mesh, ddp, fully_shard, init
from meshrun.parallel.comm_hooks import allreduce_hook
from meshrun.parallel.pipelining import (
    PipelineStage,
    Schedule1F1B,
    ScheduleZBH1,
    ScheduleZBV,
    split_into_stages,
)
from tests.parallel.harness import exit_without_teardown, report
from tests.parallel.workers.pp_checks import close, make_model, mse

GLOBAL_BATCH, N_MICRO, STEPS = 16, 4, 2


def data(step):
    g = torch.Generator().manual_seed(200 + step)
    return torch.randn(GLOBAL_BATCH, 6, generator=g), torch.randn(GLOBAL_BATCH, 3, generator=g)


def build(mesh, name):
    """This rank's stage modules (ddp over "dp") and the schedule; the full model and its copy."""
    pp_rank = mesh.rank("pp")
    n_stages = 4 if name == "zbv" else 2
    full, first, blocks, last = make_model(4)
    ref = copy.deepcopy(full)
    modules = split_into_stages(blocks, n_stages, first=first, last=last)
    mine = [pp_rank, n_stages - 1 - pp_rank] if name == "zbv" else [pp_rank]
    stages = []
    for s in mine:
        if name == "zbh1_fsdp":
            for block in modules[s].blocks.values():
                fully_shard(block, mesh.group("dp"))
            fully_shard(modules[s], mesh.group("dp"))
        else:
            ddp(modules[s], mesh.group("dp"))
        stages.append(PipelineStage(modules[s], s, n_stages, mesh.group("pp"),
                                    placement="v" if name == "zbv" else "loop"))
    if name == "1f1b":
        schedule = Schedule1F1B(stages[0], N_MICRO, mse)
    elif name in ("zbh1", "zbh1_fsdp"):
        schedule = ScheduleZBH1(stages[0], N_MICRO, mse)
    else:
        schedule = ScheduleZBV(stages, N_MICRO, mse)
    return schedule, [modules[s] for s in mine], full, ref


def run(mesh, results, name):
    dp_rank = mesh.rank("dp")
    schedule, modules, full, ref = build(mesh, name)
    entered, reduced = [], []  # stage per no_sync entry; (stage, entries before) per bucket
    for module, stage in zip(modules, schedule.stages, strict=True):
        no_sync, s = module.no_sync, stage.stage_index
        module.no_sync = lambda no_sync=no_sync, s=s: entered.append(s) or no_sync()

        def hook(group, bucket, s=s):
            reduced.append((s, entered.count(s)))
            return allreduce_hook(group, bucket)

        module.register_comm_hook(mesh.group("dp"), hook)
    opt = torch.optim.SGD([p for m in modules for p in m.parameters()], lr=0.1)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    mine = {id(p) for m in modules for p in m.parameters()}
    per = GLOBAL_BATCH // 2
    sync = []
    for step in range(STEPS):
        x, y = data(step)
        losses = []
        entered.clear()
        reduced.clear()
        opt.zero_grad()
        schedule.step(x[dp_rank * per:(dp_rank + 1) * per],
                      target=y[dp_rank * per:(dp_rank + 1) * per], losses=losses)
        stages = sorted(st.stage_index for st in schedule.stages)
        if name == "1f1b" and len(entered) != N_MICRO - 1:
            sync.append(f"step {step}: {len(entered)} backwards inside no_sync, expected "
                        f"{N_MICRO - 1}")
        if name != "1f1b":  # one bucket per stage module here (a model of a few KiB)
            expected = [(s, N_MICRO) for s in stages]
            if sorted(reduced) != expected or len(entered) != N_MICRO * len(stages):
                sync.append(f"step {step}: buckets reduced as (stage, W's run before) "
                            f"{reduced}, expected {expected}; {len(entered)} W's in no_sync")
        ref_opt.zero_grad()
        ref_loss = mse(ref(x), y)
        ref_loss.backward()
        if any(st.is_last for st in schedule.stages):
            loss = torch.stack(losses).mean()
            dist.all_reduce(loss, group=mesh.group("dp"))
            close(loss / 2, ref_loss.detach(), f"{name} step {step} loss")
        for (pname, p), (_, q) in zip(full.named_parameters(), ref.named_parameters(),
                                      strict=True):
            if id(p) in mine:
                close(p.grad, q.grad, f"{name} step {step} grad {pname}")
        opt.step()
        ref_opt.step()
        for (pname, p), (_, q) in zip(full.named_parameters(), ref.named_parameters(),
                                      strict=True):
            if id(p) in mine:
                close(p.detach(), q.detach(), f"{name} step {step} param {pname}")
    return "; ".join(sync) or "ok"


def run_fsdp(mesh, name):
    """Parity of a fully_shard pipeline: each rank's rows (torch.chunk over dp) of the
    reference's gradients and parameters."""
    dp_rank = mesh.rank("dp")
    schedule, modules, full, ref = build(mesh, name)
    opt = torch.optim.SGD([p for m in modules for p in m.parameters()], lr=0.1)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    mine = {id(p) for m in modules for p in m.parameters()}
    per = GLOBAL_BATCH // 2
    for step in range(STEPS):
        x, y = data(step)
        opt.zero_grad()
        schedule.step(x[dp_rank * per:(dp_rank + 1) * per],
                      target=y[dp_rank * per:(dp_rank + 1) * per])
        ref_opt.zero_grad()
        mse(ref(x), y).backward()
        for (pname, p), (_, q) in zip(full.named_parameters(), ref.named_parameters(),
                                      strict=True):
            if id(p) in mine:
                close(p.grad, q.grad.chunk(2)[dp_rank], f"{name} step {step} grad {pname}")
        opt.step()
        ref_opt.step()
        for (pname, p), (_, q) in zip(full.named_parameters(), ref.named_parameters(),
                                      strict=True):
            if id(p) in mine:
                close(p.detach(), q.detach().chunk(2)[dp_rank],
                      f"{name} step {step} param {pname}")
    return "ok"


def main():
    init(timeout=60)
    mesh = Mesh({"pp": 2, "dp": 2})
    results = {}
    for name, parity, once in [("1f1b", "check_pp_dp_parity", "check_sync_once_per_step"),
                               ("zbh1", "check_zbh1_dp_parity", "check_zbh1_sync_after_last_w"),
                               ("zbv", "check_zbv_dp_parity", "check_zbv_sync_after_last_w")]:
        try:
            results[once] = run(mesh, results, name)
            results[parity] = "ok"
        except Exception:
            results[parity] = traceback.format_exc()
            results.setdefault(once, "not reached")
    try:
        results["check_zbh1_fsdp_built_before_schedule"] = run_fsdp(mesh, "zbh1_fsdp")
    except Exception:
        results["check_zbh1_fsdp_built_before_schedule"] = traceback.format_exc()
    report(results)
    dist.destroy_process_group()
    exit_without_teardown()


if __name__ == "__main__":
    main()
