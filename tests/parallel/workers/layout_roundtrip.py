"""Worker: train K steps at layout A, save, load at layout B, train M more = one process, K + M.

A case (JSON, drawn by tests/parallel/test_layout_roundtrip.py from a seed) names two layouts
``{"pp", "dp", "tp", "mode"}`` of examples/train_char_lm.py's CharLM (its own
`parallelize_lm`, `forward_backward`, `checkpoint_state`), the optimizer (SGD with momentum or
AdamW), K and M, which parameter is frozen (in the optimizer, never given a gradient), and
whether the save runs in the background. Block 1 carries an extra ``unused`` Linear that the
forward never calls. The global batch is G windows at every layout, so every layout trains on
the same data; the reference is the unsplit model in one process on those G windows.

``save`` (world size = A's pp x dp x tp):
- ``saving``: K steps, save (background or not), M more steps;
- ``plain``: K + M steps, never saving: bit-equal to ``saving`` after every step;
- ``saving`` vs the reference: loss and total gradient norm at every step, the full
  parameters after the last (tolerance `TOL`: the reduction order differs).
``load`` (world size = B's): a model built from another seed loads the checkpoint (it must
overwrite everything), equals the reference after K steps, then trains M steps: loss, gradient
norm and full parameters equal the reference's at every step.

Tolerances: `TOL`; AdamW's ``eps`` is 1e-3, because Adam's first step turns the rounding noise
of an exactly-zero gradient (the attention key bias) into +-lr, which no layout reproduces.
The unused parameter's group has no weight decay: under FSDP it gets a zero gradient (as in
FSDP2) where a one-process run gets none, and only weight decay would tell them apart.
"""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

from meshrun.parallel import checkpoint, ddp
from tests.parallel.harness import run_checks
from tests.parallel.workers.compose_checks import full_tensors

sys.path.insert(0, str(Path(__file__).resolve().parents[3] / "examples"))
import char_lm as lm  # noqa: E402
import char_lm.parallelize  # noqa: E402
import train_char_lm as train  # noqa: E402

VOCAB, T, G = 65, 8, 8  # G: windows per step at every layout
DATA = torch.randint(VOCAB, (4000,), generator=torch.Generator().manual_seed(3))
N_WINDOWS = (len(DATA) - 1) // T
TOL = dict(atol=3e-5, rtol=1e-4)
CPU = torch.device("cpu")


def build(case: dict, init_seed: int) -> nn.Module:
    torch.manual_seed(init_seed)
    model = lm.CharLM(VOCAB, T, n_layer=2, n_head=2, n_embd=16)
    model.blocks[1].unused = nn.Linear(16, 3)  # Block.forward never calls it
    model.get_parameter(case["frozen"]).requires_grad_(False)
    return model


def make_optimizer(case: dict, named: list[tuple[str, nn.Parameter]]):
    # two groups on every rank (even empty): the checkpoint's param_groups list is rank 0's
    groups = [{"params": [p for n, p in named if ".unused." not in n]},
              {"params": [p for n, p in named if ".unused." in n], "weight_decay": 0.0}]
    if case["optimizer"] == "adamw":
        return torch.optim.AdamW(groups, lr=0.01, weight_decay=0.1, eps=1e-3)
    return torch.optim.SGD(groups, lr=0.1, momentum=0.9, weight_decay=0.01)


def parallelize(model: nn.Module, layout: dict):
    args = train.parse_args(["--pp", str(layout["pp"]), "--dp", str(layout["dp"]),
                          "--tp", str(layout["tp"]), "--dp-mode", layout["mode"],
                          "--pp-microbatches", "2"])
    # the unused parameter: meshrun's ddp must be told (FSDP gives it a zero gradient)
    char_lm.parallelize.apply_ddp = lambda module, group: ddp(module, group,
                                                          find_unused_parameters=True)
    return lm.parallelize_lm(model, args)


def distributed_run(case: dict, layout: dict, init_seed: int):
    model = build(case, init_seed)
    par = parallelize(model, layout)
    mine = {id(p) for p in par.modules.parameters()}
    optimizer = make_optimizer(case, [(n, p) for n, p in par.lm.named_parameters()
                                      if id(p) in mine])
    return par, optimizer


