"""Train a small character-level transformer on Tiny Shakespeare (nanoGPT-style).

A plain torchrun script: it reads RANK / LOCAL_RANK / WORLD_SIZE from the environment, so it
runs unchanged under ``torchrun``, under ``meshrun``, or as plain ``python`` (one process):

    meshrun --nproc-per-node 2 examples/train_char_lm.py --steps 300 --checkpoint-dir ckpt
    torchrun --nproc-per-node 2 examples/train_char_lm.py --dp-mode torch-ddp

Parallelism: ``--pp P --tp T --cp C --dp D`` lay the world out as one mesh
``Mesh({"pp": P, "dp": D, "cp": C, "tp": T})`` (TP innermost; D defaults to world size /
(P C T), and P D C T must equal the world size), and `parallelize_lm` applies, in this order:

- tensor parallelism (``--tp``, or ``--parallel tp``): attention heads, MLP and the vocabulary
  sharded over T ranks with ``meshrun.parallel.parallelize`` and `tp_plan` (Megatron-style,
  vocab-parallel loss); ``--sequence-parallel`` also shards norms and residuals along the
  sequence. Ranks of one TP group see the same batch.
- context parallelism (``--cp``): each sequence split over C ranks in the zigzag layout
  (rank r holds chunks r and 2C-1-r of 2C; positions follow), attention by ``--cp-mode``
  ``ring`` (``meshrun.parallel.ring_attention``) or ``ulysses`` (all-to-all); batches are
  split by the dp rank only, and gradients reduced over dp x cp. Composes with --tp (and
  --sequence-parallel, which shards each rank's part further) and --pp (each stage's
  attention rings between the ranks holding that stage).
- pipeline parallelism (``--pp``, or ``--parallel pp``): the blocks split into P stages with
  ``meshrun.parallel.split_into_stages``, trained with ``--pp-schedule`` (1F1B by default)
  over ``--pp-microbatches`` microbatches; the loss equals the unsplit model's.
- data parallelism over D ranks, ``--dp-mode``: ``ddp`` (default, ``meshrun.parallel.ddp``),
  ``fsdp`` (``meshrun.parallel.fully_shard`` on each block, then the rest: ZeRO-3) or ``torch-ddp`` (torch's ``DistributedDataParallel``, the
  reference; pure data parallelism only). ``--parallel ddp|fsdp|torch-ddp`` = ``--dp-mode``.
  With ``ddp``, ``--comm-hook fp16|bf16|powersgd`` reduces gradients through that
  communication hook (``meshrun.parallel.comm_hooks``; PowerSGD at ``--powersgd-rank`` from
  step ``--powersgd-start``, its state saved in the checkpoint); with ``fsdp``, ``--offload``
  keeps shards, gradients and optimizer state in host memory. ``--compile`` compiles each
  block's forward (``torch.compile``, fullgraph) after the strategies are applied.

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

Recovery in place (``--elastic in-place``, pure data parallelism, ``--dp-mode ddp`` or
``fsdp``): the loop runs under ``meshrun.parallel.elastic.steps``; when a node is lost or
joins, meshrun's agent hands the running workers the new round, they change world (the mesh
and the strategy rebuilt on the live model, the state agreed by broadcast) and retry the
step, with the same global batch rule: no process restarts, no checkpoint is read, no step
is lost (docs/faults.md). With fsdp each rank keeps a copy of the shards of a rank on another
node, refreshed every ``--copy-every`` steps (`meshrun.parallel.fsdp.copies`), so the lost
node's shards come from memory. With
``--checkpoint-dir`` it also saves every ``--checkpoint-every`` steps (at the start of the
step, in the foreground) and at the end, and a group where nobody has trained yet (the
job's start, or the agent restarted it: a worker did not take the new world in time) resumes
from the newest checkpoint; a worker that joins ranks training in place takes their state and
reads no checkpoint.

Files: this script (the training loop); ``char_lm/model.py`` (the model), ``char_lm/data.py``
(windows, epochs, batches), ``char_lm/parallelize.py`` (the mesh and the strategies, one
step's forward / backward and gradient clip), ``char_lm/flags.py`` (the flags),
``char_lm/checkpointing.py`` (saves, loads, the stop request), ``char_lm/optim.py`` (the
optimizer and the learning rate), ``char_lm/in_place.py`` (the ``--elastic in-place`` loop).
"""

import math
import os
import sys
import time

import torch
import torch.distributed as dist
from char_lm.checkpointing import StopRequest, checkpoint_state, resume, save_checkpoint
from char_lm.data import batch_summary, check_batch, load_text, microbatches, window_ids, windows
from char_lm.flags import DEFAULTS, parse_args  # noqa: F401 (benchmarks read DEFAULTS here)
from char_lm.in_place import train_in_place
from char_lm.model import CharLM
from char_lm.optim import make_optimizer, set_learning_rate
from char_lm.parallelize import clip_gradients, evaluate, forward_backward, parallelize_lm

