"""Worker: HSDP, `fully_shard(module, mesh=Mesh({"dp_replicate": 2, "dp_shard": 2}))`, 4 ranks.

- parity: a 3-layer model, each layer a unit then the root, trained 3 steps with AdamW on
  4 ranks' quarters of the global batch equals one process on the whole batch (gradients of
  the first step, parameters after each, 1e-5); each rank holds half of every parameter
  (sharded over 2, replicated over 2);
- resharding: a checkpoint saved under HSDP loads under FSDP over all 4 ranks and under ddp,
  and one more step there equals the one-process run's next step.
"""

import copy
import tempfile

import torch
import torch.distributed as dist
from torch import nn

from meshrun.parallel import Mesh, checkpoint, ddp, full_tensor, fully_shard
from tests.parallel.harness import run_checks

TOL = dict(atol=1e-5, rtol=1e-5)
B = 2  # per rank


def model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 10), nn.Tanh(), nn.Linear(10, 7), nn.Tanh(),
                         nn.Linear(7, 1))


def batch(step, rank=None):
    g = torch.Generator().manual_seed(10 + step)
    x, y = torch.randn(4 * B, 6, generator=g), torch.randn(4 * B, 1, generator=g)
    return (x, y) if rank is None else (x[rank * B:(rank + 1) * B], y[rank * B:(rank + 1) * B])


def shard(m, **how):
    for layer in (m[0], m[2], m[4]):
        fully_shard(layer, **how)
    return fully_shard(m, **how)


def optimizer(m):
    return torch.optim.AdamW(m.parameters(), lr=0.01, weight_decay=0.1)


def step(m, opt, i, rank):
    x, y = batch(i, rank)
    opt.zero_grad()
    torch.nn.functional.mse_loss(m(x), y).backward()
    opt.step()


def compare(m, ref, what):
    for (name, p), q in zip(m.named_parameters(), ref.parameters(), strict=True):
        torch.testing.assert_close(full_tensor(p, p.detach()), q.detach(), **TOL,
                                   msg=lambda msg, name=name: f"{what} {name}: {msg}")


def hsdp():
    return shard(model(), mesh=Mesh({"dp_replicate": 2, "dp_shard": 2}))


def check_parity(ctx):
    rank = dist.get_rank()
    ref, m = model(), hsdp()
    ref_opt, opt = optimizer(ref), optimizer(m)
    for p, q in zip(m.parameters(), ref.parameters(), strict=True):  # half of each, padded
        assert p.shape[0] == -(-q.shape[0] // 2) or p.shape[0] == q.shape[0] // 2, p.shape
    for i in range(3):
        step(m, opt, i, rank)
        step(ref, ref_opt, i, None)
        compare(m, ref, f"step {i}")


def check_reshard_to_fsdp_and_ddp(ctx):
    rank = dist.get_rank()
    ref, m = model(), hsdp()
    ref_opt, opt = optimizer(ref), optimizer(m)
    for i in range(2):
        step(m, opt, i, rank)
        step(ref, ref_opt, i, None)
    with tempfile.TemporaryDirectory() as tmp:
        box = [tmp]
        dist.broadcast_object_list(box)
        path = f"{box[0]}/step_2"
        checkpoint.save({"model": checkpoint.model_state(m),
                         "optim": checkpoint.optimizer_state(opt, m)}, path)
        step(ref, ref_opt, 2, None)
        for name, build in (("fsdp over 4", lambda: shard(model())),
                            ("ddp", lambda: ddp(copy.deepcopy(model())))):
            other = build()
            other_opt = optimizer(other)
            checkpoint.load({"model": checkpoint.model_state(other),
                             "optim": checkpoint.optimizer_state(other_opt, other)}, path)
            step(other, other_opt, 2, rank)
            compare(other, ref, f"{name}, loaded from HSDP, then a step")
        dist.barrier()


if __name__ == "__main__":
    run_checks([check_parity, check_reshard_to_fsdp_and_ddp])
