"""`full_state_dict`: the unsplit model's state dict on one rank, for any layout.

Every parameter is gathered from the pieces its ranks hold, as its placement record
(`meshrun.parallel.placement`) says: under `fully_shard` the FSDP rows onto FSDP rank 0, then,
under `parallelize`, the TP blocks onto TP rank 0 (fused chunks put back in order, vocabulary
padding dropped). One parameter at a time, each moved to CPU at once, so no rank holds more
than one gathered parameter on the device and only the first rank holds the model (on CPU).

Mirrors ``get_model_state_dict(model, options=StateDictOptions(full_state_dict=True,
cpu_offload=True))`` of ``torch.distributed.checkpoint.state_dict``.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor

from meshrun.parallel import placement

__all__ = ["full_state_dict"]


def full_state_dict(module: nn.Module) -> dict[str, torch.Tensor]:
    """The state dict of the unsplit ``module``: full tensors on CPU, on its first rank.

    A collective over the groups that cut ``module``'s parameters: call it on every rank that
    holds a part of ``module``, parameters in the same order. Works for any mix of
    `parallelize` (TP), `fully_shard` (FSDP) and `ddp`.

    Pipeline parallelism: pass each rank's own stage module (as given to `PipelineStage`);
    each stage's keys (names relative to the stage module) are returned on that stage's first
    rank (rank 0 of the stage's TP and FSDP groups); merge the stages' dicts yourself.

    Args:
        module: the model or a stage; keys are those of ``module.state_dict()``.

    Returns:
        On the first rank: a dict, in ``module.state_dict()`` order, of CPU tensors in the
        parameters' dtype, with the unsplit shapes. The first rank is rank 0 of every group
        a parameter is cut over; when nothing is cut, every rank that holds the pipeline
        stage (each data-parallel replica of it, under ``ddp``), or global rank 0 when the
        module is not a pipeline stage. Elsewhere ``{}``.

    Raises:
        ValueError: the module holds DTensors that meshrun did not make.
    """
    with placement.local_state_dict():
        local = module.state_dict(keep_vars=True)
    by_key = {name: p for name, p in module.named_parameters(remove_duplicate=False)}
    placements = {key: placement.of(p) for key, p in by_key.items()}
    cut = [c for pl in placements.values() for c in pl.cuts]
    if cut:
        first = all(c.rank == 0 for c in cut)
    else:  # nothing cut: a pipeline stage is whole on its rank(s); else global rank 0 has it
        first = any(pl.stage is not None for pl in placements.values()) or dist.get_rank() == 0
    gathered: dict[int, torch.Tensor | None] = {}  # id(param) -> full (tied: one gather)
    out: dict[str, torch.Tensor] = {}
    for key, value in local.items():
        p = by_key.get(key)
        if p is None or not placements[key].cuts:
            if isinstance(value, DTensor):
                raise ValueError(f"full_state_dict: {key!r} is a DTensor that meshrun did not "
                                 f"make; gather it with torch.distributed.checkpoint.state_dict")
            if first:
                out[key] = value.detach().to("cpu", copy=True)
            continue
        if id(p) not in gathered:
            full = placement.gather_to_first(placements[key], p)
            gathered[id(p)] = None if full is None else full.to("cpu", copy=True)
        if first:
            out[key] = gathered[id(p)]
    return out
