"""Train a small character-level transformer on Tiny Shakespeare (nanoGPT-style).

A plain torchrun script: it reads RANK / LOCAL_RANK / WORLD_SIZE from the environment, so it
runs unchanged under ``torchrun``, under ``meshrun``, or as plain ``python`` (one process):

    meshrun --nproc-per-node 2 examples/train_char_lm.py --steps 300 --checkpoint-dir ckpt
    torchrun --nproc-per-node 2 examples/train_char_lm.py --dp-mode torch-ddp

Data parallelism: ``--dp-mode ddp`` (default) uses ``meshrun.parallel.ddp``; ``torch-ddp`` uses
torch's ``DistributedDataParallel`` (the reference); ``fsdp`` shards each block, then the rest,
with ``meshrun.parallel.fully_shard`` (ZeRO-3; no ``--checkpoint-dir`` yet). Each step draws one global batch of random
windows from a generator seeded with (seed, step); rank r trains on its slice of it, so the
data depend only on the step number (a resumed run sees exactly the batches it would have).

Pipeline parallelism: ``--pp N`` (or ``--parallel pp``) splits the blocks into N stages with
``meshrun.parallel.split_into_stages`` and trains them with ``--pp-schedule`` (1F1B by default)
over ``--pp-microbatches`` microbatches; the loss equals the unsplit model's on the same batch.

Tensor parallelism: ``--tp N`` (or ``--parallel tp``) shards attention heads, MLP and the
vocabulary over N ranks with ``meshrun.parallel.parallelize`` and `tp_plan` (Megatron-style,
vocab-parallel loss); ``--sequence-parallel`` also shards norms and residuals along the
sequence. Ranks of one TP group see the same batch; ``ddp`` runs over the rest of the world.

Checkpoints (``--checkpoint-dir``): rank 0 writes model, optimizer, step and RNG state every
``--checkpoint-every`` steps and at the end, to a temporary file then ``os.replace`` (atomic),
so a kill mid-save never leaves a corrupt checkpoint. On start every rank resumes from it if
present (the directory must be visible to every rank). ``--fail-at-step S`` makes rank 0 raise
at step S on the first attempt (TORCHELASTIC_RESTART_COUNT=0), to show restart + resume.
"""

import argparse
import math
import os
import sys
import time
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

# -------------------------------------------------------------------------------------------
# config (defaults tuned so 300 steps on 2 CPU ranks take well under 3 minutes)
DATA = os.path.join(os.path.dirname(os.path.abspath(__file__)), "data", "tinyshakespeare.txt")
N_LAYER, N_HEAD, N_EMBD = 4, 4, 128
DEFAULTS = dict(steps=300, batch_size=16, block_size=64, lr=3e-3, seed=1337, log_every=25,
                checkpoint_every=100)
# data-parallel strategies; --parallel X is a shorthand for the single-strategy cases
DP_MODES = ("ddp", "fsdp", "torch-ddp")


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=DEFAULTS["steps"])
    p.add_argument("--batch-size", type=int, default=DEFAULTS["batch_size"], help="per rank")
    p.add_argument("--block-size", type=int, default=DEFAULTS["block_size"])
    p.add_argument("--lr", type=float, default=DEFAULTS["lr"])
    p.add_argument("--seed", type=int, default=DEFAULTS["seed"])
    p.add_argument("--log-every", type=int, default=DEFAULTS["log_every"])
    p.add_argument("--checkpoint-dir", default=None)
    p.add_argument("--checkpoint-every", type=int, default=DEFAULTS["checkpoint_every"])
    p.add_argument("--dp-mode", choices=DP_MODES, default="ddp")
    p.add_argument("--parallel", choices=DP_MODES + ("tp", "pp"), default=None,
                   help="shorthand for --dp-mode, or tp: --tp <world size>, pp: --pp <world size>")
    p.add_argument("--tp", type=int, default=1, help="tensor-parallel degree (Megatron-style)")
    p.add_argument("--sequence-parallel", action="store_true", help="with --tp: shard norms "
                   "and residuals along the sequence")
    p.add_argument("--pp", type=int, default=1, help="pipeline-parallel degree (stages)")
    p.add_argument("--pp-schedule", choices=("gpipe", "1f1b", "interleaved1f1b"),
                   default="1f1b", help="with --pp: interleaved1f1b puts 2 stages on a rank")
    p.add_argument("--pp-microbatches", type=int, default=4, help="with --pp: per step")
    p.add_argument("--fail-at-step", type=int, default=None, help="testing: rank 0 raises here")
    args = p.parse_args(argv)
    if args.parallel == "tp":
        args.tp = int(os.environ.get("WORLD_SIZE", 1))
    elif args.parallel == "pp":
        args.pp = int(os.environ.get("WORLD_SIZE", 1))
    elif args.parallel is not None:
        args.dp_mode = args.parallel
    return args


