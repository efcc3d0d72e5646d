"""Train a small character-level transformer on Tiny Shakespeare (nanoGPT-style).

A plain torchrun script: it reads RANK / LOCAL_RANK / WORLD_SIZE from the environment, so it
runs unchanged under ``torchrun``, under ``meshrun``, or as plain ``python`` (one process):

    meshrun --nproc-per-node 2 examples/train_char_lm.py --steps 300 --checkpoint-dir ckpt
    torchrun --nproc-per-node 2 examples/train_char_lm.py --dp-mode torch-ddp

Parallelism: ``--pp P --tp T --dp D`` lay the world out as one mesh
``Mesh({"pp": P, "dp": D, "tp": T})`` (TP innermost; D defaults to world size / (P T), and
P D T must equal the world size), and `parallelize_lm` applies, in this order:

- tensor parallelism (``--tp``, or ``--parallel tp``): attention heads, MLP and the vocabulary
  sharded over T ranks with ``meshrun.parallel.parallelize`` and `tp_plan` (Megatron-style,
  vocab-parallel loss); ``--sequence-parallel`` also shards norms and residuals along the
  sequence. Ranks of one TP group see the same batch.
- pipeline parallelism (``--pp``, or ``--parallel pp``): the blocks split into P stages with
  ``meshrun.parallel.split_into_stages``, trained with ``--pp-schedule`` (1F1B by default)
  over ``--pp-microbatches`` microbatches; the loss equals the unsplit model's.
- data parallelism over D ranks, ``--dp-mode``: ``ddp`` (default, ``meshrun.parallel.ddp``),
  ``fsdp`` (``meshrun.parallel.fully_shard`` on each block, then the rest: ZeRO-3; no
  ``--checkpoint-dir`` yet) or ``torch-ddp`` (torch's ``DistributedDataParallel``, the
  reference; pure data parallelism only). ``--parallel ddp|fsdp|torch-ddp`` = ``--dp-mode``.

Each step draws one global batch of random windows from a generator seeded with (seed, step);
data-parallel rank r trains on its slice of it, so the data depend only on the step number (a
resumed run sees exactly the batches it would have). ``--grad-clip`` clips the gradient by the
norm of the whole model's gradient, taken over every axis of the mesh.

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
from dataclasses import dataclass
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
    p.add_argument("--dp", type=int, default=None, help="data-parallel degree (default: "
                   "world size / (pp x tp))")
    p.add_argument("--tp", type=int, default=1, help="tensor-parallel degree (Megatron-style)")
    p.add_argument("--sequence-parallel", action="store_true", help="with --tp: shard norms "
                   "and residuals along the sequence")
    p.add_argument("--pp", type=int, default=1, help="pipeline-parallel degree (stages)")
    p.add_argument("--pp-schedule", choices=("gpipe", "1f1b", "interleaved1f1b"),
                   default="1f1b", help="with --pp: interleaved1f1b puts 2 stages on a rank")
    p.add_argument("--pp-microbatches", type=int, default=4, help="with --pp: per step")
    p.add_argument("--grad-clip", type=float, default=1.0, help="clip the gradient to this "
                   "global norm, over every axis of the mesh (0: no clipping)")
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
# parallelism: one mesh {"pp", "dp", "tp"} (TP innermost); `parallelize_lm` applies each
# strategy in a fixed order with a short apply_* function: TP, then the PP split, then DP


@dataclass
class Parallel:
    """What the training loop needs from `parallelize_lm`."""

    lm: nn.Module  # the full CharLM: parameter names (under TP: local shards), checkpoints
    model: nn.Module  # what to call for forward and backward without a pipeline
    modules: nn.Module  # this rank's part of the model: give its parameters to the optimizer
    schedule: object | None  # the pipeline schedule (--pp > 1), else None
    mesh: object | None  # meshrun.parallel.Mesh; None in one process or with torch-ddp
    dp_rank: int
    dp_size: int
    loss_ranks: int  # ranks that hold the loss: all, or those of the last pipeline stage


def parallelize_lm(model, args):
    """Apply ``--pp``, ``--tp`` and ``--dp`` (``--dp-mode``) to ``model`` over one mesh.

    The mesh is ``Mesh({"pp": P, "dp": D, "tp": T})`` (D defaults to world size / (P T)).
    Order: TP on the whole CharLM first, so its parameter names and the plan's keys stay those
    of CharLM and the Embed / LMHead wrappers of the split share the already sharded modules;
    then the pipeline split, keeping this rank's stages; then data parallelism on each of them
    over the "dp" axis (fsdp: each block, then the stage; ddp: the stage). The char LM's
    embedding and head are separate parameters (untied), so no gradient has to be summed
    across the first and last stages. Under plain python (one process) nothing is applied;
    ``--dp-mode torch-ddp`` (the reference, needs no meshrun) is for pure data parallelism.
    """
    distributed = dist.is_initialized()
    world_size = dist.get_world_size() if distributed else 1
    pp, tp = args.pp, args.tp
    if args.dp is None and world_size % (pp * tp):
        raise SystemExit(f"--pp {pp} x --tp {tp} = {pp * tp} must divide the world size "
                         f"{world_size} (data parallelism takes the rest)")
    dp = args.dp if args.dp is not None else world_size // (pp * tp)
    if pp * dp * tp != world_size:
        raise SystemExit(f"--pp {pp} x --dp {dp} x --tp {tp} = {pp * dp * tp} ranks, but the "
                         f"world size is {world_size}: make the product equal the world size")
    if args.sequence_parallel and tp == 1:
        raise SystemExit("--sequence-parallel needs --tp > 1")
    if not distributed or (args.dp_mode == "torch-ddp" and pp == tp == 1):
        dp_rank = dist.get_rank() if distributed else 0
        wrapped = apply_torch_ddp(model) if distributed and dp > 1 else model
        return Parallel(lm=model, model=wrapped, modules=model, schedule=None, mesh=None,
                        dp_rank=dp_rank, dp_size=dp, loss_ranks=world_size)
    if args.dp_mode == "torch-ddp":
        raise SystemExit("--dp-mode torch-ddp (torch's DistributedDataParallel, the reference) "
                         "is for pure data parallelism; with --pp or --tp use --dp-mode ddp "
                         "or fsdp")
    try:  # imported only here: one process and torch-ddp need no meshrun
        from meshrun.parallel import Mesh
    except ImportError as e:
        raise SystemExit(f"--dp-mode {args.dp_mode}, --tp and --pp need meshrun importable "
                         f"({e}): `pip install -e .` or set PYTHONPATH to the repository "
                         f"root") from None
    mesh = Mesh({"pp": pp, "dp": dp, "tp": tp})
    if tp > 1:  # before the split: the plan names CharLM's modules
        apply_tp(model, mesh.group("tp"), args.sequence_parallel)
    schedule, stages = None, [model]
    if pp > 1:
        schedule = apply_pp(model, mesh.group("pp"), args)
        stages = [stage.submodule for stage in schedule.stages]
    if dp > 1:  # per stage: the pipeline switches gradient sync per stage module
        for module in stages:
            (apply_fsdp if args.dp_mode == "fsdp" else apply_ddp)(module, mesh.group("dp"))
    return Parallel(lm=model, model=model, modules=nn.ModuleList(stages) if pp > 1 else model,
                    schedule=schedule, mesh=mesh, dp_rank=mesh.rank("dp"), dp_size=dp,
                    loss_ranks=world_size // pp)  # --pp: only the last stage has the loss


def apply_torch_ddp(model):
    from torch.nn.parallel import DistributedDataParallel

    device = next(model.parameters()).device
    return DistributedDataParallel(model, device_ids=[device.index] if device.type == "cuda"
                                   else None)


def apply_ddp(module, group):
    from meshrun.parallel import ddp

    ddp(module, group)


def apply_fsdp(module, group):
    """One unit per block, then the module (the stage or CharLM: embeddings, norm, head)."""
    from meshrun.parallel import fully_shard

    for block in module.blocks.children():  # CharLM: nn.Sequential; a stage: nn.ModuleDict
        fully_shard(block, group)
    fully_shard(module, group)  # the optimizer steps on the shards the parameters now hold


# -------------------------------------------------------------------------------------------
# tensor parallelism (--tp N): Megatron-style, vocab-parallel embedding and loss


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
    if sequence_parallel:  # split the sequence after the embeddings (at the first block, so
        # under --pp too: later stages receive sequence shards); norms on token shards
        plan["blocks.0"] = PrepareModuleInput(input_layouts=Replicate(),
                                              desired_input_layouts=Shard(1))
        for name in ("blocks.*.ln1", "blocks.*.ln2", "ln_f"):
            plan[name] = SequenceParallel()
    return plan


def apply_tp(model, group, sequence_parallel):
    from functools import partial

    from meshrun.parallel import parallelize, vocab_parallel_cross_entropy

    parallelize(model, group, tp_plan(sequence_parallel))
    model.loss_fn = partial(vocab_parallel_cross_entropy, group=group)


# -------------------------------------------------------------------------------------------
# pipeline parallelism (--pp N): the blocks split into N stages (2N with interleaved 1F1B),
# embeddings on the first, norm and head on the last


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


def lm_loss(logits, targets, loss_fn=F.cross_entropy):
    return loss_fn(logits.view(-1, logits.shape[-1]), targets.view(-1))


def apply_pp(model, group, args):
    """Split the model into stages; return the schedule of this rank's stages."""
    from functools import partial

    from meshrun.parallel.pipelining import pipeline, split_into_stages

    n_stages = args.pp * (2 if args.pp_schedule == "interleaved1f1b" else 1)
    stages = split_into_stages(model.blocks, n_stages, first=Embed(model), last=LMHead(model))
    return pipeline(stages, group, schedule=args.pp_schedule,
                    n_microbatches=args.pp_microbatches,
                    loss_fn=partial(lm_loss, loss_fn=model.loss_fn))  # --tp: vocab-parallel


