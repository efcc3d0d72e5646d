"""Parallelism for the char LM: one mesh {"pp", "dp", "cp", "tp"} (TP innermost);
`parallelize_lm` applies each strategy in a fixed order with a short apply_* function (TP,
context parallel attention, then the pipeline split, then data parallelism), and says on rank
0 what it applied; `forward_backward` and `clip_gradients` are one step's parallel parts."""

import contextlib
from dataclasses import dataclass, field
from functools import partial

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

from char_lm.model import N_HEAD, N_LAYER

CP_LAYOUT = "zigzag"  # --cp: each rank holds sequence chunks r and 2cp-1-r (load-balanced)


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
    cp_rank: int = 0
    cp_size: int = 1
    hook_states: list = field(default_factory=list)  # stateful comm hooks' (checkpointed)

    def shard(self, x, y):
        """A microbatch's model inputs: ``(x, y, positions)``; under --cp this rank's part of
        each sequence (the layout's chunks) and their positions, else all (positions None)."""
        if self.cp_size == 1:
            return x, y, None
        from meshrun.parallel.cp import position_ids, shard_sequence

        t = x.shape[1]
        return (shard_sequence(x, self.cp_rank, self.cp_size, CP_LAYOUT),
                shard_sequence(y, self.cp_rank, self.cp_size, CP_LAYOUT),
                position_ids(t, self.cp_rank, self.cp_size, CP_LAYOUT, device=x.device))


def parallelize_lm(model, args):
    """Apply ``--pp``, ``--tp``, ``--cp`` and ``--dp`` (``--dp-mode``) to ``model`` over one mesh.

    The mesh is ``Mesh({"pp": P, "dp": D, "cp": C, "tp": T})`` (D defaults to world size /
    (P C T)). Order: activation checkpointing of each block (``--activation-checkpointing``),
    TP on the whole CharLM, so its parameter names and the plan's keys stay those
    of CharLM and the Embed / LMHead wrappers of the split share the already sharded modules;
    context parallelism (each block's attention becomes ``--cp-mode`` attention over the "cp"
    axis; `Parallel.shard` cuts each sequence); then the pipeline split, keeping this rank's
    stages; then data parallelism on each of them over the "dp" axis, or the flattened dp x cp
    group under --cp (cp ranks share the parameters; fsdp: each block, then the stage; ddp:
    the stage). The char LM's
    embedding and head are separate parameters (untied), so no gradient has to be summed
    across the first and last stages. Under plain python (one process) only activation
    checkpointing is applied;
    ``--dp-mode torch-ddp`` (torch's DistributedDataParallel, the reference) is for pure data
    parallelism. Rank 0 prints one line of what was applied (``parallelize: ...``).
    """
    distributed = dist.is_initialized()
    world_size = dist.get_world_size() if distributed else 1
    problem = layout_problem(args, world_size, n_layer=len(model.blocks),
                             n_head=model.blocks[0].n_head)
    if problem:
        raise SystemExit(problem)
    pp, tp, cp = args.pp, args.tp, args.cp
    dp = args.dp if args.dp is not None else world_size // (pp * cp * tp)
    applied = []
    if args.activation_checkpointing != "none":  # each block; its FSDP unit wraps it later
        from meshrun.parallel import checkpoint_activations

        for block in model.blocks:
            checkpoint_activations(block, args.activation_checkpointing)
        applied.append(f"activation checkpointing ({args.activation_checkpointing}, every "
                       f"block)")
    if not distributed or (args.dp_mode == "torch-ddp" and pp == tp == 1):
        dp_rank = dist.get_rank() if distributed else 0
        wrapped = apply_torch_ddp(model) if distributed and dp > 1 else model
        if dp > 1:
            applied.append(f"torch DistributedDataParallel over {dp} ranks")
        if args.compile:
            applied.append(apply_compile([model], args.compile_backend))
        if applied:
            _say("parallelize: " + "; ".join(applied))
        return Parallel(lm=model, model=wrapped, modules=model, schedule=None, mesh=None,
                        dp_rank=dp_rank, dp_size=dp)
    from meshrun.parallel import Mesh

    mesh = Mesh({"pp": pp, "dp": dp, "cp": cp, "tp": tp})
    if tp > 1:  # before the split: the plan names CharLM's modules
        apply_tp(model, mesh.group("tp"), args.sequence_parallel)
        applied.append(f"tp {tp} ({len(tp_plan(args.sequence_parallel))} plan entries"
                       f"{', sequence parallel' if args.sequence_parallel else ''})")
    if cp > 1:
        apply_cp(model, mesh.group("cp"), args.cp_mode)
        applied.append(f"cp {cp} ({args.cp_mode} attention, {CP_LAYOUT} layout)")
    schedule, stages = None, [model]
    if pp > 1:
        positions = partial(cp_positions, mesh.rank("cp"), cp) if cp > 1 else None
        schedule = apply_pp(model, mesh.group("pp"), args, positions)
        stages = [stage.submodule for stage in schedule.stages]
        applied.append(f"pp {pp} ({args.pp_schedule}, {len(stages)} stage(s) on this rank, "
                       f"{args.pp_microbatches} microbatches)")
    if dp * cp > 1:  # per stage: the pipeline switches gradient sync per stage module
        group = mesh.group(("dp", "cp")) if cp > 1 else mesh.group("dp")
        hook_states = []
        for module in stages:
            if args.dp_mode == "fsdp":
                apply_fsdp(module, group, offload=args.offload)
            else:
                apply_ddp(module, group)
                hook_states += apply_comm_hook(module, group, args)
        over = f"dp {dp} x cp {cp}" if cp > 1 else f"dp {dp}"
        applied.append(f"{args.dp_mode} over {over}" + (" (a unit per block, then the rest)"
                                                        if args.dp_mode == "fsdp" else "")
                       + (", CPU offload" if args.offload else ""))
        if args.comm_hook != "none":
            applied.append(f"comm hook {args.comm_hook}" + (
                f" (rank {args.powersgd_rank} from step {args.powersgd_start})"
                if args.comm_hook == "powersgd" else ""))
    if args.compile:
        applied.append(apply_compile(stages, args.compile_backend))
    _say(f"parallelize: mesh {dict(zip(mesh.axes, (pp, dp, cp, tp), strict=True))}: "
         + ("; ".join(applied) or "nothing to apply"))
    return Parallel(lm=model, model=model, modules=nn.ModuleList(stages) if pp > 1 else model,
                    schedule=schedule, mesh=mesh, dp_rank=mesh.rank("dp"), dp_size=dp,
                    cp_rank=mesh.rank("cp"), cp_size=cp,
                    hook_states=hook_states if dp * cp > 1 else [])


