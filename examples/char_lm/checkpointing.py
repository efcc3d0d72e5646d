"""The example's checkpoints: what one holds, saving (meshrun.parallel.checkpoint: every rank
its own shards, atomic, resharding on load; the newest two kept), resuming from the newest, and
the stop request (SIGTERM, SIGINT) that has every rank save before the exit."""

import os
import shutil
import signal
import time

import torch
import torch.distributed as dist


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


def resume(args, state, global_batch, master):
    """Load the newest checkpoint under ``--checkpoint-dir`` into ``state``; return the step,
    the data position and the global batch to go on with (``0, 0, global_batch`` without one).

    The checkpoint's global batch wins over ``--global-batch-size`` (the same windows in the
    same steps after a resize); rank 0 says so when they differ."""
    path = load_checkpoint(args.checkpoint_dir, state)
    if path is None:
        return 0, 0, global_batch
    start, position = state["step"], state["data"]["position"]
    saved = state["data"]["global_batch"]
    if master:
        note = f" (not --global-batch-size {global_batch})" \
            if args.global_batch_size and saved != global_batch else ""
        print(f"resumed from step {start} ({path}); global batch {saved}{note}", flush=True)
    return start, position, saved


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
