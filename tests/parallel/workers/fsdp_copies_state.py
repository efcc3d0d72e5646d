"""Neighbour copies when the optimizer's state changes shape during training (4 gloo ranks
posing as 2 nodes of 2).

Each scenario trains a small model under `fully_shard` with `Copies.exchange` at every step's
end, as `meshrun.parallel.elastic` does, while something changes what each parameter's
optimizer state holds: a key added at a later step (Lookahead / SWA-style buffers), the
optimizer replaced by another class, or reloaded from its own state dict (torch then casts
state tensors to the parameter's dtype: a mixed-precision optimizer's fp32 moments of bf16
parameters become bf16). After the last step, ranks 2 and 3 stand for the lost node: they
become fresh processes would (a new model, a new optimizer, no copies), every rank restores,
and the restored parameters and optimizer state must equal what was trained, bit for bit
(the reference: the full tensors gathered from the live ranks before the "loss"). Found by a
breaker: a layout cached on "which parameters have state" missed all three.
"""

import os

import torch
from torch import nn

from meshrun.parallel import fully_shard
from meshrun.parallel.context import init
from meshrun.parallel.fsdp import release
from meshrun.parallel.fsdp.copies import Copies
from meshrun.parallel.placement import full_tensor, of
from tests.parallel.harness import report

D_IN, BATCH, STEPS = 5, 8, 5


class _PerParameter(torch.optim.Optimizer):
    """An optimizer whose `update` sees one parameter with a gradient and its state."""

    def __init__(self, params, lr):
        super().__init__(params, {"lr": lr})

    @torch.no_grad()
    def step(self):
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is not None:
                    self.update(p, self.state[p], group["lr"])


class LateKey(_PerParameter):
    """SGD with momentum that also keeps an average of the parameter from its 3rd step."""

    def __init__(self, params, lr=0.1):
        super().__init__(params, lr)

    def update(self, p, st, lr):
        st["n"] = st.get("n", 0) + 1
        st.setdefault("buf", torch.zeros_like(p)).mul_(0.9).add_(p.grad)
        p.add_(st["buf"], alpha=-lr)
        if st["n"] >= 3:
            st.setdefault("avg", p.detach().clone()).mul_(0.5).add_(p, alpha=0.5)


class Fp32Moments(_PerParameter):
    """Adam-like, keeping fp32 moments for low-precision parameters."""

    def __init__(self, params, lr=0.01):
        super().__init__(params, lr)

    def update(self, p, st, lr):
        if not st:
            st["m"] = torch.zeros_like(p, dtype=torch.float32)
            st["v"] = torch.zeros_like(p, dtype=torch.float32)
        g = p.grad.float()
        st["m"].mul_(0.9).add_(g, alpha=0.1)
        st["v"].mul_(0.99).addcmul_(g, g, value=0.01)
        p.sub_((lr * st["m"] / (st["v"].sqrt() + 1e-8)).to(p.dtype))


class Net(nn.Module):
    def __init__(self, seed, dtype=torch.float32):
        super().__init__()
        torch.manual_seed(seed)
        self.seq = nn.Sequential(nn.Linear(D_IN, 7), nn.Linear(7, 3), nn.Linear(3, 2)).to(dtype)

    def forward(self, x):
        for layer in self.seq:
            x = torch.tanh(layer(x.to(layer.weight.dtype))).float()
        return x


def _state(seed, shard, optimizer, dtype=torch.float32):
    net = Net(seed, dtype)
    if shard:
        for layer in net.seq:
            fully_shard(layer)
    return {"model": net, "optim": optimizer(list(net.parameters())), "step": 0}


def _adam(ps):
    return torch.optim.Adam(ps, lr=0.05)


def _sgd(ps):
    return torch.optim.SGD(ps, lr=0.1, momentum=0.9)


def _amsgrad(ps):
    return torch.optim.Adam(ps, lr=0.05, amsgrad=True)


def _reload(state):
    state["optim"].load_state_dict(state["optim"].state_dict())


