"""`clip_grad_norm_` for sharded gradients: the global norm is reduced across the shards.

With ``p`` the norm type and ``g_r`` rank r's shard of all gradients, the norm of the whole
gradient is ``(sum_r ||g_r||_p^p)^(1/p)``: each rank computes ``||g_r||_p^p`` over its shards,
one ``all_reduce`` (SUM; MAX for ``inf``) combines them, and every rank scales its shards by
``min(1, max_norm / (norm + 1e-6))``, as ``torch.nn.utils.clip_grad_norm_`` does on the full
gradient. Parameters that no `fully_shard` unit manages (replicated, e.g. under ``ddp``) hold
the same gradient on every rank, so they are added after the reduction, once.
"""

from __future__ import annotations

import math
from collections.abc import Iterable

import torch
import torch.distributed as dist


@torch.no_grad()
def clip_grad_norm_(parameters: Iterable[torch.Tensor] | torch.Tensor, max_norm: float,
                    norm_type: float = 2.0, error_if_nonfinite: bool = False) -> torch.Tensor:
    """Clip gradients of sharded (and replicated) parameters by their global norm, in place.

    Args:
        parameters: tensors whose ``.grad`` to clip (``model.parameters()``); ``grad`` may be
            None. Sharded ones must all belong to units of one process group.
        max_norm: the largest allowed norm of the whole gradient.
        norm_type: p of the p-norm (``float("inf")`` for the max norm).
        error_if_nonfinite: raise if the total norm is nan or inf.

    Returns:
        The total norm of the whole (unsharded) gradient, a 0-dim fp32 tensor, equal on
        every rank.

    Raises:
        ValueError: sharded parameters of units in different process groups.
        RuntimeError: ``error_if_nonfinite`` and the norm is not finite.

    Mirrors ``torch.nn.utils.clip_grad_norm_`` (and FSDP2's use of it on DTensor gradients).
    """
    if torch.is_tensor(parameters):
        parameters = [parameters]
    sharded, replicated, groups = [], [], []
    for p in parameters:
        if p.grad is None:
            continue
        unit = getattr(p, "_fsdp_unit", None)
        if unit is None:
            replicated.append(p.grad)
            continue
        sharded.append(p.grad)
        if not any(unit.group is g for g in groups):
            groups.append(unit.group)
    if len(groups) > 1:
        raise ValueError(f"clip_grad_norm_: the parameters are sharded over {len(groups)} "
                         f"different process groups; clip each group's parameters separately")
    norm_type = float(norm_type)
    device = (sharded or replicated)[0].device if (sharded or replicated) else torch.device("cpu")
    local = _norm_power(sharded, norm_type, device)
    if groups:
        op = dist.ReduceOp.MAX if math.isinf(norm_type) else dist.ReduceOp.SUM
        dist.all_reduce(local, op=op, group=groups[0])
    rep = _norm_power(replicated, norm_type, device)
    if math.isinf(norm_type):
        total = torch.maximum(local, rep)
    else:
        total = (local + rep) ** (1.0 / norm_type)
    if error_if_nonfinite and not torch.isfinite(total):
        raise RuntimeError(f"clip_grad_norm_: the total norm of order {norm_type} is "
                           f"{total.item()}; set error_if_nonfinite=False to clip anyway")
    coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)
    for g in sharded + replicated:
        g.mul_(coef.to(g.dtype))
    return total


def _norm_power(grads: list[torch.Tensor], norm_type: float, device) -> torch.Tensor:
    """sum ||g||_p^p over ``grads`` (max |g| for inf), fp32; 0 when there are none."""
    grads = [g for g in grads if g.numel()]  # a rank may own no rows of a small parameter
    if not grads:
        return torch.zeros((), dtype=torch.float32, device=device)
    norms = torch.stack([torch.linalg.vector_norm(g.float(), norm_type) for g in grads])
    if math.isinf(norm_type):
        return norms.max()
    return (norms ** norm_type).sum()