def train_step(par, optimizer, step: int) -> tuple[float, float]:
    """One step on windows [step G, (step + 1) G); the loss and total gradient norm."""
    ids = lm.window_ids(step * G, G, N_WINDOWS, seed=1)
    batches = [lm.windows(DATA, part, T)
               for part in lm.microbatches(ids, par.dp_rank, par.dp_size, 1)]
    optimizer.zero_grad(set_to_none=True)
    loss = lm.forward_backward(par, batches, G, CPU).clone()
    dist.all_reduce(loss)  # the dp shares add up; every tp rank holds them: / tp
    norm = lm.clip_gradients(par, math.inf)  # inf: the norm, nothing scaled
    optimizer.step()
    return loss.item() / par.mesh.size("tp"), float(norm)


def reference(case: dict) -> list[dict]:
    """The unsplit model in one process: loss, norm and parameters at every step."""
    model = build(case, case["seed"])
    optimizer = make_optimizer(case, list(model.named_parameters()))
    history = []
    for step in range(case["k"] + case["m"]):
        x, y = lm.windows(DATA, lm.window_ids(step * G, G, N_WINDOWS, seed=1), T)
        optimizer.zero_grad(set_to_none=True)
        loss = model(x, y)
        loss.backward()
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), math.inf)
        optimizer.step()
        history.append({"loss": loss.item(), "norm": float(norm),
                        "params": {n: p.detach().clone() for n, p in model.named_parameters()}})
    return history


def agree(par, ref: dict, what: str, loss=None, norm=None) -> None:
    if loss is not None:
        torch.testing.assert_close(loss, ref["loss"], **TOL, msg=lambda m: f"{what} loss: {m}")
        torch.testing.assert_close(norm, ref["norm"], **TOL,
                                   msg=lambda m: f"{what} gradient norm: {m}")
    full = full_tensors(par, grads=False)
    for name, expected in ref["params"].items():
        torch.testing.assert_close(full[name].view_as(expected), expected, **TOL,
                                   msg=lambda m, name=name: f"{what} {name}: {m}")


def local(par) -> dict[str, torch.Tensor]:
    mine = {id(p) for p in par.modules.parameters()}
    return {n: p.detach().clone() for n, p in par.lm.named_parameters() if id(p) in mine}


def check_save(case: dict, path: str) -> None:
    k, m, a = case["k"], case["m"], case["a"]
    ref = reference(case)
    par, optimizer = distributed_run(case, a, case["seed"])
    saving = []
    for step in range(k + m):
        loss, norm = train_step(par, optimizer, step)
        agree(par, ref[step], f"layout A {a}, step {step}", loss, norm)
        saving.append(local(par))
        if step == k - 1:
            state = train.checkpoint_state(par, optimizer, step=k, position=k * G, global_batch=G)
            checkpoint.save(state, path, async_=case["async"])  # async: trains on at once
    checkpoint.wait()
    par, optimizer = distributed_run(case, a, case["seed"])
    for step in range(k + m):
        train_step(par, optimizer, step)
        for name, value in local(par).items():
            assert torch.equal(value, saving[step][name]), (
                f"step {step}: {name} differs after a save from a run that never saved (max "
                f"|diff| {(value - saving[step][name]).abs().max():.3g})")


def check_load(case: dict, path: str) -> None:
    k, m, b = case["k"], case["m"], case["b"]
    ref = reference(case)
    par, optimizer = distributed_run(case, b, init_seed=case["seed"] + 1)  # load overwrites
    state = train.checkpoint_state(par, optimizer, step=0, position=0, global_batch=0)
    checkpoint.load(state, path)
    assert (state["step"], state["data"]) == (k, {"position": k * G, "global_batch": G}), state
    agree(par, ref[k - 1], f"layout B {b}, just loaded")
    for step in range(k, k + m):
        loss, norm = train_step(par, optimizer, step)
        agree(par, ref[step], f"layout B {b}, step {step}", loss, norm)


def main():
    phase, path, case = sys.argv[1], sys.argv[2], json.loads(sys.argv[3])
    check = {"save": check_save, "load": check_load}[phase]

    def roundtrip(ctx):
        check(case, path)

    run_checks([roundtrip])


if __name__ == "__main__":
    main()
