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
  ``fsdp`` (``meshrun.parallel.fully_shard`` on each block, then the rest: ZeRO-3) or ``torch-ddp`` (torch's ``DistributedDataParallel``, the
  reference; pure data parallelism only). ``--parallel ddp|fsdp|torch-ddp`` = ``--dp-mode``.

Data and batch (the rule that keeps training the same across a resize): the text is cut into
non-overlapping windows of ``--block-size`` + 1 characters; each epoch visits all of them once,
in an order drawn from (seed, epoch). Step s trains on the next ``--global-batch-size`` G
windows of that stream (data position s G), whatever the world size. The G windows are split
into D nearly equal contiguous parts, one per data-parallel rank, and each part into
``ceil(ceil(G / D) / --batch-size)`` microbatches (gradient accumulation, the same count on
every rank); each microbatch's mean loss is weighted by its share of G, so the gradient is
that of the mean loss over the G windows at any D. G defaults to ``--batch-size`` x D at the
first start and is then kept in the checkpoint: after a resize the same windows are trained
on in the same steps, none twice and none skipped. (With ``--pp`` the pipeline's microbatches
are the accumulation: D must divide G, and ``--pp-microbatches`` G / D.) ``--grad-clip`` clips
the gradient by the norm of the whole model's gradient, taken over every axis of the mesh.

