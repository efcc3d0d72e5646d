"""`clip_grad_norm_` for sharded gradients: the global norm is reduced across the shards.

With ``p`` the norm type and ``g_r`` rank r's shard of all gradients, the norm of the whole
gradient is ``(sum_r ||g_r||_p^p)^(1/p)``: each rank computes ``||g_r||_p^p`` over its shards,
one ``all_reduce`` (SUM; MAX for ``inf``) combines them, and every rank scales its shards by
``min(1, max_norm / (norm + 1e-6))``, as ``torch.nn.utils.clip_grad_norm_`` does on the full
gradient. Parameters that no `fully_shard` unit manages (replicated, e.g. under ``ddp``) hold
the same gradient on every rank, so they are added after the reduction, once.

On an N-D mesh (``mesh=``: pipeline x data x tensor parallel) a gradient block can be held by
several ranks, and which ones depends on the strategies that cut the parameter, so each rank
weights its blocks instead. A parameter of a pipeline stage lives on the
``R = world_size / mesh.size("pp")`` ranks of that stage; cut over groups of sizes
``n_1, n_2, ...`` (its `meshrun.parallel.placement` record: its TP group, then its FSDP group),
each distinct block is held by ``R / (n_1 n_2 ...)`` of them. A rank therefore adds
``||g||_p^p * n_1 n_2 ... / R`` per local gradient, and one ``all_reduce`` (SUM) over the world
counts every block of every stage exactly once (MAX for ``inf``, no weights: a copy does not
change a maximum).
"""

from __future__ import annotations

import math
from collections.abc import Iterable

import torch
import torch.distributed as dist

from meshrun.parallel import placement
from meshrun.parallel._comm import group_device


@torch.no_grad()
def clip_grad_norm_(parameters: Iterable[torch.Tensor] | torch.Tensor, max_norm: float,
                    norm_type: float = 2.0, error_if_nonfinite: bool = False, *,
                    mesh=None) -> torch.Tensor:
    """Clip gradients of sharded (and replicated) parameters by their global norm, in place.

    Args:
        parameters: tensors whose ``.grad`` to clip (``model.parameters()``); ``grad`` may be
            None. Without ``mesh``, sharded ones must all belong to units of one process group.
            With ``mesh``, pass this rank's parameters only (those of its pipeline stages, as
            given to the optimizer): every rank must call, with its own.
        max_norm: the largest allowed norm of the whole gradient.
        norm_type: p of the p-norm (``float("inf")`` for the max norm).
        error_if_nonfinite: raise if the total norm is nan or inf.
        mesh: a `meshrun.parallel.Mesh` over the whole world: the norm is then taken over
            every axis (pipeline stages, tensor-parallel and `fully_shard` shards, data-parallel
            replicas), see the module docstring; its ``"pp"`` axis, if any, counts the stages.
            Gradients must be synchronised over the data-parallel axis (after ``backward``).
            None: the norm over this rank's shards and replicated tensors, reduced over the
            one `fully_shard` group (if any).

    Returns:
        The total norm of the whole (unsharded) gradient, a 0-dim fp32 tensor, equal on
        every rank (for the mesh's whole model, with ``mesh``).

    Raises:
        ValueError: without ``mesh``: sharded parameters of units in different process groups.
        RuntimeError: ``error_if_nonfinite`` and the norm is not finite.

    Mirrors ``torch.nn.utils.clip_grad_norm_`` (and FSDP2's use of it on DTensor gradients);
    the weighting on a mesh does what Megatron-LM's ``get_grad_norm`` does by skipping
    tensor-parallel duplicates and all-reducing over the model-parallel group.
    """
    if torch.is_tensor(parameters):
        parameters = [parameters]
    norm_type = float(norm_type)
    if mesh is not None:
        params = [p for p in parameters if p.grad is not None]
        total = _mesh_norm(params, norm_type, mesh)
        return _clip([p.grad for p in params], total, max_norm, norm_type, error_if_nonfinite)
    sharded, replicated, groups = [], [], []
    for p in parameters:
        if p.grad is None:
            continue
        fsdp = [c.group for c in placement.of(p).cuts if c.strategy == "fsdp"]
        if not fsdp:
            replicated.append(p.grad)
            continue
        sharded.append(p.grad)
        if not any(fsdp[0] is g for g in groups):
            groups.append(fsdp[0])
    if len(groups) > 1:
        raise ValueError(f"clip_grad_norm_: the parameters are sharded over {len(groups)} "
                         f"different process groups; clip each group's parameters separately "
                         f"or pass mesh= to take the norm over the whole mesh")
    device = (sharded or replicated)[0].device if (sharded or replicated) else torch.device("cpu")
    local = _norm_power(sharded, norm_type, device)
    if groups:
        op = dist.ReduceOp.MAX if math.isinf(norm_type) else dist.ReduceOp.SUM
        on = group_device(groups[0])  # offloaded gradients are on the host; nccl is not
        reduced = local.to(on)
        dist.all_reduce(reduced, op=op, group=groups[0])
        local = reduced.to(device)
    rep = _norm_power(replicated, norm_type, device)
    if math.isinf(norm_type):
        total = torch.maximum(local, rep)
    else:
        total = (local + rep) ** (1.0 / norm_type)
    return _clip(sharded + replicated, total, max_norm, norm_type, error_if_nonfinite)


def _mesh_norm(params: list[torch.Tensor], norm_type: float, mesh) -> torch.Tensor:
    """The norm over the whole mesh: weighted local p-th powers, one all_reduce over the world."""
    stage_ranks = dist.get_world_size() // (mesh.size("pp") if "pp" in mesh.axes else 1)
    params = [p for p in params if p.grad.numel()]  # a rank may own no rows of a parameter
    device = params[0].grad.device if params else torch.device(mesh.device_mesh.device_type)
    if not params:
        local = torch.zeros((), dtype=torch.float32, device=device)
    else:
        norms = torch.stack([torch.linalg.vector_norm(p.grad.float(), norm_type)
                             for p in params])
        if math.isinf(norm_type):
            local = norms.max()
        else:
            # each distinct block is held by stage_ranks / prod(shard group sizes) ranks
            weights = torch.tensor([math.prod(c.size for c in placement.of(p).cuts)
                                    / stage_ranks for p in params],
                                   dtype=torch.float32, device=device)
            local = (norms ** norm_type * weights).sum()
    if math.isinf(norm_type):
        dist.all_reduce(local, op=dist.ReduceOp.MAX)
        return local
    dist.all_reduce(local, op=dist.ReduceOp.SUM)
    return local ** (1.0 / norm_type)


def _clip(grads: list[torch.Tensor], total: torch.Tensor, max_norm: float, norm_type: float,
          error_if_nonfinite: bool) -> torch.Tensor:
    """Scale ``grads`` by ``min(1, max_norm / (total + 1e-6))`` in place; return ``total``."""
    if error_if_nonfinite and not torch.isfinite(total):
        raise RuntimeError(f"clip_grad_norm_: the total norm of order {norm_type} is "
                           f"{total.item()}; set error_if_nonfinite=False to clip anyway")
    coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)
    for g in grads:
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
