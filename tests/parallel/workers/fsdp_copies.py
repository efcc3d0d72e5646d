"""Neighbour copies of fully sharded state (meshrun.parallel.fsdp.copies), on 4 gloo processes
posing as 2 nodes of 2 (GROUP_RANK = rank // 2).

Each seeded trial draws a model (Linear layers of random sizes, rows fewer than ranks
included, a frozen layer sometimes), an optimizer (AdamW or SGD with momentum) and a refresh
interval, and trains it with `fully_shard` over the 4 ranks, refreshing the copies as
`meshrun.parallel.elastic` does (at the first step's start, then at each step's end: refresh,
settle, confirm). At a random step's end one node is lost, its exchange of copies complete on
every survivor, on none (in flight), or on one of the two (partly: only the previous generation
is then held by all); rank 2 leaves, and rank 3 comes back as a joiner (a fresh process would: a plain model of other values, an empty optimizer, no copies).
The three then form a new world (their ranks permuted), restore the state from the
copies, shard it again over 3 and train to the end. Three trials shard with HSDP before the
loss (shards within a node, replicas across the two): there the other node's replicas are
the copies, nothing is exchanged. Reference: one process training every
step on the whole global batch, never sharded; the final parameters must match it (so must
the optimizer state, or the later steps would drift), and the steps trained again must be
exactly those since the last refresh. One trial with copies off checks that `restore` says
it is not covered.
"""

import os
import random
import time
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

from meshrun.parallel import Mesh, ddp, fully_shard
from meshrun.parallel.context import init, rejoin
from meshrun.parallel.elastic import _teardown
from meshrun.parallel.fsdp.copies import Copies, NotCovered
from meshrun.parallel.placement import full_tensor, of
from tests.parallel.harness import RESULTS_ENV, exit_without_teardown, report

GLOBAL_BATCH, STEPS, D_IN = 12, 6, 5  # 12 rows split over 4, 3 or 1 ranks
TRIALS, HSDP_FROM = 10, 7  # seeds 7-9 shard with HSDP (2 replicas x 2 shards) before the loss
# per seed: bf16 (the first layer in bfloat16, the rest fp32), sched (an LR scheduler in the
# state), shared (the last layer also under a second key of the state), join (a step more
# after the refresh, then the snapshot of a join's boundary, then the loss), to_ddp (the new
# world trains the restored model with ddp instead of sharding it again)
EXTRAS = ["none", "bf16", "sched", "shared", "join", "to_ddp", "bf16", "sched", "join", "shared"]
# per seed: how far the exchange of the loss's step got (HSDP and join: nothing in flight)
EXCHANGE = ["settled", "partly", "flight", "partly", "settled", "flight", "settled", "settled",
            "settled", "settled"]


class Cast(nn.Module):
    def __init__(self, dtype):
        super().__init__()
        self.dtype = dtype

    def forward(self, x):
        return x.to(self.dtype)


def _model(spec, seed):
    torch.manual_seed(seed)
    dims = [D_IN, *spec["hidden"], 2]
    layers = [nn.Linear(a, b, bias=i % 2 == 0) for i, (a, b) in enumerate(zip(dims, dims[1:], strict=False))]
    if spec["frozen"] is not None:
        layers[spec["frozen"]].weight.requires_grad_(False)
    mods = [m for layer in layers for m in (layer, nn.Tanh())][:-1]
    if spec["extra"] == "bf16":
        mods = [Cast(torch.bfloat16), layers[0].to(torch.bfloat16), Cast(torch.float32), *mods[1:]]
    return nn.Sequential(*mods)


def _state(spec, model, optimizer):
    state = {"model": model, "optim": optimizer, "position": 0, "step": 0}
    if spec["extra"] == "sched":
        state["sched"] = torch.optim.lr_scheduler.StepLR(optimizer, step_size=2, gamma=0.5)
    if spec["extra"] == "shared":
        state["head"] = model[-1]
    return state


def _optimizer(spec, model):
    params = [p for p in model.parameters() if p.requires_grad]
    if spec["optim"] == "adamw":
        return torch.optim.AdamW(params, lr=0.05, weight_decay=0.1)
    return torch.optim.SGD(params, lr=0.1, momentum=0.9)


def _batch(step):
    g = torch.Generator().manual_seed(1000 + step)
    return torch.randn(GLOBAL_BATCH, D_IN, generator=g), torch.randn(GLOBAL_BATCH, 2, generator=g)