Checkpoints (``--checkpoint-dir``): every ``--checkpoint-every`` steps, at the end, and when
the job is stopped by SIGTERM (the agent's grace period; every rank saves, then exits 143), all
ranks write ``step_<N>`` with ``meshrun.parallel.checkpoint``: each rank its own shards, in
parallel, atomically (a kill mid-save leaves the previous checkpoint loadable); the newest
two are kept. Saved: model, optimizer, step, data position, global batch and RNG state, keyed
by parameter name, so a start with any world size and any --pp/--tp/--dp layout loads the
newest one (the directory must be visible to every rank). ``--fail-at-step S`` makes rank 0
raise at step S on the first attempt (TORCHELASTIC_RESTART_COUNT=0), to show restart + resume.
"""

import argparse
import contextlib
import functools
import math
import os
import shutil
import signal
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
    p.add_argument("--batch-size", type=int, default=DEFAULTS["batch_size"],
                   help="windows per rank per forward (the microbatch)")
    p.add_argument("--global-batch-size", type=int, default=None, help="windows per step over "
                   "all data-parallel ranks (default: --batch-size x dp; a checkpoint's wins)")
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
    p.add_argument("--optimizer", choices=("adamw", "sgd"), default="adamw", help="sgd: "
                   "momentum 0.9, no weight decay (its steps scale with the gradient, so the "
                   "logged loss shows a wrong gradient scale that AdamW would hide)")
    p.add_argument("--fail-at-step", type=int, default=None, help="testing: rank 0 raises here")
    args = p.parse_args(argv)
    if args.parallel == "tp":
        args.tp = int(os.environ.get("WORLD_SIZE", 1))
    elif args.parallel == "pp":
        args.pp = int(os.environ.get("WORLD_SIZE", 1))
    elif args.parallel is not None:
        args.dp_mode = args.parallel
    # bad flags: one line from rank 0 (every rank would print the same), exit 2 on every rank
    problem = layout_problem(args, int(os.environ.get("WORLD_SIZE", 1)))
    if problem:
        if int(os.environ.get("RANK", 0)) == 0:
            print(f"{p.prog}: error: {problem}", file=sys.stderr)
        sys.exit(2)
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
# data: an epoch is every window once, in a seeded order; step s trains on windows
# [s G, (s + 1) G) of that stream, split by data-parallel rank, then into microbatches


def load_text(path=DATA):
    with open(path) as f:
        text = f.read()
    chars = sorted(set(text))
    stoi = {c: i for i, c in enumerate(chars)}
    return torch.tensor([stoi[c] for c in text], dtype=torch.long), len(chars)


@functools.lru_cache(maxsize=2)
def epoch_order(n_windows, seed, epoch):
    return torch.randperm(n_windows, generator=torch.Generator().manual_seed(seed * 1_000_003
                                                                            + epoch))


def window_ids(position, count, n_windows, seed):
    """Windows ``position .. position + count - 1`` of the endless stream of epochs."""
    ids = []
    while count > 0:
        epoch, offset = divmod(position, n_windows)
        take = min(count, n_windows - offset)
        ids.append(epoch_order(n_windows, seed, epoch)[offset:offset + take])
        position, count = position + take, count - take
    return torch.cat(ids)


def accumulation_steps(global_batch, dp_size, batch_size):
    """Microbatches per rank per step: enough that none exceeds ``batch_size`` windows."""
    if global_batch < dp_size:
        raise SystemExit(f"--global-batch-size {global_batch} is smaller than the data-"
                         f"parallel size {dp_size}: every rank needs at least one window")
    return max(1, ceil_div(ceil_div(global_batch, dp_size), batch_size))


def ceil_div(a, b):
    return -(-a // b)


def microbatches(ids, dp_rank, dp_size, n_micro):
    """This rank's part of a step's window ids, as ``n_micro`` nearly equal microbatches."""
    part = torch.tensor_split(ids, dp_size)[dp_rank]
    return torch.tensor_split(part, n_micro)


def windows(data, ids, block_size):
    """Inputs and targets ``[len(ids), block_size]`` of the given windows."""
    starts = ids * block_size
    x = torch.stack([data[s:s + block_size] for s in starts.tolist()])
    y = torch.stack([data[s + 1:s + 1 + block_size] for s in starts.tolist()])
    return x, y


# -------------------------------------------------------------------------------------------
# checkpoints: meshrun.parallel.checkpoint, every rank its own shards, atomic, resharding


def checkpoint_state(par, optimizer, step, position, global_batch):
    """What a checkpoint holds, keyed by the CharLM's parameter names (this rank's part)."""
    from meshrun.parallel import checkpoint

    mine = list(par.modules.parameters())
    return {"model": checkpoint.model_state(par.lm, params=mine),
            "optim": checkpoint.optimizer_state(optimizer, par.lm, params=mine),
            "step": step, "data": {"position": position, "global_batch": global_batch},
            "rng": torch.get_rng_state()}


def save_checkpoint(ckpt_dir, state, step, keep=2, background=False):
    """Write ``<ckpt_dir>/step_<step>`` (a collective), then drop all but the newest ``keep``.

    ``background``: copy the state to host memory and write it while training goes on (the
    periodic saves); the next save joins it. The last save and the one on a signal are not:
    the process is about to exit."""
    from meshrun.parallel import checkpoint

    state["rng"] = torch.get_rng_state()
    path = os.path.join(ckpt_dir, f"step_{step}")
    t0 = time.perf_counter()
    checkpoint.save(state, path, async_=background)
    if not dist.is_initialized() or dist.get_rank() == 0:
        if background:
            print(f"saving {path} in the background (training paused "
                  f"{time.perf_counter() - t0:.2f} s)", flush=True)
        else:
            size = sum(f.stat().st_size for f in os.scandir(path))
            print(f"saved {path} ({size / 2**20:.1f} MiB, {time.perf_counter() - t0:.2f} s)",
                  flush=True)
        steps = sorted(int(n[5:]) for n in os.listdir(ckpt_dir)
                       if n.startswith("step_") and n[5:].isdigit())
        for old in steps[:-keep]:
            shutil.rmtree(os.path.join(ckpt_dir, f"step_{old}"), ignore_errors=True)


def load_checkpoint(ckpt_dir, state):
    """Load the newest checkpoint under ``ckpt_dir`` into ``state``; its path, or None."""
    from meshrun.parallel import checkpoint

    path = checkpoint.latest(ckpt_dir)
    if path is not None:
        checkpoint.load(state, path)
        torch.set_rng_state(state["rng"])
    return path


class StopRequest:
    """SIGTERM (the launcher stopping the job) or SIGINT (Ctrl-C) asks for a checkpoint at the
    end of the step.

    Every rank must take part in the save, so the ranks agree first (one all-reduce MAX of a
    flag per step: cheap next to a step) and save together even if the signal reached only
    some of them. The flag lives on ``device`` (the model's: NCCL reduces only CUDA tensors)."""

    def __init__(self, device):
        self.signum = 0
        self.device = device
        signal.signal(signal.SIGTERM, self._handle)
        signal.signal(signal.SIGINT, self._handle)

    def _handle(self, signum, frame):
        self.signum = signum

    def agreed(self):
        flag = torch.tensor([self.signum], device=self.device)
        if dist.is_initialized():
            dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        return int(flag.item())


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
    problem = layout_problem(args, world_size)
    if problem:
        raise SystemExit(problem)
    pp, tp = args.pp, args.tp
    dp = args.dp if args.dp is not None else world_size // (pp * tp)
    if not distributed or (args.dp_mode == "torch-ddp" and pp == tp == 1):
        dp_rank = dist.get_rank() if distributed else 0
        wrapped = apply_torch_ddp(model) if distributed and dp > 1 else model
        return Parallel(lm=model, model=wrapped, modules=model, schedule=None, mesh=None,
                        dp_rank=dp_rank, dp_size=dp)
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
                    schedule=schedule, mesh=mesh, dp_rank=mesh.rank("dp"), dp_size=dp)