# -------------------------------------------------------------------------------------------
# model: token + position embedding, pre-norm blocks (causal self-attention + MLP), norm, head


class Block(nn.Module):
    def __init__(self, n_embd, n_head):
        super().__init__()
        self.n_head = n_head
        self.head_dim = n_embd // n_head
        self.ln1 = nn.LayerNorm(n_embd)
        self.qkv = nn.Linear(n_embd, 3 * n_embd)
        self.proj = nn.Linear(n_embd, n_embd)
        self.ln2 = nn.LayerNorm(n_embd)
        self.mlp = nn.Sequential(nn.Linear(n_embd, 4 * n_embd), nn.GELU(),
                                 nn.Linear(4 * n_embd, n_embd))

    def forward(self, x):
        # shapes from qkv, not x, and -1 for the head count: under tensor parallelism a rank
        # holds n_head / tp heads, and under sequence parallelism x holds T / tp tokens
        qkv = self.qkv(self.ln1(x))
        B, T, _ = qkv.shape
        q, k, v = (t.view(B, T, -1, self.head_dim).transpose(1, 2) for t in qkv.chunk(3, dim=2))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(y.transpose(1, 2).reshape(B, T, -1))
        return x + self.mlp(self.ln2(x))


class CharLM(nn.Module):
    def __init__(self, vocab_size, block_size, n_layer=N_LAYER, n_head=N_HEAD, n_embd=N_EMBD):
        super().__init__()
        self.tok_emb = nn.Embedding(vocab_size, n_embd)
        self.pos_emb = nn.Embedding(block_size, n_embd)
        self.blocks = nn.Sequential(*[Block(n_embd, n_head) for _ in range(n_layer)])
        self.ln_f = nn.LayerNorm(n_embd)
        self.head = nn.Linear(n_embd, vocab_size)
        self.loss_fn = F.cross_entropy  # --tp: the vocab-parallel loss (logits stay sharded)

    def forward(self, idx, targets):
        pos = torch.arange(idx.shape[1], device=idx.device)
        x = self.blocks(self.tok_emb(idx) + self.pos_emb(pos))
        logits = self.head(self.ln_f(x))
        return self.loss_fn(logits.view(-1, logits.shape[-1]), targets.view(-1))


# -------------------------------------------------------------------------------------------
# data: one global batch of random windows per step, sliced by data-parallel rank


def load_text(path=DATA):
    with open(path) as f:
        text = f.read()
    chars = sorted(set(text))
    stoi = {c: i for i, c in enumerate(chars)}
    return torch.tensor([stoi[c] for c in text], dtype=torch.long), len(chars)


def get_batch(data, step, seed, batch_size, block_size, dp_rank, dp_size):
    g = torch.Generator().manual_seed(seed * 1_000_003 + step)
    starts = torch.randint(len(data) - block_size - 1, (batch_size * dp_size,), generator=g)
    starts = starts[dp_rank * batch_size:(dp_rank + 1) * batch_size]
    x = torch.stack([data[s:s + block_size] for s in starts])
    y = torch.stack([data[s + 1:s + 1 + block_size] for s in starts])
    return x, y