def _train_step(state, step, rank, world):
    x, y = _batch(step)
    rows = slice(rank * GLOBAL_BATCH // world, (rank + 1) * GLOBAL_BATCH // world)
    state["optim"].zero_grad(set_to_none=True)
    (state["model"](x[rows]) - y[rows]).square().mean().backward()  # fsdp: mean over ranks
    state["optim"].step()
    if "sched" in state:
        state["sched"].step()


def _shard(model, hsdp=False):
    """FSDP over the world; ``hsdp``: shard within each node, replicate across the two."""
    mesh = Mesh({"dp_replicate": 2, "dp_shard": 2}) if hsdp else None
    for m in model:
        if isinstance(m, nn.Linear):
            fully_shard(m, mesh=mesh)
    fully_shard(model, mesh=mesh)


def _new_world(name, rank, world, host):
    """Leave the current world (if any) and join ``name``'s, hosted by ``host`` (its port in a
    file of the results directory)."""
    if dist.is_initialized():
        dist.destroy_process_group()
    path = Path(os.environ[RESULTS_ENV]) / f"port_{name}"
    store = None
    if host:
        store = dist.TCPStore("127.0.0.1", 0, world, True, wait_for_workers=False)
        path.write_text(str(store.port))
    while not path.exists() or not path.read_text():
        time.sleep(0.01)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=path.read_text(), RANK=str(rank),
                      WORLD_SIZE=str(world), GROUP_RANK=str(rank // 2))
    rejoin()
    return store


def trial(seed, me):
    rnd = random.Random(seed)
    spec = {"hidden": [rnd.randint(1, 9) for _ in range(rnd.randint(1, 3))],
            "frozen": None, "optim": rnd.choice(["adamw", "sgd"]), "extra": EXTRAS[seed]}
    if rnd.random() < 0.5:
        spec["frozen"] = rnd.randrange(len(spec["hidden"]) + 1)
    every = rnd.choice([1, 2, 3]) if seed else 0
    hsdp = seed >= HSDP_FROM  # the replicas on the other node are the copies
    lost_at = rnd.randint(1, STEPS - 1)  # at the end of this many steps, in its refresh
    exchange = EXCHANGE[seed]
    assert exchange == "settled" or not (hsdp or spec["extra"] == "join")
    if exchange != "settled" and every:  # lost in an exchange: at a refresh step's end
        lost_at = max(every, lost_at - lost_at % every)
    order = rnd.sample([0, 1, 3], 3)  # old rank -> new rank by position

    reference = _model(spec, seed)
    ref_state = _state(spec, reference, _optimizer(spec, reference))
    for step in range(STEPS):
        _train_step(ref_state, step, 0, 1)

    stores = [_new_world(f"{seed}a", me, 4, me == 0)]
    model = _model(spec, seed)
    _shard(model, hsdp)
    state = _state(spec, model, _optimizer(spec, model))
    copies = Copies(every)
    copies.exchange(state, round=seed * 10)  # before a new world's first step
    while True:
        _train_step(state, state["step"], me, 4)
        state["step"] += 1
        state["position"] += GLOBAL_BATCH
        copies.refresh(state, round=seed * 10)  # the step's end (`_Loop.finish_step`)
        if state["step"] == lost_at:
            if exchange == "settled" or (exchange == "partly" and me == 0):
                copies.settle()
            break
        copies.settle()
        copies.confirm()
    exact_at = state["step"]  # the full parameters here, to compare a restore of this step
    before = [full_tensor(of(p), p.detach()).clone() for p in model.parameters()]
    if spec["extra"] == "join":  # one step more, then a join's boundary snapshot
        _train_step(state, state["step"], me, 4)
        state["step"] += 1
        state["position"] += GLOBAL_BATCH
        copies.keep_own(state, round=seed * 10)
    dist.barrier()  # every rank is done with the old world before any leaves it
    _teardown(state)
    result = {}
    if me != 2:  # rank 2's node is lost; rank 3 comes back as a fresh process would
        if me == 3:
            model = _model(spec, seed + 77)
            state = _state(spec, model, _optimizer(spec, model))
            state["position"] = -1
            copies = Copies(every)
        new_rank = order.index(me)
        stores.append(_new_world(f"{seed}b", new_rank, 3, new_rank == 0))
        holdings = [None] * 3
        dist.all_gather_object(holdings, copies.holdings(state))
        try:
            used = copies.restore(state, holdings)
        except NotCovered as e:
            result = {"covered": False, "why": str(e),  # full shapes, for a checkpoint's load
                      "full_shapes": [tuple(p.shape) for p in model.parameters()]
                      == [tuple(p.shape) for p in reference.parameters()]}
        else:
            result = {"covered": True, "used": used, "step": state["step"],
                      "position": state["position"]}
            if state["step"] == exact_at:  # restored whole: bit for bit what was trained
                result["restore_exact"] = all(torch.equal(p, b) for p, b in zip(
                    model.parameters(), before, strict=True))
            if spec["extra"] == "to_ddp":
                ddp(model)
            else:
                _shard(model)
            copies.after_build()
            for step in range(state["step"], STEPS):
                _train_step(state, step, new_rank, 3)
            diffs = [(full_tensor(of(p), p.detach()) - q).abs().max().item()
                     for p, q in zip(model.parameters(), reference.parameters(), strict=True)]
            result["max_diff"] = max(diffs)
        _teardown(state)
    stores.append(_new_world(f"{seed}c", me, 4, me == 0))  # everyone, for the next trial
    dist.barrier()
    last_refresh = lost_at - lost_at % max(every, 1)
    if exchange != "settled" and last_refresh == lost_at:  # not held by all: the one before
        last_refresh -= max(every, 1)
    if spec["extra"] == "join" and hsdp:  # every shard's own snapshot of the boundary survives
        last_refresh = lost_at + 1
    return {"seed": seed, "every": every, "lost_at": lost_at, "expect_step": last_refresh,
            "settled": exchange == "settled", "partly": exchange == "partly", "hsdp": hsdp, "extra": spec["extra"],
            "frozen": spec["frozen"], "optim": spec["optim"], **result}


def adafactor_refused():
    """Adafactor's factored moments are not of the parameter's shape: the refresh refuses."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(D_IN, 8), nn.Tanh(), nn.Linear(8, 4))  # rows on every rank
    _shard(model)
    optimizer = torch.optim.Adafactor(model.parameters())
    state = _state({"extra": "none"}, model, optimizer)
    model(_batch(0)[0]).square().mean().backward()
    optimizer.step()
    try:
        Copies(1).refresh(state, round=999)
    except RuntimeError as e:
        return str(e)
    return "accepted"


if __name__ == "__main__":
    ctx = init(timeout=60)
    trials = [trial(seed, ctx.rank) for seed in range(TRIALS)]
    report({"trials": trials, "adafactor": adafactor_refused()})
    dist.destroy_process_group()
    exit_without_teardown()
