"""Ulysses attention: all-to-all from sequence shards to head shards and back.

Jacobs et al., "DeepSpeed Ulysses" (2023). Each of the cp ranks holds ``S / cp`` tokens of all
``H`` heads. One all-to-all per tensor regroups q, k and v so that each rank holds the whole
sequence of ``H / cp`` heads; attention then runs locally (``F.scaled_dot_product_attention``,
whatever kernel the device has), and one all-to-all brings the output back to sequence shards.
Backward is the same all-to-alls in reverse (the gradient of an all-to-all is the inverse
all-to-all).

Which mode fits (per rank and attention call, in elements of one local q, ``B H S/cp D``):

- Ulysses moves ``4 (cp-1)/cp`` forward (q, k, v, out) and as much backward: constant in cp,
  but not overlapped with compute, and it needs ``H`` (the key/value heads too) divisible by
  cp, so cp is at most the head count. Attention itself is the device's fused kernel.
- Ring (`meshrun.parallel.cp.ring`) moves ``2 (cp-1)`` forward and ``4 cp - 2`` backward,
  growing with cp, but point to point between neighbours and hidden behind the blocks'
  compute; any head count, any cp. Prefer it when heads are few or cp is large, Ulysses when
  cp divides the heads and the all-to-all is cheap (inside a node).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F

from meshrun.parallel._comm import launched, wait
from meshrun.parallel.cp.layout import chunks_of
from meshrun.parallel.cp.ring import check_attention_inputs

_SDPA = F.scaled_dot_product_attention  # torch's, also inside context_parallel_attention


def ulysses_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                      group: dist.ProcessGroup | None = None, *, causal: bool = False,
                      layout: str = "zigzag", scale: float | None = None,
                      attn_mask: torch.Tensor | None = None, dropout_p: float = 0.0
                      ) -> torch.Tensor:
    """``F.scaled_dot_product_attention(q, k, v, is_causal=causal)`` of the whole sequence on
    this rank's shard, by all-to-all over ``group`` (see the module doc for when to use it).

    Args:
        q, k, v: this rank's shards ``(batch, heads, S / cp, head_dim)`` in ``layout``
            (``"zigzag"`` or ``"contiguous"``: the gathered sequence is put in position order
            before attention, so the result is the same for both); v may differ in head_dim.
        group, causal, scale: as `ring_attention`.

    Returns:
        This rank's output shard ``(batch, heads, S / cp, head_dim_v)``.

    Raises:
        ValueError: heads (of q or k/v) not divisible by cp (use ``ring_attention``, or a cp
            that divides them), an ``attn_mask`` (use ``causal=True``), ``dropout_p`` > 0, and
            the input errors of `ring_attention`.
    """
    cp = dist.get_world_size(group) if dist.is_initialized() else 1
    check_attention_inputs("ulysses_attention", q, k, v, cp, layout, attn_mask, dropout_p)
    for t, label in ((q, "q"), (k, "k"), (v, "v")):
        if t.shape[1] % cp:
            raise ValueError(f"ulysses_attention: {label} has {t.shape[1]} heads, which the "
                             f"context-parallel degree {cp} does not divide; use "
                             f"ring_attention (any head count) or a cp that divides the heads")
    if cp == 1:
        return _SDPA(q, k, v, is_causal=causal, scale=scale)
    order = _position_order(cp, layout)
    q, k, v = (_to_positions(_SeqToHeads.apply(t, group), order) for t in (q, k, v))
    y = _SDPA(q, k, v, is_causal=causal, scale=scale)
    return _HeadsToSeq.apply(_from_positions(y, order), group)


def _position_order(cp: int, layout: str) -> list[int]:
    """Gathered chunk i (ranks' shards back to back) -> its chunk index in the sequence."""
    return [c for r in range(cp) for c in chunks_of(r, cp, layout)]


def _to_positions(x, order):
    """Gathered order (rank 0's chunks, rank 1's, ...) -> position order, along dim 2."""
    if order == sorted(order):
        return x
    pieces = x.chunk(len(order), dim=2)
    inverse = sorted(range(len(order)), key=order.__getitem__)
    return torch.cat([pieces[i] for i in inverse], dim=2)


def _from_positions(x, order):
    if order == sorted(order):
        return x
    pieces = x.chunk(len(order), dim=2)
    return torch.cat([pieces[c] for c in order], dim=2)


def _all_to_all(x: torch.Tensor, group) -> torch.Tensor:
    """Block i of dim 0 goes to rank i; block j of the result came from rank j."""
    out = torch.empty_like(x)
    wait(launched(dist.all_to_all_single(out, x, group=group, async_op=True)))
    return out


def _seq_to_heads(x, group):
    """(B, H, S/cp, D) sequence shard -> (B, H/cp, S, D) head shard (gathered rank order)."""
    cp = dist.get_world_size(group)
    b, h, s, d = x.shape
    send = x.reshape(b, cp, h // cp, s, d).transpose(0, 1).contiguous()
    got = _all_to_all(send, group)  # (cp: sequence shard of rank j, B, H/cp, S/cp, D)
    return got.permute(1, 2, 0, 3, 4).reshape(b, h // cp, cp * s, d)


def _heads_to_seq(y, group):
    """(B, H/cp, S, D) head shard -> (B, H, S/cp, D) sequence shard; inverse of the above."""
    cp = dist.get_world_size(group)
    b, hl, s, d = y.shape
    send = y.reshape(b, hl, cp, s // cp, d).permute(2, 0, 1, 3, 4).contiguous()
    got = _all_to_all(send, group)  # (cp: head group of rank j, B, H/cp, S/cp, D)
    return got.transpose(0, 1).reshape(b, cp * hl, s // cp, d)


class _SeqToHeads(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return _seq_to_heads(x, group)

    @staticmethod
    def backward(ctx, grad):
        return _heads_to_seq(grad.contiguous(), ctx.group), None


class _HeadsToSeq(torch.autograd.Function):
    @staticmethod
    def forward(ctx, y, group):
        ctx.group = group
        return _heads_to_seq(y, group)

    @staticmethod
    def backward(ctx, grad):
        return _seq_to_heads(grad.contiguous(), ctx.group), None
