"""Worker: zero-bubble (ZB-V) stages under HSDP, 4 ranks (2 replicas x 2 shards), each rank
running its own pipeline of one rank (both V stages local), against one process on the
global batch (the unsplit model, mean loss over the 16 samples).

- PowerSGD on each stage root, plain all-reduce for the first 3 steps: its ``iter`` counts
  exactly one per step (a ZB W runs one autograd call per unit, and each call's end marked
  its last bucket ``is_last()``: the state ran ahead by the number of units and compressed
  from step 1), the gradients of steps 0-2 equal one process's, those of step 3
  (compressing) do not;
- a W that raises (a gradient hook on microbatch 1's weight) after an earlier W
  accumulated without sync: a new schedule on the same modules, after zero_grad, gives one
  process's gradients (the failed step's accumulated gradients were added in, silently);
- ``set_reshard_after_backward(False)`` set by the user on the stage modules is kept
  through a step (the pipeline set it back to True after the last W) and through a failed
  one, and the step still equals one process.
"""

import copy

import torch
import torch.distributed as dist

from meshrun.parallel import Mesh, full_tensor, fully_shard
from meshrun.parallel.comm_hooks import PowerSGDState, powerSGD_hook
from meshrun.parallel.fsdp import FSDPModule
from meshrun.parallel.pipelining import PipelineStage, ScheduleZBV, split_into_stages
from tests.parallel.harness import run_checks
from tests.parallel.workers.pp_checks import make_model, mse

SHAPE = {"dp_replicate": 2, "dp_shard": 2}
PER_RANK, N_MICRO = 4, 4
_SOLO = {}


def solo_group():
    """A pipeline group of this rank alone (every rank makes every group, in order)."""
    if "g" not in _SOLO:
        for r in range(dist.get_world_size()):
            g = dist.new_group([r])
            if r == dist.get_rank():
                _SOLO["g"] = g
    return _SOLO["g"]


def data(step):
    g = torch.Generator().manual_seed(300 + step)
    return torch.randn(4 * PER_RANK, 6, generator=g), torch.randn(4 * PER_RANK, 3, generator=g)


def build(mesh, hook_iter=None, keep_unsharded=False):
    full, first, blocks, last = make_model(4)
    ref = copy.deepcopy(full)
    modules = split_into_stages(blocks, 2, first=first, last=last)
    states = []
    for module in modules:
        for block in module.blocks.values():
            fully_shard(block, mesh=mesh)
        fully_shard(module, mesh=mesh)
        if hook_iter is not None:
            state = PowerSGDState(mesh.group("dp_replicate"), matrix_approximation_rank=1,
                                  start_powerSGD_iter=hook_iter)
            module.register_comm_hook(state, powerSGD_hook)
            states.append(state)
        if keep_unsharded:
            module.set_reshard_after_backward(False)
    return full, ref, modules, states


def schedule_of(modules):
    stages = [PipelineStage(m, s, 2, solo_group(), placement="v") for s, m in enumerate(modules)]
    return ScheduleZBV(stages, N_MICRO, mse)


def step_and_compare(schedule, full, ref, step, expect_equal=True):
    rank = dist.get_rank()
    x, y = data(step)
    for p in full.parameters():
        p.grad = None
    schedule.step(x[rank * PER_RANK:(rank + 1) * PER_RANK],
                  target=y[rank * PER_RANK:(rank + 1) * PER_RANK])
    ref.zero_grad()
    mse(ref(x), y).backward()
    diffs = []
    for (name, p), q in zip(full.named_parameters(), ref.parameters(), strict=True):
        got = full_tensor(p, p.grad)
        if not torch.allclose(got, q.grad, rtol=1e-5, atol=1e-6):
            diffs.append(f"{name}: max diff {(got - q.grad).abs().max().item():.2e}")
    if expect_equal:
        assert not diffs, f"step {step}: gradients differ from one process: {diffs}"
    else:
        assert diffs, f"step {step}: gradients equal one process's (no compression?)"


def check_powersgd_counts_one_iter_per_zbv_step(ctx):
    mesh = Mesh(SHAPE)
    full, ref, modules, states = build(mesh, hook_iter=3)
    schedule = schedule_of(modules)
    for step in range(4):
        step_and_compare(schedule, full, ref, step, expect_equal=step < 3)
        iters = [s.iter for s in states]
        assert iters == [step + 1, step + 1], f"after step {step}: PowerSGD iter {iters}"


class FailAt:
    """A gradient hook on a block's unsharded weight, registered at each forward: raises in
    the W of microbatch ``at`` while armed."""

    def __init__(self, linear, at):
        self.calls, self.at, self.armed = 0, at, True
        linear.register_forward_hook(self._register)

    def _register(self, module, args, output):
        if self.armed and torch.is_grad_enabled():
            module.weight.register_hook(self._hook)

    def _hook(self, grad):
        self.calls += 1
        if self.armed and self.calls == self.at + 1:
            raise ValueError("W failed")
        return grad


def failed_then_new_schedule(keep_unsharded):
    mesh = Mesh(SHAPE)
    full, ref, modules, _ = build(mesh, keep_unsharded=keep_unsharded)
    fail = FailAt(modules[1].blocks["2"].fc, at=1)
    x, y = data(0)
    rank = dist.get_rank()
    try:
        schedule_of(modules).step(x[rank * PER_RANK:(rank + 1) * PER_RANK],
                                  target=y[rank * PER_RANK:(rank + 1) * PER_RANK])
    except ValueError as e:
        assert "W failed" in str(e), e
    else:
        raise AssertionError("the W did not fail")
    fail.armed = False
    return full, ref, modules


def check_failed_w_leaves_no_stale_accumulation(ctx):
    full, ref, modules = failed_then_new_schedule(keep_unsharded=False)
    step_and_compare(schedule_of(modules), full, ref, 1)


def reshard_settings(modules):
    return [m._fsdp_unit.reshard_after_backward for module in modules
            for m in module.modules() if isinstance(m, FSDPModule)]


def check_user_reshard_after_backward_kept(ctx):
    mesh = Mesh(SHAPE)
    full, ref, modules, _ = build(mesh, keep_unsharded=True)
    schedule = schedule_of(modules)
    for step in range(2):
        step_and_compare(schedule, full, ref, step)
        got = reshard_settings(modules)
        assert not any(got), f"after step {step}: reshard_after_backward {got}"
    full, ref, modules = failed_then_new_schedule(keep_unsharded=True)
    got = reshard_settings(modules)
    assert not any(got), f"after a failed step: reshard_after_backward {got}"
    step_and_compare(schedule_of(modules), full, ref, 1)


if __name__ == "__main__":
    run_checks([check_powersgd_counts_one_iter_per_zbv_step,
                check_failed_w_leaves_no_stale_accumulation,
                check_user_reshard_after_backward_kept])
