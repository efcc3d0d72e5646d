"""``--elastic in-place``: the example's training loop under meshrun.parallel.elastic, where a
lost or joining node costs the survivors no restart (docs/faults.md "Recovery in place")."""

import math
import os
import time

import torch
import torch.distributed as dist

from char_lm.checkpointing import checkpoint_state, save_checkpoint
from char_lm.data import check_batch, microbatches, window_ids, windows
from char_lm.optim import make_optimizer, set_learning_rate
from char_lm.parallelize import clip_gradients, forward_backward, parallelize_lm


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


def master_now():
    """Rank 0 of the current world (it changes when the world does)."""
    return dist.get_rank() == 0