def layout_problem(args, world_size, n_layer=N_LAYER, n_head=N_HEAD):
    """What is wrong with ``--pp/--tp/--cp/--dp/--dp-mode`` for this world size and a model of
    ``n_layer`` blocks of ``n_head`` heads (default: the CharLM's defaults), or None."""
    pp, tp, cp = args.pp, args.tp, args.cp
    if cp < 1:
        return f"--cp {cp}: the context-parallel degree must be at least 1"
    with_cp = f" x --cp {cp}" if cp > 1 else ""
    if (pp > 1 and args.pp_schedule in ("zbh1", "zbv")
            and getattr(args, "activation_checkpointing", "none") == "selective"):
        return (f"--pp-schedule {args.pp_schedule} with --activation-checkpointing selective "
                f"is not supported: a zero-bubble stage runs two backwards through each block "
                f"(B, then W), and torch's selective checkpoint allows one; use "
                f"--activation-checkpointing full, or --pp-schedule 1f1b")
    if args.dp is None and world_size % (pp * cp * tp):
        return (f"--pp {pp}{with_cp} x --tp {tp} = {pp * cp * tp} must divide the world size "
                f"{world_size} (data parallelism takes the rest)")
    dp = args.dp if args.dp is not None else world_size // (pp * cp * tp)
    if pp * dp * cp * tp != world_size:
        return (f"--pp {pp} x --dp {dp}{with_cp} x --tp {tp} = {pp * dp * cp * tp} ranks, but "
                f"the world size is {world_size}: make the product equal the world size")
    if (pp > 1 and args.pp_schedule in ("zbh1", "zbv") and args.dp_mode == "fsdp"
            and dp * cp > 1 and getattr(args, "activation_checkpointing", "none") != "none"):
        return (f"--pp-schedule {args.pp_schedule} with --dp-mode fsdp and "
                f"--activation-checkpointing is not supported: the recompute in a block's W "
                f"finds its FSDP unit resharded (fully_shard installs the gathered parameters "
                f"for the backward that B runs, not for W's); use --dp-mode ddp, "
                f"--pp-schedule 1f1b, or no activation checkpointing")
    if cp > 1:
        problem = cp_problem(args, n_head)
        if problem:
            return problem
    if args.sequence_parallel and tp == 1:
        return "--sequence-parallel needs --tp > 1"
    if getattr(args, "offload", False) and args.dp_mode != "fsdp":
        return "--offload is fully_shard's CPU offload: use it with --dp-mode fsdp"
    if getattr(args, "comm_hook", "none") != "none" and args.dp_mode != "ddp":
        return (f"--comm-hook {args.comm_hook} is a hook of meshrun's ddp: use it with "
                f"--dp-mode ddp (not {args.dp_mode})")
    if args.dp_mode == "torch-ddp" and world_size > 1 and (pp > 1 or tp > 1):
        return ("--dp-mode torch-ddp (torch's DistributedDataParallel, the reference) is for "
                "pure data parallelism; with --pp or --tp use --dp-mode ddp or fsdp")
    stages = pp * stages_per_rank(args.pp_schedule)
    if pp == 1 and args.pp_schedule != "1f1b":
        return (f"--pp-schedule {args.pp_schedule} schedules a pipeline, but there is none "
                f"(--pp 1): add --pp N (N > 1 pipeline ranks), or drop --pp-schedule")
    if pp > 1 and stages > n_layer:
        how = f"{pp} pipeline ranks x 2 stages ({args.pp_schedule})" if stages > pp else \
            f"{pp} pipeline ranks"
        return (f"--pp {pp}: {how} = {stages} stages, but the model has {n_layer} blocks; "
                f"use at most {n_layer} stages")
    if n_head % tp:
        return f"--tp {tp} must divide the model's {n_head} attention heads"
    return None


