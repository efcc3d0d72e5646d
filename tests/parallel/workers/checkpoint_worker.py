"""Save or load a resharding checkpoint under a given (pp, dp, tp) layout; report bit-equality.

    checkpoint_worker.py save|load DIR --pp P --tp T --dp-mode fsdp|ddp

Every parameter (and Adam's ``exp_avg`` / ``exp_avg_sq``) gets a value that depends only on
its name and global shape (`reference`), written block by block through
`meshrun.parallel.placement.pieces`. ``save`` writes ``DIR/step_42``. ``load`` starts from zeros,
loads the newest checkpoint in DIR, and checks that every block this rank holds, in its own
layout, equals the same block of the reference, bit for bit: so a save under one layout and a
load under another test resharding (FSDP rows, fused TP blocks with vocabulary padding,
pipeline stage ownership).
"""

import argparse
import zlib

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import Replicate

from meshrun.parallel import (
    ColwiseParallel,
    Mesh,
    RowwiseParallel,
    checkpoint,
    fully_shard,
    parallelize,
    placement,
    split_into_stages,
)
from tests.parallel.harness import run_checks

VOCAB, WIDTH, HEADS = 11, 8, 2  # vocab 11: padded to 12 under TP 2 (and 4), rows uneven


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.ln = nn.LayerNorm(WIDTH)
        self.qkv = nn.Linear(WIDTH, 3 * WIDTH)
        self.proj = nn.Linear(WIDTH, WIDTH)
        self.fc1 = nn.Linear(WIDTH, 2 * WIDTH)
        self.fc2 = nn.Linear(2 * WIDTH, WIDTH)

    def forward(self, x):
        q, k, v = self.qkv(self.ln(x)).chunk(3, dim=-1)
        x = x + self.proj(F.softmax(q @ k.transpose(-1, -2), dim=-1) @ v)
        return x + self.fc2(F.gelu(self.fc1(x)))


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(VOCAB, WIDTH)
        self.blocks = nn.ModuleList(Block() for _ in range(4))
        self.norm = nn.LayerNorm(WIDTH)
        self.head = nn.Linear(WIDTH, VOCAB)


PLAN = {"emb": RowwiseParallel(),
        "blocks.*.qkv": ColwiseParallel(chunks=3),
        "blocks.*.proj": RowwiseParallel(),
        "blocks.*.fc1": ColwiseParallel(),
        "blocks.*.fc2": RowwiseParallel(output_layouts=Replicate()),
        "head": ColwiseParallel(vocab_parallel=True)}


def reference(name: str, shape) -> torch.Tensor:
    g = torch.Generator().manual_seed(zlib.crc32(name.encode()))
    return torch.randn(tuple(shape), generator=g)


def build(args):
    """The model laid out as (pp, dp, tp) says; returns (model, this rank's params, optimizer)."""
    mesh = Mesh({"pp": args.pp, "dp": args.dp, "tp": args.tp})
    torch.manual_seed(0)
    model = Net()
    if args.tp > 1:
        parallelize(model, mesh.group("tp"), PLAN)
    stages = split_into_stages(model.blocks, args.pp, first=model.emb,
                               last=nn.Sequential(model.norm, model.head))
    mine = stages[mesh.rank("pp")]
    if args.dp_mode == "fsdp" and args.dp > 1:
        for block in mine.modules():
            if isinstance(block, Block):
                fully_shard(block, mesh.group("dp"))
        fully_shard(mine, mesh.group("dp"))
    params = list(mine.parameters())
    return model, params, torch.optim.AdamW(params, lr=1e-3)


def held_blocks(model, params, optimizer):
    """(name, global shape, block view) of every parameter and Adam state block held here."""
    held = {id(p) for p in params}
    for name, p in model.named_parameters():
        if id(p) not in held:
            continue
        tensors = {name: p, **{f"{name}.{k}": v for k, v in optimizer.state[p].items()
                               if v.dim()}}
        for key, t in tensors.items():
            for piece in placement.pieces(p):
                yield key, placement.global_shape(p), piece, piece.view(t)


def adam_steps(optimizer, params):
    return [v for p in params for v in optimizer.state[p].values() if not v.dim()]


def fill(model, params, optimizer, value):
    """Every held block := value(name) of the global tensor (value None: zeros)."""
    with torch.no_grad():
        for key, shape, piece, block in held_blocks(model, params, optimizer):
            block.copy_(value(key, shape)[piece.region] if value else torch.zeros_like(block))
        for step in adam_steps(optimizer, params):
            step.fill_(7.0 if value else 0.0)


def mismatches(model, params, optimizer) -> list[str]:
    bad = [f"{key} block at {piece.offsets}"
           for key, shape, piece, block in held_blocks(model, params, optimizer)
           if not torch.equal(block.detach(), reference(key, shape)[piece.region])]
    steps = [float(v) for v in adam_steps(optimizer, params)]
    if any(s != 7.0 for s in steps):
        bad.append(f"Adam steps {steps}")
    return bad


def main():
    p = argparse.ArgumentParser()
    p.add_argument("mode", choices=("save", "load"))
    p.add_argument("dir")
    p.add_argument("--pp", type=int, default=1)
    p.add_argument("--tp", type=int, default=1)
    p.add_argument("--dp-mode", choices=("fsdp", "ddp"), default="fsdp")
    args = p.parse_args()

    def roundtrip(ctx):
        args.dp = ctx.world_size // (args.pp * args.tp)
        model, params, optimizer = build(args)
        state = {"model": checkpoint.model_state(model, params=params), "step": 0,
                 "optim": checkpoint.optimizer_state(optimizer, model, params=params)}
        checkpoint.create_optimizer_state(optimizer)  # Adam's state, to fill
        if args.mode == "save":
            fill(model, params, optimizer, reference)
            state["step"] = 42
            checkpoint.save(state, f"{args.dir}/step_42")
            return
        fill(model, params, optimizer, None)
        checkpoint.load(state, checkpoint.latest(args.dir))
        bad = mismatches(model, params, optimizer)
        assert not bad, f"{len(bad)} blocks differ from the saved values: {bad[:5]}"
        assert state["step"] == 42, state["step"]

    run_checks([roundtrip])


if __name__ == "__main__":
    main()
