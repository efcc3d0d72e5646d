"""The example's flags: every option of examples/train_char_lm.py, its defaults, and the
checks that make a bad combination one line and exit 2 on every rank."""

import argparse
import os
import sys

from char_lm.parallelize import layout_problem

# the script's one-line description (--help)
DESCRIPTION = "Train a small character-level transformer on Tiny Shakespeare (nanoGPT-style)."
# defaults tuned so 300 steps on 2 CPU ranks take well under 3 minutes
DEFAULTS = dict(steps=300, batch_size=16, block_size=64, lr=3e-3, seed=1337, log_every=25,
                checkpoint_every=100)
# data-parallel strategies; --parallel X is a shorthand for the single-strategy cases
DP_MODES = ("ddp", "fsdp", "torch-ddp")


def parse_args(argv=None):
    """The flags of ``argv`` (default: the command line), ``--parallel`` resolved; a bad
    combination prints ``<prog>: error: <why>`` and exits 2."""
    p = argparse.ArgumentParser(description=DESCRIPTION)
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
    p.add_argument("--eval-timeout", type=float, default=600.0,
                   help="seconds an evaluation counts as progress for --hang-timeout (its "
                   "busy() bound; default 600, torch's NCCL collective timeout: an evaluation "
                   "that hangs is reported within this plus --hang-timeout)")
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
    problem = (f"--eval-timeout must be seconds > 0 (got {args.eval_timeout})"
               if not args.eval_timeout > 0 else None)
    problem = problem or layout_problem(args, int(os.environ.get("WORLD_SIZE", 1))) \
        or elastic_problem(args)
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
