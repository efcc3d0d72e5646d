"""meshrun.parallel.elastic checks on a 2-process gloo group (one launch for all of them):
the state agreement after a change of world, ddp undone and applied again on a live module,
and leaving a world for a new one in the same process (`context.rejoin`)."""

import os
from datetime import timedelta

import torch
import torch.distributed as dist
from torch import nn

from meshrun.parallel import ddp, elastic
from meshrun.parallel.ddp import unwrap
from tests.parallel.harness import run_checks


def _model(seed):
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 2))


def _stepped(model, steps):
    """An AdamW optimizer over ``model`` that took ``steps`` steps on a seeded batch."""
    opt = torch.optim.AdamW(model.parameters(), lr=0.1)
    x = torch.randn(6, 4, generator=torch.Generator().manual_seed(3))
    for _ in range(steps):
        opt.zero_grad()
        model(x).square().mean().backward()
        opt.step()
    return opt


def check_agree_takes_the_most_steps(ctx):
    # rank 1 did more steps: every rank ends with its parameters, optimizer state and values
    steps = 5 if ctx.rank == 1 else 3
    model = _model(seed=ctx.rank)
    opt = _stepped(model, steps)
    state = {"model": model, "optim": opt, "position": 100 * steps, "step": steps}
    elastic._agree(state)
    ref = _model(seed=1)
    ref_opt = _stepped(ref, 5)
    assert state["step"] == 5 and state["position"] == 500, state
    for p, q in zip(model.parameters(), ref.parameters(), strict=True):
        assert torch.equal(p, q)
    assert opt.state_dict()["state"][0]["step"].item() == 5
    for a, b in zip(opt.state_dict()["state"].values(), ref_opt.state_dict()["state"].values(),
                    strict=True):
        assert torch.equal(a["exp_avg"], b["exp_avg"]) and torch.equal(a["exp_avg_sq"],
                                                                        b["exp_avg_sq"])


def check_agree_leaves_equal_steps_alone(ctx):
    # equal step counts: replicas that did the same steps hold the same values: no broadcast
    model = _model(seed=ctx.rank)
    before = [p.detach().clone() for p in model.parameters()]
    state = {"model": model, "step": 4, "position": ctx.rank}
    elastic._agree(state)
    assert state["position"] == ctx.rank
    assert all(torch.equal(p, b) for p, b in zip(model.parameters(), before, strict=True))


def check_unwrap_then_ddp_again(ctx):
    model = ddp(_model(seed=0))
    assert unwrap(model) and not unwrap(model)
    assert not hasattr(model, "no_sync") and not hasattr(model, "_meshrun_ddp")
    x = torch.randn(2, 4, generator=torch.Generator().manual_seed(10 + ctx.rank))
    model(x).sum().backward()  # no hooks left: the gradient stays local
    local = [p.grad.clone() for p in model.parameters()]
    model.zero_grad(set_to_none=True)
    ddp(model, dist.new_group([0, 1]))  # applied again, over another group
    model(x).sum().backward()
    for p, g in zip(model.parameters(), local, strict=True):
        mean = g.clone()
        dist.all_reduce(mean)
        assert torch.allclose(p.grad, mean / 2, atol=1e-6), (p.grad, mean / 2)


def check_peer_lost_reads_the_message(ctx):
    reset = RuntimeError("[pair.cc:537] Read error [127.0.0.1]:1: Connection reset by peer.")
    assert elastic.peer_lost(reset)
    try:
        try:
            raise reset
        except RuntimeError as e:
            raise RuntimeError("a DDP callback failed") from e
    except RuntimeError as wrapped:
        assert elastic.peer_lost(wrapped)  # through __cause__
    assert not elastic.peer_lost(RuntimeError("CUDA out of memory"))
    assert not elastic.peer_lost(ValueError("Connection reset by peer"))  # not a collective's


def check_teardown_and_rejoin_a_new_world(ctx):
    # what `steps` does when the agent hands a new round: leave every group, join a new store
    from meshrun.parallel.context import init, rejoin

    port = torch.tensor([0])
    store = None
    if ctx.rank == 0:
        store = dist.TCPStore("127.0.0.1", 0, 2, True, timeout=timedelta(seconds=30),
                              wait_for_workers=False)
        port[0] = store.port
    dist.broadcast(port, src=0)
    model = ddp(_model(seed=0))
    elastic._teardown({"model": model})
    assert not dist.is_initialized() and not hasattr(model, "_meshrun_ddp")
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(int(port)),
                      RANK=str(1 - ctx.rank))  # the ranks swap in the new world
    new = rejoin()
    assert new.rank == 1 - ctx.rank and new.world_size == 2 and init() is new
    t = torch.tensor([float(new.rank)])
    dist.all_reduce(t)
    assert t.item() == 1.0
    ddp(model)  # the strategies apply to the live module in the new world
    model(torch.ones(1, 4)).sum().backward()
    globals()["_keep_store"] = store  # rank 0 serves the new world until the end


if __name__ == "__main__":
    run_checks([check_agree_takes_the_most_steps, check_agree_leaves_equal_steps_alone,
                check_unwrap_then_ddp_again, check_peer_lost_reads_the_message,
                check_teardown_and_rejoin_a_new_world])
