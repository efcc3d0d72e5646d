"""Vocabulary-parallel embedding lookup and cross-entropy (Megatron-LM's vocab parallelism).

The vocabulary ``V`` is padded to ``Vp``, a multiple of the TP degree ``P`` (Megatron's
``padded_vocab_size``), and rank ``r`` owns rows ``[r Vp/P, (r+1) Vp/P)`` of the embedding
and of the output layer. Padded rows are never looked up and their logits are ``-inf``.

Embedding (`vocab_parallel_embedding`): ids outside the local range are looked up as row 0
and their vectors zeroed, so each rank returns a partial sum in which every token appears on
exactly one rank; the caller all-reduces (or reduce-scatters along the sequence).

Cross-entropy (`vocab_parallel_cross_entropy`) on logits sharded on the vocabulary, ``z``
``[N, Vp/P]`` per rank, never gathering them (Megatron's ``_VocabParallelCrossEntropy``)::

    m      = all_reduce_max(max_j z_j)                    # one all-reduce of N floats
    e_j    = exp(z_j - m)
    [s, t] = all_reduce_sum([sum_j e_j, z_target - m])    # one all-reduce of 2N floats
    loss   = log s - t
    dL/dz_j = (e_j / s - [j == target]) * dL/dloss         # local: no backward communication

The target logit ``z_target - m`` is contributed by the one rank owning the target (0
elsewhere). Forward moves ``3 N`` floats, backward none; the full ``N x V`` logits never move.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F

from meshrun.parallel._comm import all_reduce_


def vocab_parallel_embedding(ids: torch.Tensor, weight: torch.Tensor, group,
                             padding_idx: int | None = None) -> torch.Tensor:
    """This rank's partial embedding lookup: rows outside the local vocabulary range are 0.

    Args:
        ids: int64 token ids, any shape ``[*]``, the same on every rank, in ``[0, V)``.
        weight: this rank's rows ``[Vp/P, C]`` (rank ``r`` owns ids ``r Vp/P ..``).
        group: the tensor-parallel group.
        padding_idx: global id whose row gets no gradient (``nn.Embedding``'s), or None.

    Returns:
        ``[*, C]``: the sum over ranks is the full lookup (caller reduces).
    """
    rows = weight.shape[0]
    start = dist.get_rank(group) * rows
    outside = (ids < start) | (ids >= start + rows)
    local = (ids - start).masked_fill(outside, 0)
    local_padding = None
    if padding_idx is not None and start <= padding_idx < start + rows:
        local_padding = padding_idx - start
    out = F.embedding(local, weight, local_padding)
    return out.masked_fill(outside.unsqueeze(-1), 0.0)


def vocab_parallel_cross_entropy(input: torch.Tensor, target: torch.Tensor, group, *,
                                 ignore_index: int = -100,
                                 reduction: str = "mean") -> torch.Tensor:
    """Cross-entropy of logits sharded on the vocabulary; equal to ``F.cross_entropy`` on the
    gathered logits, without gathering them.

    Args:
        input: this rank's logits ``[*, Vp/P]`` (rank ``r`` owns classes ``r Vp/P ..``), as a
            ``ColwiseParallel`` output layer returns them; padded classes hold ``-inf``.
            Computed in float32 when lower precision.
        target: class ids ``[*]`` in ``[0, V)``, the same on every rank, or ``ignore_index``.
        group: the tensor-parallel group.
        ignore_index: targets equal to it contribute no loss and no gradient.
        reduction: ``"mean"`` (over non-ignored targets), ``"sum"`` or ``"none"`` (``[*]``).

    Returns:
        The loss: a scalar, or ``[*]`` for ``reduction="none"``; the same on every rank.

    Raises:
        ValueError: unknown ``reduction``, or ``target.shape != input.shape[:-1]``.

    Communication: two all-reduces in forward (``N`` and ``2N`` floats, ``N = target.numel()``),
    none in backward. Mirrors ``F.cross_entropy`` and Megatron-LM's
    ``vocab_parallel_cross_entropy``.
    """
    if reduction not in ("mean", "sum", "none"):
        raise ValueError(f"vocab_parallel_cross_entropy: reduction must be 'mean', 'sum' or "
                         f"'none' (got {reduction!r})")
    if tuple(target.shape) != tuple(input.shape[:-1]):
        raise ValueError(f"vocab_parallel_cross_entropy: target shape {tuple(target.shape)} "
                         f"must be input shape without the class dim {tuple(input.shape[:-1])}")
    shape = target.shape
    ignored = target == ignore_index
    losses = VocabParallelCrossEntropy.apply(input.reshape(-1, input.shape[-1]),
                                             target.reshape(-1).masked_fill(ignored.reshape(-1),
                                                                            0),
                                             ignored.reshape(-1), group)
    losses = losses.view(shape)
    if reduction == "none":
        return losses
    if reduction == "sum":
        return losses.sum()
    return losses.sum() / (~ignored).sum()  # 0/0 = nan when all are ignored, as F.cross_entropy


class VocabParallelCrossEntropy(torch.autograd.Function):
    """Per-token loss ``[N]`` from vocab-sharded logits ``[N, Vp/P]``.

    Forward: all-reduce MAX of the row maxima, then one all-reduce SUM of ``[sum exp, target
    logit]``. Backward: local, ``softmax - one_hot`` (no communication).
    """

    @staticmethod
    def forward(ctx, logits, target, ignored, group):
        dtype = logits.dtype
        z = logits.float()
        rows = z.shape[-1]
        start = dist.get_rank(group) * rows
        m = z.max(dim=-1).values
        all_reduce_(m, group, dist.ReduceOp.MAX)
        z = z - m.unsqueeze(-1)
        outside = (target < start) | (target >= start + rows)
        local = (target - start).masked_fill(outside, 0)
        picked = z.gather(-1, local.unsqueeze(-1)).squeeze(-1).masked_fill(outside, 0.0)
        e = z.exp_()
        sums = torch.stack([e.sum(-1), picked])
        all_reduce_(sums, group)
        loss = (sums[0].log() - sums[1]).masked_fill(ignored, 0.0)
        e.div_(sums[0].unsqueeze(-1))  # softmax, in place of exp
        ctx.save_for_backward(e, local, outside | ignored, ignored)
        ctx.dtype = dtype
        return loss.to(dtype)

    @staticmethod
    def backward(ctx, grad):
        softmax, local, not_here, ignored = ctx.saved_tensors
        g = softmax.clone()
        rows = torch.arange(g.shape[0], device=g.device)
        g[rows, local] -= (~not_here).to(g.dtype)
        g.mul_(grad.float().masked_fill(ignored, 0.0).unsqueeze(-1))
        return g.to(ctx.dtype), None, None, None