def layout_problem(args, world_size):
    """What is wrong with ``--pp/--tp/--dp/--dp-mode`` for this world size, or None."""
    pp, tp = args.pp, args.tp
    if args.dp is None and world_size % (pp * tp):
        return (f"--pp {pp} x --tp {tp} = {pp * tp} must divide the world size {world_size} "
                f"(data parallelism takes the rest)")
    dp = args.dp if args.dp is not None else world_size // (pp * tp)
    if pp * dp * tp != world_size:
        return (f"--pp {pp} x --dp {dp} x --tp {tp} = {pp * dp * tp} ranks, but the world "
                f"size is {world_size}: make the product equal the world size")
    if args.sequence_parallel and tp == 1:
        return "--sequence-parallel needs --tp > 1"
    if args.dp_mode == "torch-ddp" and world_size > 1 and (pp > 1 or tp > 1):
        return ("--dp-mode torch-ddp (torch's DistributedDataParallel, the reference) is for "
                "pure data parallelism; with --pp or --tp use --dp-mode ddp or fsdp")
    stages = pp * (2 if args.pp_schedule == "interleaved1f1b" else 1)
    if pp > 1 and stages > N_LAYER:
        how = f"{pp} pipeline ranks x 2 stages (interleaved)" if stages > pp else \
            f"{pp} pipeline ranks"
        return (f"--pp {pp}: {how} = {stages} stages, but the model has {N_LAYER} blocks; "
                f"use at most {N_LAYER} stages")
    if N_HEAD % tp:
        return f"--tp {tp} must divide the model's {N_HEAD} attention heads"
    return None


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


def forward_backward(par, batches, global_batch, device):
    """Forward and backward of this rank's microbatches of one step.

    Returns this rank's share of the step's loss: the sum over its microbatches of mean loss x
    windows / G, so that the shares of the data-parallel ranks add up to the mean loss over
    the G windows (--pp: on the last stage; 0 elsewhere). Gradients are weighted the same way
    (x D, since data parallelism averages over D ranks) and synchronised on the last
    microbatch only."""
    if par.schedule is not None:  # --pp: the schedule's microbatches are the accumulation
        (x, y), = batches
        losses = []
        par.schedule.step(x.to(device), target=y.to(device), losses=losses,
                          return_outputs=False)
        share = len(x) / global_batch
        return torch.stack(losses).mean() * share if losses else torch.zeros((), device=device)
    total = torch.zeros((), device=device)
    for i, (x, y) in enumerate(batches):
        weight = len(x) / global_batch
        with sync_gradients(par.model, i == len(batches) - 1):
            loss = par.model(x.to(device), y.to(device))
            (loss * weight * par.dp_size).backward()
        total += loss.detach() * weight
    return total