# name: (optimizer at the start, dtype, before which step what happens, the joiner's optimizer)
SCENARIOS = {
    "a key added at step 3": (LateKey, torch.float32, {}, LateKey),
    "Adam replaced by SGD": (_adam, torch.float32, {3: lambda s: _swap(s, _sgd)}, _sgd),
    "SGD replaced by Adam": (_sgd, torch.float32, {3: lambda s: _swap(s, _adam)}, _adam),
    "Adam replaced by AMSGrad": (_adam, torch.float32, {3: lambda s: _swap(s, _amsgrad)},
                                 _amsgrad),
    "fp32 moments reloaded as bf16, views cached": (Fp32Moments, torch.bfloat16, {3: _reload},
                                                    Fp32Moments),
    "fp32 moments reloaded as bf16, new views": (Fp32Moments, torch.bfloat16, {1: _reload},
                                                 Fp32Moments),
}


def _swap(state, make):
    state["optim"] = make(state["optim"].param_groups[0]["params"])


def _truth(state) -> dict:
    """Every parameter and optimizer state tensor, full, by name (a collective)."""
    out = {}
    for n, p in state["model"].named_parameters():
        out[n] = full_tensor(of(p), p.detach()).clone()
        for k, v in sorted(state["optim"].state.get(p, {}).items()):
            full = torch.is_tensor(v) and v.dim() > 0
            out[f"{n}/{k}"] = full_tensor(of(p), v).clone() if full else v
    return out


def _differences(got: dict, want: dict) -> list[str]:
    bad = [f"{k}: missing" for k in want if k not in got]
    bad += [f"{k}: not trained" for k in got if k not in want]
    for k in sorted(set(got) & set(want)):
        a, b = got[k], want[k]
        same = (torch.is_tensor(a) and torch.is_tensor(b) and a.dtype == b.dtype
                and a.shape == b.shape and torch.equal(a, b)) if torch.is_tensor(b) else a == b
        if not same:
            bad.append(f"{k}: {getattr(a, 'dtype', a)} against {getattr(b, 'dtype', b)}")
    return bad


def scenario(rank, start, dtype, events, joiner) -> list[str]:
    state = _state(0, True, start, dtype)
    copies = Copies(1)
    copies.exchange(state, 1)
    for step in range(STEPS):
        if step in events:
            events[step](state)
        g = torch.Generator().manual_seed(1000 + step)
        x, y = torch.randn(BATCH, D_IN, generator=g), torch.randn(BATCH, 2, generator=g)
        rows = slice(rank * BATCH // 4, (rank + 1) * BATCH // 4)
        state["optim"].zero_grad(set_to_none=True)
        (state["model"](x[rows]) - y[rows]).square().mean().backward()
        state["optim"].step()
        state["step"] += 1
        copies.exchange(state, 1)
    want = _truth(state)
    if rank >= 2:  # the lost node's ranks come back as fresh processes
        state, copies = _state(99, False, joiner, dtype), Copies(1)
    else:
        for layer in state["model"].seq:
            release(layer)
    holdings = [None] * 4
    torch.distributed.all_gather_object(holdings, copies.holdings(state))
    copies.restore(state, holdings)
    got = {n: p.detach() for n, p in state["model"].named_parameters()}
    for n, p in state["model"].named_parameters():
        got.update({f"{n}/{k}": v for k, v in state["optim"].state.get(p, {}).items()})
    return _differences(got, want) + ([] if state["step"] == STEPS else
                                      [f"restored step {state['step']}, not {STEPS}"])


def a_parameter_in_two_optimizers_is_refused() -> str:
    state = _state(0, True, _adam)
    state["optim2"] = _sgd(list(state["model"].parameters())[:2])
    try:
        Copies(1).refresh(state, 2)
    except RuntimeError as e:
        return str(e)
    return "accepted"


if __name__ == "__main__":
    ctx = init(timeout=60)
    os.environ["GROUP_RANK"] = str(ctx.rank // 2)  # two nodes of two: keepers on the other
    results = {name: scenario(ctx.rank, *spec) for name, spec in SCENARIOS.items()}
    report({"scenarios": results, "two": a_parameter_in_two_optimizers_is_refused()})
