"""meshrun.parallel.checkpoint_activations: the same numbers with less kept for backward.

In one process: "full" and "selective" give gradients bit-equal to the unchecked model's
(dropout included: the random state is replayed), keep less after the forward (bytes still
allocated when the forward returns, from torch's profiler: full < selective < none), and bad
policies are refused. On 2 ranks (workers/ac_checks.py): composed with ddp, fully_shard
(checkpointed before and after sharding) and parallelize, against one process without it.
"""

import copy

import pytest
import torch
from harness import assert_all_ok, launch
from torch import nn

from meshrun.parallel import checkpoint_activations


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.ln, self.fc1, self.fc2 = nn.LayerNorm(32), nn.Linear(32, 128), nn.Linear(128, 32)
        self.drop = nn.Dropout(0.2)

    def forward(self, x):
        return x + self.drop(self.fc2(torch.nn.functional.gelu(self.fc1(self.ln(x)))))


def stack():
    torch.manual_seed(0)
    return nn.Sequential(*[Block() for _ in range(4)])


def checked(model, policy):
    model = copy.deepcopy(model)
    if policy is not None:
        for block in model:
            checkpoint_activations(block, policy)
    return model


def held_after_forward(model, x) -> int:
    """Bytes allocated during the forward and not freed when it returns (what backward
    needs, plus the output)."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        y = model(x)
    del y
    return sum(e.self_cpu_memory_usage for e in prof.key_averages())


@pytest.mark.timeout(60)
def test_gradients_bit_equal_and_less_kept():
    base = stack()
    x = torch.randn(8, 16, 32)
    grads, held = {}, {}
    for policy in (None, "full", "selective"):
        model = checked(base, policy)
        torch.manual_seed(1)  # the dropout masks
        model(x).square().mean().backward()
        grads[policy] = [p.grad for p in model.parameters()]
        held[policy] = held_after_forward(checked(base, policy), x)
    for policy in ("full", "selective"):
        assert all(torch.equal(a, b) for a, b in zip(grads[policy], grads[None], strict=True))
    assert held["full"] < held["selective"] < held[None], held


@pytest.mark.timeout(30)
def test_bad_policy_and_twice_are_refused():
    with pytest.raises(ValueError, match="policy must be"):
        checkpoint_activations(Block(), "some")
    block = checkpoint_activations(Block(), "full")
    with pytest.raises(ValueError, match="already checkpointed"):
        checkpoint_activations(block, "selective")


@pytest.mark.timeout(120)
def test_with_the_strategies_on_2_ranks():
    result = launch("ac_checks.py", 2, timeout=100)
    assert_all_ok(result)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("policy", ["full", "selective"])
def test_a_copy_checkpoints_itself_and_a_saved_model_loads(policy, tmp_path):
    """copy.deepcopy of a checkpointed model runs the copy's parameters, and its gradients
    land on the copy (EMA and reference copies); torch.save of the whole model loads back
    into a model that is still checkpointed and computes the same."""
    model = checked(stack(), policy)
    twin = copy.deepcopy(model)
    with torch.no_grad():
        for p in twin.parameters():
            p.zero_()
    x = torch.randn(2, 4, 32)
    torch.manual_seed(1)
    out = twin(x)
    assert torch.equal(out, x), "the copy ran the original's parameters"  # blocks add 0
    out.square().mean().backward()
    assert all(p.grad is not None for p in twin.parameters() if p.requires_grad)
    assert all(p.grad is None for p in model.parameters()), "gradients reached the original"
    torch.save(model, tmp_path / "model.pt")
    loaded = torch.load(tmp_path / "model.pt", weights_only=False)
    assert all(b._meshrun_ac_policy == policy for b in loaded)
    torch.manual_seed(2)
    want = model(x)
    torch.manual_seed(2)
    assert torch.equal(loaded(x), want)


@pytest.mark.timeout(120)
def test_full_checkpointing_compiles_to_the_same_gradients():
    """Per-block torch.compile over a fully checkpointed block (docs/parallel.md's pattern):
    the same gradients as eager. Before: torch.compile refused the context function."""
    base = stack()
    x = torch.randn(2, 8, 32)
    grads = []
    for compiled in (False, True):
        model = checked(base, "full")
        if compiled:
            for block in model:
                block.compile(backend="aot_eager")
        model.eval()  # no dropout: the compiled and eager random streams differ
        with torch.enable_grad():
            model(x).square().mean().backward()
        grads.append([p.grad for p in model.parameters()])
    assert all(torch.allclose(a, b, atol=1e-6) for a, b in zip(*grads, strict=True))


@pytest.mark.timeout(60)
def test_selective_inside_a_split_pipeline_stage_is_refused_full_matches():
    """A zero-bubble stage runs two backwards through a block (B, then W): torch's selective
    checkpoint allows one, so the schedule refuses it with a message; "full" recomputes in
    each and gives the unsplit model's gradients (ZB-V on one rank: two stages)."""
    from meshrun.parallel.pipelining import pipeline

    def mse(out, y):
        return (out - y).square().mean()

    torch.manual_seed(0)
    stages = [nn.Sequential(Block(), Block()), nn.Sequential(Block(), Block())]
    for block in stages[1]:
        checkpoint_activations(block, "selective")
    with pytest.raises(NotImplementedError, match="selective activation checkpointing"):
        pipeline(stages, schedule="zbv", n_microbatches=2, loss_fn=mse)
    torch.manual_seed(0)
    stages = [nn.Sequential(Block(), Block()), nn.Sequential(Block(), Block())]
    reference = copy.deepcopy(nn.Sequential(*stages)).eval()
    for stage in stages:
        for block in stage:
            checkpoint_activations(block, "full")
    schedule = pipeline(stages, schedule="zbv", n_microbatches=2, loss_fn=mse)
    for stage in stages:
        stage.eval()  # no dropout: the reference runs the batch whole
    x, y = torch.randn(4, 32), torch.randn(4, 32)
    schedule.step(x, target=y)
    mse(reference(x), y).backward()
    mine = [p.grad for stage in stages for p in stage.parameters()]
    assert all(torch.allclose(a, b, atol=1e-6)
               for a, b in zip(mine, [p.grad for p in reference.parameters()], strict=True))
