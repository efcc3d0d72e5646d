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


def make_char_lm():
    """The example's char LM with its batches and loss: ``(model, batch(step, rank), loss_fn)``.

    Needs ``examples/`` on ``sys.path``. Batches are the example's own (2 data-parallel ranks).
    """
    import train_char_lm as lm

    data, vocab = lm.load_text()
    model = lm.CharLM(vocab, lm.DEFAULTS["block_size"])

    size, block = lm.DEFAULTS["batch_size"], lm.DEFAULTS["block_size"]
    n_windows = (len(data) - 1) // block

    def batch(step, rank):  # step s: windows [2 s B, 2 (s + 1) B) of the stream, rank r's half
        ids = lm.window_ids(step * 2 * size, 2 * size, n_windows, 0)
        return lm.windows(data, lm.microbatches(ids, rank, 2, 1)[0], block)

    def loss_fn(m, x, y):
        return m(x, y)

    return model, batch, loss_fn
