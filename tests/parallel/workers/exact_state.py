"""Worker: saving changes nothing, and loading then training equals training on.

One seeded case per launch (``--seed``): a small MLP with a frozen parameter (in the optimizer,
never given a gradient) and an unused one, data parallel over the world with ``ddp`` or
``fully_shard``, SGD with momentum or AdamW. Four runs of ``K + M`` steps on the same data:

- ``saving``: trains K steps, saves (in the background for half the cases, training on
  while it writes), trains M more;
- ``plain``: trains K + M steps, never saves: must equal ``saving`` bit for bit after every
  step (same arithmetic, so saving may not change a single bit of what follows);
- ``resumed``: a fresh model and optimizer load the checkpoint, then train M steps: must equal
  ``saving`` bit for bit;
- ``reference``: one process, no strategy, the global batch: equal to ``saving`` within 1e-5
  (the reduction order of the gradient average differs).

The unused parameter's group has no weight decay: under ``fully_shard`` an unused parameter
gets a zero gradient (as in FSDP2), where the reference's gets none, and only decoupled weight
decay would tell the two apart.
"""

from __future__ import annotations

import argparse
import tempfile

import torch
import torch.distributed as dist
from torch import nn

from meshrun.parallel import checkpoint, ddp, fully_shard, placement
from tests.parallel.harness import run_checks

K, M, BATCH, WIDTH = 3, 2, 8, 6


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1 = nn.Linear(WIDTH, 2 * WIDTH)
        self.fc2 = nn.Linear(2 * WIDTH, 3)
        self.unused = nn.Linear(WIDTH, 2)  # never called in forward
        self.fc1.bias.requires_grad_(False)  # frozen, as in fine-tuning

    def forward(self, x):
        return self.fc2(torch.tanh(self.fc1(x)))


def build(case: dict, distributed: bool):
    torch.manual_seed(case["seed"])
    model = Net()
    if distributed:
        if case["strategy"] == "fsdp":
            fully_shard(model.fc1)
            fully_shard(model)
        else:
            ddp(model, find_unused_parameters=True)
    decayed = [p for n, p in model.named_parameters() if not n.startswith("unused")]
    groups = [{"params": decayed}, {"params": list(model.unused.parameters()),
                                    "weight_decay": 0.0}]
    if case["optimizer"] == "adamw":
        optimizer = torch.optim.AdamW(groups, lr=0.05, weight_decay=0.1)
    else:
        optimizer = torch.optim.SGD(groups, lr=0.1, momentum=0.9, weight_decay=0.01)
    return model, optimizer


def batch(case: dict, step: int, rank: int | None):
    g = torch.Generator().manual_seed(case["seed"] * 1000 + step)
    x, y = torch.randn(BATCH, WIDTH, generator=g), torch.randn(BATCH, 3, generator=g)
    if rank is None:
        return x, y
    n = BATCH // dist.get_world_size()
    return x[rank * n:(rank + 1) * n], y[rank * n:(rank + 1) * n]


def train_step(model, optimizer, case, step, rank):
    x, y = batch(case, step, rank)
    optimizer.zero_grad(set_to_none=True)
    loss = torch.nn.functional.mse_loss(model(x), y)
    loss.backward()
    optimizer.step()


def snapshot(model) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def run(case, *, save_to=None, load_from=None):
    """Train the distributed model; the parameters after each step (local shards)."""
    rank = dist.get_rank()
    model, optimizer = build(case, distributed=True)
    state = {"model": checkpoint.model_state(model), "step": 0,
             "optim": checkpoint.optimizer_state(optimizer, model)}
    first = 0
    if load_from is not None:
        checkpoint.load(state, load_from)
        first = state["step"]
    history = {}
    for step in range(first, K + M):
        train_step(model, optimizer, case, step, rank)
        history[step] = snapshot(model)
        if save_to is not None and step == K - 1:
            state["step"] = K
            checkpoint.save(state, save_to, async_=case["async"])  # async: trains on at once
    checkpoint.wait()
    return model, history


def exact_state(ctx, case):
    with tempfile.TemporaryDirectory() as tmp:
        directory = [tmp]
        dist.broadcast_object_list(directory)  # one directory for all ranks (rank 0's)
        path = f"{directory[0]}/step_{K}"
        model, saving = run(case, save_to=path)
        _, plain = run(case)
        _, resumed = run(case, load_from=path)
        dist.barrier()  # nobody removes the directory while another rank reads it
    for step in range(K + M):
        for name, value in saving[step].items():
            assert torch.equal(value, plain[step][name]), (
                f"step {step}: {name} differs after a save from a run that never saved "
                f"(max |diff| {(value - plain[step][name]).abs().max():.3g})")
            if step >= K:
                assert torch.equal(value, resumed[step][name]), (
                    f"step {step}: {name} after load + train differs from training on "
                    f"(max |diff| {(value - resumed[step][name]).abs().max():.3g})")
    ref, ref_opt = build(case, distributed=False)
    for step in range(K + M):
        train_step(ref, ref_opt, case, step, None)
    full = dict(ref.named_parameters())
    for name, p in model.named_parameters():
        for piece in placement.pieces(p):
            torch.testing.assert_close(piece.view(saving[K + M - 1][name]),
                                       full[name].detach()[piece.region], rtol=1e-5, atol=1e-5,
                                       msg=lambda m, name=name: f"{name} vs reference: {m}")


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--seed", type=int, required=True)
    args = p.parse_args()
    checks = []
    for strategy, optimizer, background in [("ddp", "adamw", False), ("ddp", "sgd", True),
                                            ("fsdp", "adamw", True), ("fsdp", "sgd", False)]:
        case = {"seed": args.seed, "strategy": strategy, "optimizer": optimizer,
                "async": background}

        def check(ctx, case=case):
            exact_state(ctx, case)

        check.__name__ = f"exact_state_{strategy}_{optimizer}{'_async' if background else ''}"
        checks.append(check)
    run_checks(checks)


if __name__ == "__main__":
    main()
