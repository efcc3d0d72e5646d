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

Files: this script (flags, checkpoints, the training loop); ``char_lm/model.py`` (the model),
``char_lm/data.py`` (windows, epochs, batches), ``char_lm/parallelize.py`` (the mesh and the
strategies, one step's forward / backward and gradient clip).
"""

import argparse
import math
import os
import shutil
import signal
import sys
import time

import torch
import torch.distributed as dist
from char_lm.data import batch_summary, check_batch, load_text, microbatches, window_ids, windows
from char_lm.model import CharLM
from char_lm.parallelize import (
    clip_gradients,
    evaluate,
    forward_backward,
    layout_problem,
    parallelize_lm,
)

from meshrun.parallel import busy

# -------------------------------------------------------------------------------------------
# flags (defaults tuned so 300 steps on 2 CPU ranks take well under 3 minutes)
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
    p.add_argument("--eval-every", type=int, default=0,
                   help="every N steps, the mean loss over --eval-batches fixed batches of "
                   "windows (no gradients; inside meshrun.parallel.busy(), so a long "
                   "evaluation is progress for --hang-timeout); not with --pp")
    p.add_argument("--eval-batches", type=int, default=8)
    p.add_argument("--checkpoint-dir", default=None)
    p.add_argument("--checkpoint-every", type=int, default=DEFAULTS["checkpoint_every"])
    p.add_argument("--dp-mode", choices=DP_MODES, default="ddp")
    p.add_argument("--parallel", choices=DP_MODES + ("tp", "pp"), default=None,
                   help="shorthand for --dp-mode, or tp: --tp <world size>, pp: --pp <world size>")
    p.add_argument("--comm-hook", choices=("none", "fp16", "bf16", "powersgd"),
                   default="none", help="with --dp-mode ddp: the gradient communication hook "
                   "(fp16/bf16: all-reduce in half precision; powersgd: low-rank, error feedback)")
    p.add_argument("--powersgd-rank", type=int, default=4, help="with --comm-hook powersgd: "
                   "matrix_approximation_rank")
    p.add_argument("--powersgd-start", type=int, default=10, help="with --comm-hook powersgd: "
                   "start_powerSGD_iter (plain all-reduce for the first steps)")
    p.add_argument("--offload", action="store_true", help="with --dp-mode fsdp: shards, "
                   "gradients and optimizer state in host memory (CPUOffloadPolicy)")
    p.add_argument("--compile", action="store_true", help="torch.compile each block's "
                   "forward (fullgraph) after the strategies are applied")
    p.add_argument("--compile-backend", default="inductor", help="with --compile: e.g. "
                   "inductor, aot_eager")
    p.add_argument("--dp", type=int, default=None, help="data-parallel degree (default: "
                   "world size / (pp x cp x tp))")
    p.add_argument("--tp", type=int, default=1, help="tensor-parallel degree (Megatron-style)")
    p.add_argument("--sequence-parallel", action="store_true", help="with --tp: shard norms "
                   "and residuals along the sequence")
    p.add_argument("--cp", type=int, default=1, help="context-parallel degree: each sequence "
                   "split over N ranks (zigzag layout), attention by --cp-mode")
    p.add_argument("--cp-mode", choices=("ring", "ulysses"), default="ring", help="with --cp: "
                   "ring attention (K/V passed around the ring) or Ulysses (all-to-all to head "
                   "shards; N must divide the heads)")
    p.add_argument("--pp", type=int, default=1, help="pipeline-parallel degree (stages)")
    p.add_argument("--pp-schedule", choices=("gpipe", "1f1b", "interleaved1f1b", "zbh1", "zbv"),
                   default="1f1b", help="with --pp: interleaved1f1b and zbv (zero-bubble, V "
                   "shape) put 2 stages on a rank; zbh1 and zbv split the backward into B and W")
    p.add_argument("--pp-microbatches", type=int, default=4, help="with --pp: per step")
    p.add_argument("--grad-clip", type=float, default=1.0, help="clip the gradient to this "
                   "global norm, over every axis of the mesh (0: no clipping)")
    p.add_argument("--activation-checkpointing", choices=("none", "full", "selective"),
                   default="none", help="recompute each block's activations in backward "
                   "(selective: keep matmul and attention outputs)")
    p.add_argument("--optimizer", choices=("adamw", "sgd"), default="adamw", help="sgd: "
                   "momentum 0.9, no weight decay (its steps scale with the gradient, so the "
                   "logged loss shows a wrong gradient scale that AdamW would hide)")
    p.add_argument("--elastic", choices=("restart", "in-place"), default="restart",
                   help="what a lost node costs: restart (the agent restarts every worker; "
                   "with --checkpoint-dir they resume from the newest checkpoint) or in-place "
                   "(meshrun.parallel.elastic: the survivors stay, change world and retry the "
                   "step; --dp-mode ddp or fsdp, pure data parallelism; with "
                   "--checkpoint-dir a group that restarts anyway resumes from the newest "
                   "checkpoint)")
    p.add_argument("--copy-every", type=int, default=1, help="--elastic in-place with "
                   "--dp-mode fsdp: refresh the neighbour copies (each rank keeps the shards "
                   "of a rank on another node, so a lost node is recovered from memory) "
                   "every N steps; steps since the last refresh are trained again after a "
                   "loss; 0: never (a lost node's shards then come from --checkpoint-dir)")
    p.add_argument("--fail-at-step", type=int, default=None, help="testing: rank 0 raises here")
    p.add_argument("--sleep-per-step", type=float, default=0.0, help="testing: seconds to "
                   "sleep after each step, so that a fault or a joining node lands mid-run")
    args = p.parse_args(argv)
    if args.parallel == "tp":
        args.tp = int(os.environ.get("WORLD_SIZE", 1))
    elif args.parallel == "pp":
        args.pp = int(os.environ.get("WORLD_SIZE", 1))
    elif args.parallel is not None:
        args.dp_mode = args.parallel
    # bad flags: one line and exit 2, on every rank (a launcher's report names the first rank
    # to exit, whichever it is: its output must say why)
    problem = layout_problem(args, int(os.environ.get("WORLD_SIZE", 1))) or elastic_problem(args)
    if problem:
        print(f"{p.prog}: error: {problem}", file=sys.stderr)
        sys.exit(2)
    return args


def elastic_problem(args):
    """What ``--elastic in-place`` cannot do with the other flags (yet), or None."""
    if args.copy_every < 0:
        return f"--copy-every must be >= 0 (got {args.copy_every})"
    if args.elastic != "in-place":
        return None
    if args.dp_mode not in ("ddp", "fsdp") or args.pp > 1 or args.tp > 1 or args.cp > 1 \
            or args.dp or args.offload:
        return ("--elastic in-place: pure data parallelism with --dp-mode ddp or fsdp "
                "(no --offload) only (for now)")
    if args.dp_mode == "fsdp" and args.copy_every == 0 and not args.checkpoint_dir:
        return ("--copy-every 0 with --dp-mode fsdp keeps no copy of a lost node's shards: "
                "give --checkpoint-dir to recover from, or --copy-every N >= 1")
    if args.comm_hook != "none" or args.eval_every:
        return "--elastic in-place: not with --comm-hook or --eval-every (for now)"
    return None


# -------------------------------------------------------------------------------------------
# checkpoints: meshrun.parallel.checkpoint, every rank its own shards, atomic, resharding


def checkpoint_state(par, optimizer, step, position, global_batch):
    """What a checkpoint holds, keyed by the CharLM's parameter names (this rank's part)."""
    from meshrun.parallel import checkpoint

    mine = list(par.modules.parameters())
    return {"model": checkpoint.model_state(par.lm, params=mine),
            "optim": checkpoint.optimizer_state(optimizer, par.lm, params=mine),
            "step": step, "data": {"position": position, "global_batch": global_batch},
            "rng": torch.get_rng_state(),
            **{f"comm_hook{i}": hook for i, hook in enumerate(par.hook_states)}}


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
        if args.cp > 1:
            mode.append(f"cp {args.cp} ({args.cp_mode})")
        mode.append(f"dp {par.dp_size} (dp-mode {args.dp_mode})")
        print(f"{n_params / 1e6:.2f}M params (per rank) | world {world_size} | "
              f"{' | '.join(mode)} | {batch_summary(args, global_batch, par.dp_size, n_micro)}",
              flush=True)

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
            with busy("evaluation"):  # every rank takes part: none of them beats meanwhile
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


def train_in_place(args, model, data, device):
    """``--elastic in-place``: the training loop of `main` under meshrun.parallel.elastic.

    A lost node costs the survivors no restart: the step whose collective failed is tried
    again in the new world. ``build`` makes the mesh and applies ddp (at the start and after
    each change of world); ``state`` is what the ranks agree on after a change. The rule of
    `elastic.steps` holds: each step's collectives (ddp's gradient all-reduce, the clip's
    norm, the logged loss) come before its effects (the optimizer step, the data position),
    so a step either completed or left the state as it was. A step's line is printed after
    its ``with`` block, once the step is done (with fsdp: its neighbour copies out), by rank
    0 of the world it ended in: with ddp, or fsdp and ``--copy-every 1``, a printed step is
    never trained again (``--copy-every N``: up to N - 1 are)."""
    from meshrun.parallel import elastic

    def build():  # the mesh and ddp for the current world, on the live model
        return parallelize_lm(model, args)

    optimizer = make_optimizer(args, model.parameters())  # ddp keeps the same parameters
    global_batch = args.global_batch_size or args.batch_size * int(os.environ["WORLD_SIZE"])
    state = {"model": model, "optim": optimizer, "position": 0, "global_batch": global_batch,
             "resumed_at": None}  # the same keys on every rank: the agreement sends each
    n_windows = (len(data) - 1) // args.block_size
    t0, first = time.perf_counter(), None
    resume = ((lambda: resume_in_place(args, model, optimizer, state))
              if args.checkpoint_dir else None)  # a fresh group's: joiners take the live state
    # one attempt more than there are steps: the end (the last save, the replicas' check) is
    # then retried in the new world like a step when a peer is lost there
    for attempt in elastic.steps(state, args.steps + 1, build=build, resume=resume,
                                 copy_every=args.copy_every):
        line = None
        with attempt:
            par, step, global_batch = attempt.world, attempt.step, state["global_batch"]
            if args.sleep_per_step:  # before the step's collectives: a fault lands mid-step
                time.sleep(args.sleep_per_step)
            if (args.checkpoint_dir and step > 0 and step != state.get("resumed_at")
                    and (step % args.checkpoint_every == 0 or step == args.steps)):
                # at the step's start: a collective before any effect, decided by agreed
                # state alone (every rank saves, or none); a retried step saves it again
                save_in_place(args, par, optimizer, state)
            if step == args.steps:
                if args.dp_mode == "ddp":  # fsdp: every rank holds other rows
                    check_replicas(model)
                continue
            if (step == args.fail_at_step and master_now()
                    and os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") == "0"):
                raise RuntimeError(f"--fail-at-step {step}: failing on purpose (restart count 0)")
            first = step if first is None else first
            n_micro = check_batch(args, global_batch, par.dp_size)
            lr = set_learning_rate(optimizer, args, step)
            ids = window_ids(state["position"], global_batch, n_windows, args.seed)
            batches = [windows(data, part, args.block_size)
                       for part in microbatches(ids, par.dp_rank, par.dp_size, n_micro)]
            optimizer.zero_grad(set_to_none=True)
            loss = forward_backward(par, batches, global_batch, device)
            done = step + 1
            log = done % args.log_every == 0 or done in (1, args.steps)
            grad_norm = clip_gradients(par, args.grad_clip if args.grad_clip > 0 else math.inf)
            if log:
                dist.all_reduce(loss)  # the last collective of the step
            optimizer.step()  # the step's effects, after its collectives
            state["position"] += global_batch
            if log:  # on every rank: rank 0 may be another process once the step is done
                line = (f"step {done} | loss {loss.item():.4f} | grad norm {grad_norm:.4f} "
                        f"| lr {lr:.2e} | world {dist.get_world_size()}")
        if attempt.done and line is not None and master_now():  # not before: a step that is
            ms = (time.perf_counter() - t0) * 1000 / (done - first)  # not done is tried again
            print(f"{line} | {ms:.0f} ms/step", flush=True)
    dist.destroy_process_group()
    return 0


def check_replicas(model):
    """Print whether every rank holds the same parameters, bit for bit (an all-gather): the
    replicas must be equal whoever joined or stayed on the way."""
    flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    copies = [torch.empty_like(flat) for _ in range(dist.get_world_size())]
    dist.all_gather(copies, flat)
    if master_now():
        same = all(torch.equal(c, flat) for c in copies)
        print(f"parameters identical on all {len(copies)} ranks: {'yes' if same else 'NO'}",
              flush=True)


def resume_in_place(args, model, optimizer, state):
    """Load the newest checkpoint under ``--checkpoint-dir`` into ``state`` (a collective).

    `elastic.steps` calls it on every rank of a group where nobody has trained yet (the job's
    start, or the agent restarted the group after a failed handover); a worker that joins
    ranks which trained takes their state instead, without reading the disk."""
    from meshrun.parallel import checkpoint

    path = checkpoint.latest(args.checkpoint_dir)
    if path is None:
        return
    saved = {"model": checkpoint.model_state(model),
             "optim": checkpoint.optimizer_state(optimizer, model), "step": 0,
             "data": {"position": 0, "global_batch": 0}, "rng": torch.get_rng_state()}
    checkpoint.load(saved, path)
    torch.set_rng_state(saved["rng"])
    state.update(step=saved["step"], position=saved["data"]["position"],
                 global_batch=saved["data"]["global_batch"],
                 resumed_at=saved["step"])  # agreed state: a joiner takes it too
    if master_now():
        print(f"resumed from step {saved['step']} ({path}); global batch "
              f"{state['global_batch']}", flush=True)


def save_in_place(args, par, optimizer, state):
    """Save ``state`` (the current world's ``par``) as ``step_<state["step"]>``, in the
    foreground: a background save would outlive the world it was started in."""
    ckpt = checkpoint_state(par, optimizer, state["step"], state["position"],
                            state["global_batch"])
    save_checkpoint(args.checkpoint_dir, ckpt, state["step"])


def set_learning_rate(optimizer, args, step):
    """Set and return step ``step``'s learning rate: linear warm-up over the first 5 % of the
    steps, then cosine decay to lr/10."""
    warmup = max(1, args.steps // 20)
    lr = args.lr * min(1.0, (step + 1) / warmup)
    lr *= 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(1.0, step / args.steps)))
    for group in optimizer.param_groups:
        group["lr"] = lr
    return lr


def master_now():
    """Rank 0 of the current world (it changes when the world does)."""
    return dist.get_rank() == 0


def make_optimizer(args, params):
    if args.optimizer == "sgd":
        return torch.optim.SGD(params, lr=args.lr, momentum=0.9)
    return torch.optim.AdamW(params, lr=args.lr, weight_decay=0.1)


if __name__ == "__main__":
    code = main()
    # Training is over and the group destroyed. torch 2.13 + gloo sometimes aborts in its C++
    # teardown after such a clean finish ("terminate called without an active exception",
    # SIGABRT; under torchrun too), which would turn a finished job into a failed one: leave
    # without running that teardown.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