# -------------------------------------------------------------------------------------------
# checkpoints: rank 0 writes to a temp file and renames it (atomic); every rank reads


def save_checkpoint(ckpt_dir, model, optimizer, step):
    os.makedirs(ckpt_dir, exist_ok=True)
    path = os.path.join(ckpt_dir, "ckpt.pt")
    state = {"model": model.state_dict(), "optimizer": optimizer.state_dict(), "step": step,
             "rng": torch.get_rng_state()}
    torch.save(state, path + ".tmp")
    os.replace(path + ".tmp", path)


def load_checkpoint(ckpt_dir, model, optimizer, device):
    path = os.path.join(ckpt_dir, "ckpt.pt") if ckpt_dir else None
    if path is None or not os.path.exists(path):
        return 0
    state = torch.load(path, map_location=device)
    model.load_state_dict(state["model"])
    optimizer.load_state_dict(state["optimizer"])
    torch.set_rng_state(state["rng"].cpu())
    return state["step"]


# -------------------------------------------------------------------------------------------
# data-parallel wrapping: one function per strategy


def apply_ddp(model, device):
    try:  # imported only here: torch-ddp mode needs no meshrun
        from meshrun.parallel import ddp
    except ImportError as e:
        raise SystemExit(f"--dp-mode ddp needs meshrun importable ({e}): `pip install -e .` "
                         f"or set PYTHONPATH to the repository root") from None
    return ddp(model), model


def apply_torch_ddp(model, device):
    from torch.nn.parallel import DistributedDataParallel

    ids = [device.index] if device.type == "cuda" else None
    return DistributedDataParallel(model, device_ids=ids), model  # (wrapped, raw for state)


def apply_fsdp(model, device):
    from meshrun.parallel import fully_shard

    for block in model.blocks:  # one unit per block, then the root: embeddings, norm, head
        fully_shard(block)
    return fully_shard(model), model  # the optimizer steps on the shards it already holds


STRATEGIES = {"ddp": apply_ddp, "fsdp": apply_fsdp, "torch-ddp": apply_torch_ddp}


# -------------------------------------------------------------------------------------------
# tensor parallelism (--tp N): Megatron-style, vocab-parallel embedding and loss; data
# parallelism (meshrun ddp) over the remaining world_size / N ranks


def tp_plan(sequence_parallel=False):
    """The CharLM's TP plan: attention and MLP are column -> row pairs; vocab-parallel ends."""
    from torch.distributed.tensor import Replicate, Shard

    from meshrun.parallel import (
        ColwiseParallel,
        PrepareModuleInput,
        RowwiseParallel,
        SequenceParallel,
    )

    seq = Shard(1) if sequence_parallel else Replicate()  # activations between TP regions
    plan = {
        "tok_emb": RowwiseParallel(),  # vocab-parallel embedding (65 chars padded to 66)
        "blocks.*.qkv": ColwiseParallel(input_layouts=seq, chunks=3),  # whole heads per rank
        "blocks.*.proj": RowwiseParallel(output_layouts=seq),
        "blocks.*.mlp.0": ColwiseParallel(input_layouts=seq),
        "blocks.*.mlp.2": RowwiseParallel(output_layouts=seq),
        "head": ColwiseParallel(input_layouts=seq, vocab_parallel=True),  # sharded logits
    }
    if sequence_parallel:  # split the sequence after the embeddings; norms on token shards
        plan["blocks"] = PrepareModuleInput(input_layouts=Replicate(),
                                            desired_input_layouts=Shard(1))
        for name in ("blocks.*.ln1", "blocks.*.ln2", "ln_f"):
            plan[name] = SequenceParallel()
    return plan


