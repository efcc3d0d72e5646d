"""Pieces the benchmarks share (not a benchmark by itself)."""

from __future__ import annotations

import json
import os
import resource
import shutil
import socket
import subprocess
import tempfile
from collections.abc import Callable
from pathlib import Path

import psutil


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago (for a benchmark's own gloo group)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def spawn_ranks(nprocs: int, worker: Callable, make_args: Callable[[int, str], tuple]
                ) -> list[dict]:
    """Run ``worker(rank, *make_args(port, out_dir))`` on ``nprocs`` spawned processes (a
    fresh gloo group on a free port) and return what each rank wrote with `report_rank`."""
    with tempfile.TemporaryDirectory() as out:
        import torch.multiprocessing as mp

        mp.spawn(worker, args=make_args(free_port(), out), nprocs=nprocs)
        return [json.loads(Path(out, f"rank{r}.json").read_text()) for r in range(nprocs)]


def report_rank(out_dir: str, rank: int, result: dict) -> None:
    """Worker side of `spawn_ranks`: write ``result`` plus this process's peak RSS (``rss_mib``,
    ``ru_maxrss`` in MiB)."""
    rss_mib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    Path(out_dir, f"rank{rank}.json").write_text(json.dumps({**result, "rss_mib": rss_mib}))


def kill_tree(pid: int) -> None:
    """SIGKILL a process and every descendant, listed first, then killed at once (a whole node
    going away, or a benchmark round's cleanup)."""
    try:
        root = psutil.Process(pid)
        procs = [root, *root.children(recursive=True)]
    except psutil.NoSuchProcess:
        return
    for p in procs:
        try:
            p.kill()
        except psutil.Error:
            pass


def stop_round(popens: list[subprocess.Popen], tag_env: str, tag: str, directory: Path) -> None:
    """End a benchmark round: kill the launchers' trees, then any stray process whose
    environment carries ``tag_env=tag`` (workers a launcher left behind), reap the launchers,
    and remove the round's directory."""
    for popen in popens:
        kill_tree(popen.pid)
    for p in psutil.process_iter():
        try:
            if p.pid != os.getpid() and p.environ().get(tag_env) == tag:
                p.kill()
        except (psutil.Error, OSError):
            pass
    for popen in popens:
        try:
            popen.wait(10)
        except subprocess.TimeoutExpired:
            pass
    shutil.rmtree(directory, ignore_errors=True)


def print_start() -> float:
    """A benchmark's first lines: its command and the machine's cores and load average; returns
    ``time.monotonic()`` for `print_end`."""
    import shlex
    import sys
    import time

    print("command: " + shlex.join([Path(sys.executable).name, *sys.argv]))
    load0 = os.getloadavg()
    print(f"machine: {os.cpu_count()} cores, load average {load0[0]:.2f} {load0[1]:.2f} "
          f"{load0[2]:.2f} at start\n")
    return time.monotonic()


def print_end(began: float, lead: str = "") -> None:
    """A benchmark's last line (after ``lead``): the load average and the seconds since
    ``began``."""
    import time

    load1 = os.getloadavg()
    print(f"{lead}machine: load average {load1[0]:.2f} {load1[1]:.2f} {load1[2]:.2f} at end; "
          f"{time.monotonic() - began:.0f} s in all")


def make_char_lm():
    """The example's char LM with its batches and loss: ``(model, batch(step, rank), loss_fn)``.

    Needs ``examples/`` on ``sys.path``. Batches are the example's own (2 data-parallel ranks).
    """
    import char_lm as lm
    from train_char_lm import DEFAULTS

    data, vocab = lm.load_text()
    model = lm.CharLM(vocab, DEFAULTS["block_size"])

    size, block = DEFAULTS["batch_size"], DEFAULTS["block_size"]
    n_windows = (len(data) - 1) // block

    def batch(step, rank):  # step s: windows [2 s B, 2 (s + 1) B) of the stream, rank r's half
        ids = lm.window_ids(step * 2 * size, 2 * size, n_windows, 0)
        return lm.windows(data, lm.microbatches(ids, rank, 2, 1)[0], block)

    def loss_fn(m, x, y):
        return m(x, y)

    return model, batch, loss_fn


# -- the checkpoint benchmarks' 2-rank workers (elastic.py part 2, ckpt_stall.py) -------------

REPO = Path(__file__).resolve().parent.parent


