"""Pipeline x data parallel on 4 ranks: Mesh {"pp": 2, "dp": 2}, meshrun ddp on each stage.

Each dp rank runs 1F1B with 4 microbatches on its half of the global batch; the reference is
the unsplit model on the whole global batch. Gradients must be synchronised over dp exactly
once per step (the backwards of the first 3 microbatches run inside ``no_sync``).
"""

import copy
import traceback

import torch
import torch.distributed as dist

from meshrun.parallel import Mesh, ddp, init
from meshrun.parallel.pipelining import PipelineStage, Schedule1F1B, split_into_stages
from tests.parallel.harness import exit_without_teardown, report
from tests.parallel.workers.pp_checks import close, make_model, mse

GLOBAL_BATCH, N_MICRO, STEPS = 16, 4, 2


def data(step):
    g = torch.Generator().manual_seed(200 + step)
    return torch.randn(GLOBAL_BATCH, 6, generator=g), torch.randn(GLOBAL_BATCH, 3, generator=g)


def run(mesh, results):
    pp_rank, dp_rank = mesh.rank("pp"), mesh.rank("dp")
    full, first, blocks, last = make_model(4)
    ref = copy.deepcopy(full)
    module = split_into_stages(blocks, 2, first=first, last=last)[pp_rank]
    ddp(module, mesh.group("dp"))
    entered = []
    no_sync = module.no_sync

    def counting_no_sync():
        entered.append(1)
        return no_sync()

    module.no_sync = counting_no_sync
    schedule = Schedule1F1B(PipelineStage(module, pp_rank, 2, mesh.group("pp")), N_MICRO, mse)
    opt = torch.optim.SGD(module.parameters(), lr=0.1)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    mine = {id(p) for p in module.parameters()}
    per = GLOBAL_BATCH // 2
    for step in range(STEPS):
        x, y = data(step)
        losses = []
        entered.clear()
        opt.zero_grad()
        schedule.step(x[dp_rank * per:(dp_rank + 1) * per],
                      target=y[dp_rank * per:(dp_rank + 1) * per], losses=losses)
        if len(entered) != N_MICRO - 1:
            results["check_sync_once_per_step"] = (
                f"step {step}: {len(entered)} backwards inside no_sync, expected {N_MICRO - 1}")
        ref_opt.zero_grad()
        ref_loss = mse(ref(x), y)
        ref_loss.backward()
        if schedule.stages[0].is_last:
            loss = torch.stack(losses).mean()
            dist.all_reduce(loss, group=mesh.group("dp"))
            close(loss / 2, ref_loss.detach(), f"step {step} loss")
        for (name, p), (_, q) in zip(full.named_parameters(), ref.named_parameters(),
                                     strict=True):
            if id(p) in mine:
                close(p.grad, q.grad, f"step {step} grad {name}")
        opt.step()
        ref_opt.step()
        for (name, p), (_, q) in zip(full.named_parameters(), ref.named_parameters(),
                                     strict=True):
            if id(p) in mine:
                close(p.detach(), q.detach(), f"step {step} param {name}")
    results.setdefault("check_sync_once_per_step", "ok")


def main():
    init(timeout=60)
    mesh = Mesh({"pp": 2, "dp": 2})
    results = {}
    try:
        run(mesh, results)
        results["check_pp_dp_parity"] = "ok"
    except Exception:
        results["check_pp_dp_parity"] = traceback.format_exc()
        results.setdefault("check_sync_once_per_step", "not reached")
    report(results)
    dist.destroy_process_group()
    exit_without_teardown()


if __name__ == "__main__":
    main()