from meshrun.parallel import busy


def main(argv=None):
    args = parse_args(argv)
    distributed = "RANK" in os.environ
    if distributed:  # the torchrun environment -> process group (nccl / gloo) and device
        from meshrun.parallel import init

        ctx = init(timeout=120)
        rank, world_size, device = ctx.rank, ctx.world_size, ctx.device
    else:  # plain python: one process, no process group
        rank, world_size = 0, 1
        device = torch.device("cuda", 0) if torch.cuda.is_available() else torch.device("cpu")
    if device.type == "cpu" and world_size > 1 and "OMP_NUM_THREADS" not in os.environ:
        torch.set_num_threads(1)
    master = rank == 0

    torch.manual_seed(args.seed)  # same initial weights on every rank (DDP broadcasts anyway)
    data, vocab_size = load_text()
    model = CharLM(vocab_size, args.block_size).to(device)
    if args.elastic == "in-place" and distributed:
        return train_in_place(args, model, data, device)
    par = parallelize_lm(model, args)  # before the optimizer sees the parameters
    optimizer = make_optimizer(args, par.modules.parameters())
    global_batch = args.global_batch_size or args.batch_size * par.dp_size
    start, position, state = 0, 0, None
    if args.checkpoint_dir:  # the newest checkpoint, if any: its step, position, global batch
        state = checkpoint_state(par, optimizer, 0, 0, global_batch)
        start, position, global_batch = resume(args, state, global_batch, master)
    n_micro = check_batch(args, global_batch, par.dp_size)
    if master:
        print(layout_line(args, par, world_size, global_batch, n_micro), flush=True)

    restart_count = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", 0))
    stop = StopRequest(device) if args.checkpoint_dir else None
    n_windows = (len(data) - 1) // args.block_size
    eval_batches = []
    if args.eval_every:
        if args.pp > 1:
            raise SystemExit("--eval-every: not with --pp (the pipeline has no forward-only step here)")
        ids = window_ids(0, args.eval_batches * global_batch, n_windows, args.seed + 1)
        eval_batches = [windows(data, part, args.block_size)
                        for part in microbatches(ids, par.dp_rank, par.dp_size, args.eval_batches)]
    t0 = time.perf_counter()
    for step in range(start, args.steps):
        if step == args.fail_at_step and master and restart_count == 0:
            raise RuntimeError(f"--fail-at-step {step}: failing on purpose (restart count 0)")
        lr = set_learning_rate(optimizer, args, step)
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

        if args.eval_every and done % args.eval_every == 0:
            # every rank takes part: none of them beats meanwhile; a hung one is still caught
            with busy("evaluation", timeout=args.eval_timeout):
                val = evaluate(par, eval_batches, device)
            if master:
                print(f"step {done} | eval loss {val:.4f}", flush=True)
        if log:
            if distributed:  # the shares of the dp ranks add up; --tp/--cp: each such rank
                dist.all_reduce(loss)  # has it (--cp: the mean of its tokens)
                loss /= args.tp * args.cp
            ms = (time.perf_counter() - t0) * 1000 / (done - start)
            if master:
                print(f"step {done} | loss {loss.item():.4f} | grad norm {grad_norm:.4f} | "
                      f"lr {lr:.2e} | {ms:.0f} ms/step", flush=True)
        if args.sleep_per_step:
            time.sleep(args.sleep_per_step)
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


def layout_line(args, par, world_size, global_batch, n_micro):
    """The run's one-line summary: parameters, world, each axis of the mesh, the batch."""
    n_params = sum(p.numel() for p in par.modules.parameters())
    mode = [f"pp {args.pp} ({args.pp_schedule}, {args.pp_microbatches} microbatches)"] \
        if args.pp > 1 else []
    if args.tp > 1:
        mode.append(f"tp {args.tp}{' + sp' if args.sequence_parallel else ''}")
    if args.cp > 1:
        mode.append(f"cp {args.cp} ({args.cp_mode})")
    mode.append(f"dp {par.dp_size} (dp-mode {args.dp_mode})")
    return (f"{n_params / 1e6:.2f}M params (per rank) | world {world_size} | "
            f"{' | '.join(mode)} | {batch_summary(args, global_batch, par.dp_size, n_micro)}")


if __name__ == "__main__":
    code = main()
    # Training is over and the group destroyed. torch 2.13 + gloo sometimes aborts in its C++
    # teardown after such a clean finish ("terminate called without an active exception",
    # SIGABRT; under torchrun too), which would turn a finished job into a failed one: leave
    # without running that teardown.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
