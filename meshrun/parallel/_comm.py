"""Collective helpers the strategies share (DDP, FSDP, TP), so each exists once.

- `all_gather_flat` / `reduce_scatter_flat`: torch 2.13 renamed the flat collectives
  (``all_gather_into_tensor`` -> ``all_gather_single``, ``reduce_scatter_tensor`` ->
  ``reduce_scatter_single``) and deprecated the old names; these call whichever exists.
  `ALL_GATHER` and `REDUCE_SCATTER` are the names used (tests count calls by them).
- `all_reduce_`: in place, and nothing at all in a group of one.
- `broadcast_from_first_`: every rank starts from rank 0 of a group's tensors, one flat
  message per (dtype, device) instead of one per tensor.
- `launched` / `wait`: every collective the strategies issue is counted, and every wait for
  one marks the rank blocked (`meshrun.parallel.heartbeat`'s slots), so the agent can tell a
  rank waiting for its peers from one that is computing, and who is behind.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from meshrun._torch import flatten_dense_tensors, unflatten_dense_tensors
from meshrun.parallel.heartbeat import blocked, note_issued

ALL_GATHER = "all_gather_single" if hasattr(dist, "all_gather_single") else "all_gather_into_tensor"
REDUCE_SCATTER = ("reduce_scatter_single" if hasattr(dist, "reduce_scatter_single")
                  else "reduce_scatter_tensor")


def all_gather_flat(output: torch.Tensor, shard: torch.Tensor, group) -> dist.Work:
    """Async all-gather along dim 0: ``output`` ``[P * n, ...]`` <- every rank's ``shard``
    ``[n, ...]``, in rank order. Returns the work handle (``wait()`` before reading)."""
    return launched(getattr(dist, ALL_GATHER)(output, shard, group=group, async_op=True))


def reduce_scatter_flat(output: torch.Tensor, packed: torch.Tensor, group) -> dist.Work:
    """Async reduce-scatter (SUM) along dim 0: ``output`` ``[n, ...]`` <- the sum over the
    ranks of rank r's block of ``packed`` ``[P * n, ...]``. Returns the work handle."""
    return launched(getattr(dist, REDUCE_SCATTER)(output, packed, group=group, async_op=True))


def all_reduce_(x: torch.Tensor, group, op=dist.ReduceOp.SUM) -> torch.Tensor:
    """All-reduce ``x`` in place over ``group`` (skipped in a group of one); returns ``x``."""
    if dist.get_world_size(group) > 1:
        note_issued()
        with blocked():
            dist.all_reduce(x, op=op, group=group)
    return x


def group_device(group) -> torch.device:
    """The device a collective over ``group`` takes tensors on: this rank's current CUDA
    device for nccl (which moves only CUDA tensors), else (gloo; no process group at all, a
    world of one) the CPU."""
    if dist.is_initialized() and dist.get_backend(group) == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def launched(work: dist.Work) -> dist.Work:
    """Count one issued async collective (or send/recv); returns ``work``."""
    note_issued()
    return work


def wait(work: dist.Work) -> None:
    """``work.wait()``, with this rank marked blocked in a collective meanwhile."""
    with blocked():
        work.wait()


@torch.no_grad()
def broadcast_from_first_(tensors: list[torch.Tensor], group, swap_data: bool = False) -> None:
    """Give every rank of ``group`` its rank 0's values of ``tensors``, one flat message per
    (dtype, device).

    ``swap_data=False``: copy into the tensors in place (when a strategy is applied).
    ``swap_data=True``: the other ranks point ``t.data`` at the received values instead (no
    version-counter bump: buffers broadcast before every forward, as torch's DDP does).
    """
    by_key: dict = {}
    for t in tensors:
        by_key.setdefault((t.dtype, t.device), []).append(t)
    is_src = dist.get_rank(group) == 0
    for same in by_key.values():
        flat = flatten_dense_tensors([t.detach() for t in same])
        dist.broadcast(flat, group=group, group_src=0)
        if is_src:
            continue
        for t, value in zip(same, unflatten_dense_tensors(flat, same), strict=True):
            if swap_data:
                t.data = value
            else:
                t.copy_(value)