def forward_backward(par, x, y):
    """Forward and backward of one batch; its mean loss (--pp: on the last stage, else 0)."""
    if par.schedule is None:
        loss = par.model(x, y)
        loss.backward()
        return loss
    losses = []  # --pp: the schedule runs forward and backward per microbatch
    par.schedule.step(x, target=y, losses=losses, return_outputs=False)
    return torch.stack(losses).mean() if losses else torch.zeros((), device=x.device)


def clip_gradients(par, max_norm):
    """Clip by the norm of the whole model's gradient, over every axis of the mesh."""
    params = list(par.modules.parameters())
    if par.mesh is None:  # one process, or torch-ddp: every rank holds the whole gradient
        return torch.nn.utils.clip_grad_norm_(params, max_norm)
    from meshrun.parallel import clip_grad_norm_

    return clip_grad_norm_(params, max_norm, mesh=par.mesh)


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
    if args.tp > 1 and args.checkpoint_dir:
        raise SystemExit("--checkpoint-dir is not supported with --tp yet (sharded state)")
    if args.pp > 1 and args.checkpoint_dir:
        raise SystemExit("--checkpoint-dir is not supported with --pp yet (stages hold "
                         "parts of the model)")
    if args.dp_mode == "fsdp" and args.checkpoint_dir and distributed:
        raise SystemExit("--checkpoint-dir is not supported with --dp-mode fsdp yet (rank 0 "
                         "holds only its shards; see meshrun.parallel.full_state_dict)")
    par = parallelize_lm(model, args)  # before the optimizer sees the parameters
    optimizer = torch.optim.AdamW(par.modules.parameters(), lr=args.lr, weight_decay=0.1)
    start = load_checkpoint(args.checkpoint_dir, par.lm, optimizer, device)
    if master and start:
        print(f"resumed from step {start}", flush=True)
    if master:
        n_params = sum(p.numel() for p in par.modules.parameters())
        mode = [f"pp {args.pp} ({args.pp_schedule}, {args.pp_microbatches} microbatches)"] \
            if args.pp > 1 else []
        if args.tp > 1:
            mode.append(f"tp {args.tp}{' + sp' if args.sequence_parallel else ''}")
        mode.append(f"dp {par.dp_size} (dp-mode {args.dp_mode})")
        print(f"{n_params / 1e6:.2f}M params (per rank) | world {world_size} | "
              f"{' | '.join(mode)}", flush=True)

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
        x, y = get_batch(data, step, args.seed, args.batch_size, args.block_size, par.dp_rank,
                         par.dp_size)
        optimizer.zero_grad(set_to_none=True)
        loss = forward_backward(par, x.to(device), y.to(device))
        if args.grad_clip > 0:
            clip_gradients(par, args.grad_clip)
        optimizer.step()

        done = step + 1
        if done % args.log_every == 0 or done in (1, args.steps):
            loss = loss.detach()
            if distributed:
                dist.all_reduce(loss)  # --tp: equal on the TP ranks; --pp: 0 off the last stage
                loss /= par.loss_ranks
            ms = (time.perf_counter() - t0) * 1000 / (done - start)
            if master:
                print(f"step {done} | loss {loss.item():.4f} | lr {lr:.2e} | {ms:.0f} ms/step",
                      flush=True)
        if args.checkpoint_dir and master and (done % args.checkpoint_every == 0
                                               or done == args.steps):
            save_checkpoint(args.checkpoint_dir, par.lm, optimizer, done)
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
