"""examples/ddp_minimal.py on 2 ranks under the launcher: rank 0's logged losses are those of
one process that averages the two ranks' losses (the same gradient DDP averages)."""

import re

import pytest
from harness import REPO, launch


def one_process_losses() -> dict[int, float]:
    import torch

    torch.manual_seed(0)
    model = torch.nn.Linear(16, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    data = [torch.Generator().manual_seed(1000 + rank) for rank in (0, 1)]
    logged = {}
    for step in range(1, 51):
        losses = []
        for g in data:
            x = torch.randn(32, 16, generator=g)
            losses.append((model(x) - x.sum(dim=1, keepdim=True)).pow(2).mean())
        optimizer.zero_grad()
        (sum(losses) / 2).backward()
        optimizer.step()
        if step % 10 == 0:
            logged[step] = losses[0].item()  # what rank 0 prints
    return logged


@pytest.mark.timeout(120)
def test_ddp_minimal_trains_as_one_process_on_both_batches():
    output = launch(REPO / "examples" / "ddp_minimal.py", 2, timeout=90).output
    logged = {int(s): float(v) for s, v in re.findall(r"step (\d+) \| loss ([0-9.]+)", output)}
    expected = one_process_losses()
    assert sorted(logged) == sorted(expected), output
    for step, loss in logged.items():
        assert loss == pytest.approx(expected[step], abs=2e-4, rel=1e-3), (step, output)
