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