def cp_problem(args, n_head):
    """What --cp cannot do with the other flags, or None."""
    cp = args.cp
    if args.block_size % (2 * cp):
        return (f"--cp {cp}: --block-size {args.block_size} must be a multiple of {2 * cp} "
                f"(the {CP_LAYOUT} layout cuts each sequence into 2 x cp equal chunks)")
    if args.dp_mode == "torch-ddp":
        return "--cp needs --dp-mode ddp or fsdp (torch-ddp is the pure data-parallel reference)"
    if getattr(args, "compile", False):
        return ("--cp with --compile is not supported yet: a block compiled whole (fullgraph) "
                "cannot trace the ring's or the all-to-all's communication; drop --compile")
    if args.cp_mode == "ulysses" and (n_head // args.tp) % cp:
        return (f"--cp-mode ulysses: --cp {cp} must divide the {n_head // args.tp} attention "
                f"heads per tensor-parallel rank; use --cp-mode ring")
    return None


def cp_positions(cp_rank, cp, local_len, device):
    """The positions of this cp rank's ``local_len`` tokens (the pipeline's first stage)."""
    from meshrun.parallel.cp import position_ids

    return position_ids(local_len * cp, cp_rank, cp, CP_LAYOUT, device=device)


def apply_cp(model, group, mode):
    """Each block's attention: ring or Ulysses attention over the cp group, causal."""
    from meshrun.parallel.cp import CP_MODES

    for block in model.blocks:
        block.attention = partial(CP_MODES[mode], group=group, causal=True, layout=CP_LAYOUT)


def apply_torch_ddp(model):
    from torch.nn.parallel import DistributedDataParallel

    device = next(model.parameters()).device
    return DistributedDataParallel(model, device_ids=[device.index] if device.type == "cuda"
                                   else None)


def apply_ddp(module, group):
    from meshrun.parallel import ddp

    ddp(module, group)


def apply_comm_hook(module, group, args):
    """``--comm-hook`` on a module under ``ddp``; the hook's state in a list (PowerSGD's, for
    the checkpoint), or an empty one."""
    from meshrun.parallel import comm_hooks

    if args.comm_hook == "powersgd":
        state = comm_hooks.PowerSGDState(group, matrix_approximation_rank=args.powersgd_rank,
                                         start_powerSGD_iter=args.powersgd_start)
        module.register_comm_hook(state, comm_hooks.powerSGD_hook)
        return [state]
    if args.comm_hook in ("fp16", "bf16"):
        module.register_comm_hook(group, getattr(comm_hooks, f"{args.comm_hook}_compress_hook"))
    return []


def apply_fsdp(module, group, offload=False):
    """One unit per block, then the module (the stage or CharLM: embeddings, norm, head);
    ``offload``: shards, gradients and optimizer state in host memory (CPUOffloadPolicy)."""
    from meshrun.parallel import CPUOffloadPolicy, fully_shard

    policy = CPUOffloadPolicy() if offload else None
    for block in module.blocks.children():  # CharLM: nn.Sequential; a stage: nn.ModuleDict
        fully_shard(block, group, offload_policy=policy)
    fully_shard(module, group, offload_policy=policy)  # the optimizer steps on these shards


def apply_compile(modules, backend):
    """torch.compile each block's forward (fullgraph), after the strategies: their module
    hooks stay eager around the graph (torchtitan's per-block compile)."""
    for module in modules:
        for block in module.blocks.children():
            block.forward = torch.compile(block.forward, fullgraph=True, backend=backend)
    return f"torch.compile per block ({backend})"


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
# pipeline parallelism (--pp N): the blocks split into N stages (2N with interleaved 1F1B or ZB-V),
# embeddings on the first, norm and head on the last


class Embed(nn.Module):  # the first stage's prologue: CharLM.forward's embedding line
    def __init__(self, lm, positions=None):
        super().__init__()
        self.tok_emb, self.pos_emb = lm.tok_emb, lm.pos_emb
        self.positions = positions  # --cp: (local length, device) -> this rank's positions

    def forward(self, idx):
        t = idx.shape[1]
        pos = self.positions(t, idx.device) if self.positions else torch.arange(
            t, device=idx.device)
        return self.tok_emb(idx) + self.pos_emb(pos)


class LMHead(nn.Module):  # the last stage's epilogue: final norm and head -> logits
    def __init__(self, lm):
        super().__init__()
        self.ln_f, self.head = lm.ln_f, lm.head

    def forward(self, x):
        return self.head(self.ln_f(x))


def lm_loss(logits, targets, loss_fn=F.cross_entropy):
    return loss_fn(logits.view(-1, logits.shape[-1]), targets.view(-1))


def stages_per_rank(schedule: str) -> int:
    return 2 if schedule in ("interleaved1f1b", "zbv") else 1


def apply_pp(model, group, args, positions=None):
    """Split the model into stages; return the schedule of this rank's stages. ``positions``:
    how the first stage finds its tokens' positions under --cp (see `Embed`)."""
    from functools import partial

    from meshrun.parallel.pipelining import pipeline, split_into_stages

    n_stages = args.pp * stages_per_rank(args.pp_schedule)
    stages = split_into_stages(model.blocks, n_stages, first=Embed(model, positions),
                               last=LMHead(model))
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
        x, y, _ = par.shard(x, y)  # --cp: the first stage's Embed knows the positions
        losses = []
        par.schedule.step(x.to(device), target=y.to(device), losses=losses,
                          return_outputs=False)
        share = len(x) / global_batch
        return torch.stack(losses).mean() * share if losses else torch.zeros((), device=device)
    total = torch.zeros((), device=device)
    for i, (x, y) in enumerate(batches):
        weight = len(x) / global_batch
        with sync_gradients(par.model, i == len(batches) - 1):
            loss = par.model(*par.shard(x.to(device), y.to(device)))
            (loss * weight * par.dp_size).backward()
        total += loss.detach() * weight
    return total


@torch.no_grad()
def evaluate(par, batches, device) -> float:
    """The mean loss over every rank's evaluation ``batches`` (no gradients, no pipeline): each
    data-parallel rank evaluates its part, and the sums meet in one all-reduce (tensor-parallel
    peers hold the same part, context-parallel peers as many tokens of it: their copies
    cancel in the ratio)."""
    total = torch.zeros(2, device=device)  # [sum of loss x windows, windows]
    for x, y in batches:
        total[0] += par.model(*par.shard(x.to(device), y.to(device))) * len(x)
        total[1] += len(x)
    if torch.distributed.is_initialized():
        torch.distributed.all_reduce(total)
    return (total[0] / total[1]).item()


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


def _say(line):
    if not dist.is_initialized() or dist.get_rank() == 0:
        print(line, flush=True)