def init_gloo_pair(rank: int, port: int) -> None:
    """Worker side: ``REPO`` on ``sys.path`` (for meshrun), warnings off, one intra-op thread,
    and a 2-rank gloo process group on 127.0.0.1:``port`` (900 s timeout)."""
    import sys
    import warnings
    from datetime import timedelta

    import torch
    import torch.distributed as dist

    sys.path.insert(0, str(REPO))
    warnings.filterwarnings("ignore")
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      LOCAL_RANK=str(rank), WORLD_SIZE="2")
    torch.set_num_threads(1)
    dist.init_process_group("gloo", timeout=timedelta(seconds=900))


def local(t):
    """A DTensor's local shard; any other tensor as it is."""
    return t.to_local() if hasattr(t, "to_local") else t


def stack_step(model, opt, x) -> None:
    """One training step of a `build_stack` model: ``square().mean()`` loss on ``x``."""
    model(x).square().mean().backward()
    opt.step()
    opt.zero_grad(set_to_none=True)


def build_stack(side: str, width: int, n_layers: int, lr: float, x):
    """``n_layers`` x nn.Linear(width, width) + ReLU and a nn.Linear(width, 16) head (seed 0),
    sharded each layer then the root with meshrun's fully_shard (``side == "meshrun"``) or
    torch FSDP2 (``"dcp"``), with AdamW(lr) after one `stack_step` on ``x``:
    ``(model, opt, n_params)``."""
    import torch
    from torch import nn
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard as torch_fully_shard

    from meshrun.parallel import fully_shard as meshrun_fully_shard

    class Stack(nn.Module):
        def __init__(self):
            super().__init__()
            self.layers = nn.ModuleList(nn.Linear(width, width) for _ in range(n_layers))
            self.head = nn.Linear(width, 16)

        def forward(self, x):
            for layer in self.layers:
                x = torch.relu(layer(x))
            return self.head(x)

    torch.manual_seed(0)
    model = Stack()
    n_params = sum(p.numel() for p in model.parameters())
    if side == "meshrun":
        for layer in model.layers:
            meshrun_fully_shard(layer)
        meshrun_fully_shard(model)
    else:
        mesh = init_device_mesh("cpu", (2,))
        for layer in model.layers:
            torch_fully_shard(layer, mesh=mesh)
        torch_fully_shard(model, mesh=mesh)
    opt = torch.optim.AdamW(model.parameters(), lr=lr)
    stack_step(model, opt, x)
    return model, opt, n_params


def state_tensors(model, opt) -> list:
    """This rank's parameters and optimizer state tensors (not scalars such as ``step``)."""
    import torch

    out = [local(p) for p in model.parameters()]
    for p in model.parameters():
        out += [local(v) for v in opt.state[p].values() if torch.is_tensor(v) and v.dim()]
    return out


def ckpt_state(side: str, model, opt) -> dict:
    """``{"model", "optim"}`` to save or load: meshrun's model_state / optimizer_state views
    (``side == "meshrun"``) or DCP's get_state_dict."""
    if side == "meshrun":
        from meshrun.parallel import checkpoint

        return {"model": checkpoint.model_state(model),
                "optim": checkpoint.optimizer_state(opt, model)}
    from torch.distributed.checkpoint.state_dict import get_state_dict

    msd, osd = get_state_dict(model, opt)
    return {"model": msd, "optim": osd}


def save_ckpt(side: str, model, opt, path: str, async_: bool = False, pg=None):
    """Save with meshrun's checkpoint.save or DCP (state built inside); None for a sync save,
    a (done, wait) pair for an async one (DCP's async_save over ``pg``)."""
    state = ckpt_state(side, model, opt)
    if side == "meshrun":
        from meshrun.parallel import checkpoint

        if not async_:
            checkpoint.save(state, path)
            return None
        handle = checkpoint.save(state, path, async_=True)
        return handle.done, handle.wait
    import torch.distributed.checkpoint as dcp

    if not async_:
        dcp.save(state, checkpoint_id=path)
        return None
    fut = dcp.async_save(state, checkpoint_id=path, process_group=pg)
    return fut.done, fut.result


def load_ckpt(side: str, model, opt, path: str) -> None:
    """Load in place: meshrun's checkpoint.load, or DCP's load then set_state_dict."""
    state = ckpt_state(side, model, opt)
    if side == "meshrun":
        from meshrun.parallel import checkpoint

        checkpoint.load(state, path)
        return
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import set_state_dict

    dcp.load(state, checkpoint_id=path)
    set_state_dict(model, opt, model_state_dict=state["model"], optim_state_dict=state["optim"])