def sync_gradients(model, enabled):
    """Gradient accumulation: synchronise gradients only on the last microbatch."""
    if enabled and not hasattr(model, "set_requires_gradient_sync"):
        return contextlib.nullcontext()  # one microbatch: nothing to switch (and no import)
    from meshrun.parallel import gradient_sync  # meshrun ddp / fsdp, and torch's DDP

    return gradient_sync(model, enabled)


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
    par = parallelize_lm(model, args)  # before the optimizer sees the parameters
    optimizer = make_optimizer(args, par.modules.parameters())
    global_batch = args.global_batch_size or args.batch_size * par.dp_size
    start, position, state = 0, 0, None
    if args.checkpoint_dir:
        state = checkpoint_state(par, optimizer, 0, 0, global_batch)
        path = load_checkpoint(args.checkpoint_dir, state)
        if path is not None:
            start, position = state["step"], state["data"]["position"]
            saved = state["data"]["global_batch"]
            if master:
                note = f" (not --global-batch-size {global_batch})" \
                    if args.global_batch_size and saved != global_batch else ""
                print(f"resumed from step {start} ({path}); global batch {saved}{note}",
                      flush=True)
            global_batch = saved
    n_micro = check_batch(args, global_batch, par.dp_size)
    if master:
        n_params = sum(p.numel() for p in par.modules.parameters())
        mode = [f"pp {args.pp} ({args.pp_schedule}, {args.pp_microbatches} microbatches)"] \
            if args.pp > 1 else []
        if args.tp > 1:
            mode.append(f"tp {args.tp}{' + sp' if args.sequence_parallel else ''}")
        mode.append(f"dp {par.dp_size} (dp-mode {args.dp_mode})")
        print(f"{n_params / 1e6:.2f}M params (per rank) | world {world_size} | "
              f"{' | '.join(mode)} | {batch_summary(args, global_batch, par.dp_size, n_micro)}",
              flush=True)

    warmup = max(1, args.steps // 20)
    restart_count = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", 0))
    stop = StopRequest(device) if args.checkpoint_dir else None
    n_windows = (len(data) - 1) // args.block_size
    t0 = time.perf_counter()
    for step in range(start, args.steps):
        if step == args.fail_at_step and master and restart_count == 0:
            raise RuntimeError(f"--fail-at-step {step}: failing on purpose (restart count 0)")
        lr = args.lr * min(1.0, (step + 1) / warmup)  # linear warm-up, then cosine to lr/10
        lr *= 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(1.0, step / args.steps)))
        for group in optimizer.param_groups:
            group["lr"] = lr
        ids = window_ids(position, global_batch, n_windows, args.seed)
        batches = [windows(data, part, args.block_size)
                   for part in microbatches(ids, par.dp_rank, par.dp_size, n_micro)]
        optimizer.zero_grad(set_to_none=True)
        loss = forward_backward(par, batches, global_batch, device)
        done = step + 1
        log = done % args.log_every == 0 or done in (1, args.steps)
        grad_norm = None  # the global norm before clipping; without clipping, on log steps
        if args.grad_clip > 0 or log:
            grad_norm = clip_gradients(par, args.grad_clip if args.grad_clip > 0 else math.inf)
        optimizer.step()
        position += global_batch

        if log:
            if distributed:  # the shares of the dp ranks add up; --tp: each TP rank has it
                dist.all_reduce(loss)
                loss /= args.tp
            ms = (time.perf_counter() - t0) * 1000 / (done - start)
            if master:
                print(f"step {done} | loss {loss.item():.4f} | grad norm {grad_norm:.4f} | "
                      f"lr {lr:.2e} | {ms:.0f} ms/step", flush=True)
        if stop is None:
            continue
        signum = stop.agreed()
        if signum or done % args.checkpoint_every == 0 or done == args.steps:
            state.update(step=done, data={"position": position, "global_batch": global_batch})
            save_checkpoint(args.checkpoint_dir, state, done,
                            background=not signum and done != args.steps)
        if signum:
            if master:
                print(f"stopped by signal {signum}: saved step {done}", flush=True)
            return 128 + signum
    if distributed:
        dist.destroy_process_group()
    return 0


def make_optimizer(args, params):
    if args.optimizer == "sgd":
        return torch.optim.SGD(params, lr=args.lr, momentum=0.9)
    return torch.optim.AdamW(params, lr=args.lr, weight_decay=0.1)


def batch_summary(args, global_batch, dp_size, n_micro):
    """``global batch 32: 2 data-parallel ranks x 2 microbatches of <= 8 windows``."""
    if args.pp > 1:
        n_micro = args.pp_microbatches
        kind = "pipeline microbatches"
    else:
        kind = "microbatch" + ("es" if n_micro > 1 else "") + " (accumulated)" * (n_micro > 1)
    ranks = f"{dp_size} data-parallel rank{'s' if dp_size > 1 else ''}"
    return (f"global batch {global_batch}: {ranks} x {n_micro} {kind} of <= "
            f"{ceil_div(global_batch, dp_size * n_micro)} windows")


def check_batch(args, global_batch, dp_size):
    """Microbatches per rank (see the module docstring); one clear line if G does not fit."""
    if args.pp > 1:
        if global_batch % dp_size or (global_batch // dp_size) % args.pp_microbatches:
            raise SystemExit(f"--pp: the global batch {global_batch} must split into "
                             f"{dp_size} data-parallel parts of a multiple of "
                             f"--pp-microbatches {args.pp_microbatches} windows")
        return 1
    return accumulation_steps(global_batch, dp_size, args.batch_size)


if __name__ == "__main__":
    code = main()
    # Training is over and the group destroyed. torch 2.13 + gloo sometimes aborts in its C++
    # teardown after such a clean finish ("terminate called without an active exception",
    # SIGABRT; under torchrun too), which would turn a finished job into a failed one: leave
    # without running that teardown.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
