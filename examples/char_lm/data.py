"""Data and batches: an epoch is every window once, in a seeded order; step s trains on
windows [s G, (s + 1) G) of that stream, split by data-parallel rank, then into microbatches
(the rule that keeps training the same across a resize: see train_char_lm.py)."""

import functools
import os

import torch

DATA = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "data",
                    "tinyshakespeare.txt")


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