def apply_tp(model, tp, sequence_parallel):
    """Shard the model over groups of ``tp`` ranks; return (model, dp_rank, dp_size)."""
    from functools import partial

    from meshrun.parallel import Mesh, ddp, parallelize, vocab_parallel_cross_entropy

    world_size = dist.get_world_size()
    if world_size % tp:
        raise SystemExit(f"--tp {tp} must divide the world size {world_size}")
    mesh = Mesh({"dp": world_size // tp, "tp": tp})
    parallelize(model, mesh.group("tp"), tp_plan(sequence_parallel))
    model.loss_fn = partial(vocab_parallel_cross_entropy, group=mesh.group("tp"))
    if mesh.size("dp") > 1:
        ddp(model, mesh.group("dp"))
    return model, mesh.rank("dp"), mesh.size("dp")


# -------------------------------------------------------------------------------------------
# pipeline parallelism (--pp N): the blocks split into N stages (2N with interleaved 1F1B),
# embeddings on the first, norm and head on the last; meshrun ddp over world_size / N ranks


class Embed(nn.Module):  # the first stage's prologue: CharLM.forward's embedding line
    def __init__(self, lm):
        super().__init__()
        self.tok_emb, self.pos_emb = lm.tok_emb, lm.pos_emb

    def forward(self, idx):
        return self.tok_emb(idx) + self.pos_emb(torch.arange(idx.shape[1], device=idx.device))


class LMHead(nn.Module):  # the last stage's epilogue: final norm and head -> logits
    def __init__(self, lm):
        super().__init__()
        self.ln_f, self.head = lm.ln_f, lm.head

    def forward(self, x):
        return self.head(self.ln_f(x))


def lm_loss(logits, targets):
    return F.cross_entropy(logits.view(-1, logits.shape[-1]), targets.view(-1))


def apply_pp(model, args):
    """Split the model into stages; return (this rank's stage modules, schedule, dp rank/size)."""
    from meshrun.parallel import Mesh, ddp
    from meshrun.parallel.pipelining import pipeline, split_into_stages

    world_size = dist.get_world_size()
    if world_size % args.pp or args.tp > 1:
        raise SystemExit(f"--pp {args.pp} must divide the world size {world_size} (and is not "
                         f"combined with --tp yet)")
    mesh = Mesh({"pp": args.pp, "dp": world_size // args.pp})
    n_stages = args.pp * (2 if args.pp_schedule == "interleaved1f1b" else 1)
    stages = split_into_stages(model.blocks, n_stages, first=Embed(model), last=LMHead(model))
    schedule = pipeline(stages, mesh.group("pp"), schedule=args.pp_schedule,
                        n_microbatches=args.pp_microbatches, loss_fn=lm_loss)
    mine = nn.ModuleList(stage.submodule for stage in schedule.stages)
    if mesh.size("dp") > 1:  # gradients synchronised once per step, on the last microbatch
        for module in mine:
            ddp(module, mesh.group("dp"))
    return mine, schedule, mesh.rank("dp"), mesh.size("dp")


def pp_step(schedule, x, y):
    """Forward and backward of every microbatch; the mean loss on the last stage, else 0."""
    losses = []
    schedule.step(x, target=y, losses=losses, return_outputs=False)
    return torch.stack(losses).mean() if losses else torch.zeros((), device=x.device)


def main(argv=None):
    args = parse_args(argv)
    distributed = "RANK" in os.environ
    rank, local_rank = int(os.environ.get("RANK", 0)), int(os.environ.get("LOCAL_RANK", 0))
    world_size = int(os.environ.get("WORLD_SIZE", 1))
    if torch.cuda.is_available():
        device = torch.device("cuda", local_rank)
        torch.cuda.set_device(device)
    else:
        device = torch.device("cpu")
        if world_size > 1 and "OMP_NUM_THREADS" not in os.environ:
            torch.set_num_threads(1)
    if distributed:
        dist.init_process_group("nccl" if device.type == "cuda" else "gloo",
                                timeout=timedelta(seconds=120))
    master = rank == 0

    torch.manual_seed(args.seed)  # same initial weights on every rank (DDP broadcasts anyway)
    data, vocab_size = load_text()
    model = CharLM(vocab_size, args.block_size).to(device)
    dp_rank, dp_size = rank, world_size
    if args.tp > 1:  # shard before the optimizer sees the parameters
        if args.checkpoint_dir:
            raise SystemExit("--checkpoint-dir is not supported with --tp yet (sharded state)")
        model, dp_rank, dp_size = apply_tp(model, args.tp, args.sequence_parallel)
    schedule = None
    if args.pp > 1:  # keep this rank's stages before the optimizer sees the parameters
        if args.checkpoint_dir:
            raise SystemExit("--checkpoint-dir is not supported with --pp yet (stages hold "
                             "parts of the model)")
        model, schedule, dp_rank, dp_size = apply_pp(model, args)
    if args.dp_mode == "fsdp" and args.checkpoint_dir and distributed:
        raise SystemExit("--checkpoint-dir is not supported with --dp-mode fsdp yet (rank 0 "
                         "holds only its shards; see meshrun.parallel.full_state_dict)")
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.1)
    start = load_checkpoint(args.checkpoint_dir, model, optimizer, device)
    if master and start:
        print(f"resumed from step {start}", flush=True)
    if distributed and args.tp == 1 and args.pp == 1:
        model, raw_model = STRATEGIES[args.dp_mode](model, device)
    else:
        raw_model = model
    if master:
        n_params = sum(p.numel() for p in raw_model.parameters())
        mode = f"tp {args.tp}{' + sp' if args.sequence_parallel else ''} | dp {dp_size}" \
            if args.tp > 1 else f"dp-mode {args.dp_mode}"
        if args.pp > 1:
            mode = f"pp {args.pp} ({args.pp_schedule}, {args.pp_microbatches} microbatches) " \
                f"| dp {dp_size}"
        print(f"{n_params / 1e6:.2f}M params (per rank) | world {world_size} | {mode}",
              flush=True)

    warmup = max(1, args.steps // 20)
    restart_count = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", 0))
    t0 = time.perf_counter()
    for step in range(start, args.steps):
        if step == args.fail_at_step and master and restart_count == 0:
            raise RuntimeError(f"--fail-at-step {step}: failing on purpose (restart count 0)")
        lr = args.lr * min(1.0, (step + 1) / warmup)  # linear warm-up, then cosine to lr/10
        lr *= 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(1.0, step / args.steps)))
        for group in optimizer.param_groups:
            group["lr"] = lr
        x, y = get_batch(data, step, args.seed, args.batch_size, args.block_size, dp_rank,
                         dp_size)
        if schedule is not None:  # --pp: the schedule runs forward and backward per microbatch
            optimizer.zero_grad(set_to_none=True)
            loss = pp_step(schedule, x.to(device), y.to(device))
        else:
            loss = model(x.to(device), y.to(device))
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
        optimizer.step()

        done = step + 1
        if done % args.log_every == 0 or done in (1, args.steps):
            loss = loss.detach()
            if distributed:
                dist.all_reduce(loss)
                loss /= world_size if schedule is None else dp_size  # --pp: last stage only
            ms = (time.perf_counter() - t0) * 1000 / (done - start)
            if master:
                print(f"step {done} | loss {loss.item():.4f} | lr {lr:.2e} | {ms:.0f} ms/step",
                      flush=True)
        if args.checkpoint_dir and master and (done % args.checkpoint_every == 0
                                               or done == args.steps):
            save_checkpoint(args.checkpoint_dir, raw_model, optimizer, done)
    if distributed:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
    # Training is over and the group destroyed. torch 2.13 + gloo sometimes aborts in its C++
    # teardown after such a clean finish ("terminate called without an active exception",
    # SIGABRT; under torchrun too), which would turn a finished job into a failed one: leave
    # without running that teardown.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
