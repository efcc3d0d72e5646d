"""Ring attention: exact attention over a sequence sharded across the ranks of a CP group.

Liu et al., "Ring Attention with Blockwise Transformers" (2023); the load-balanced causal
layout as in Megatron-LM's context parallel. Each rank holds ``S / cp`` tokens of q, k and v
(`meshrun.parallel.cp.layout`). It keeps its queries and passes the key/value shard around
the ring: at step i (0 <= i < cp) rank r holds the keys and values of rank ``(r - i) mod cp``,
starts sending them on to rank r+1 (and receiving the next from r-1), and meanwhile attends
its queries to them.

Math (flash-attention style, per query row). A block of keys gives scores ``s = q k^T scale``,
a log-sum-exp ``l_b = log sum exp s`` and an output ``o_b = softmax(s) v``. Blocks merge with
the running ``(o, l)``::

    l' = logaddexp(l, l_b);   o' = o exp(l - l') + o_b exp(l_b - l')

so after the last step ``o`` is softmax over every key of the sequence, and ``l`` its
log-sum-exp. Forward saves only q, k, v, o and l (O(S / cp) per rank, no S x S matrix).
Backward recomputes each block's probabilities ``p = exp(s - l)`` from the saved ``l`` and,
with ``delta = rowsum(dO * O)``::

    dV += p^T dO;  dS = p (dO V^T - delta);  dQ += dS K scale;  dK += dS^T Q scale

Keys and values go round the ring again, and with them an accumulator of their dK and dV:
each rank adds its block's contribution and passes it on, so after cp steps and one more hop
every accumulator is back on the rank that owns those keys. Sends run while the next block
computes. On CPU each block is torch's fused attention kernel (its forward returns the block's
log-sum-exp; its backward, given the final output and log-sum-exp, is exactly the block's
share of the gradients), elsewhere the same math in matmuls.

Causal masks: a rank's own block is causal on local indices (both layouts keep local tokens in
position order). Another rank's block is, by chunk order, fully visible or fully masked:
contiguous, the block of an earlier rank is visible and of a later one skipped (unbalanced);
zigzag (rank r holds chunks r and 2cp-1-r), an earlier rank's first chunk is visible to both of
r's chunks, and a later rank's whole shard is visible to r's second chunk only; every rank
computes half a block per step.

Communication per rank and attention call, in elements of one local q (``B H S/cp D``):
forward ``2 (cp-1)``, backward ``2 (cp-1) + 2 cp`` (keys/values, then their gradients).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from meshrun import _torch
from meshrun.parallel._comm import launched, wait
from meshrun.parallel.cp.layout import LAYOUTS, check_layout

KV_TAG, DKV_TAG = 0, 1  # distinct tags: both are in flight between the same pair in backward


def ring_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                   group: dist.ProcessGroup | None = None, *, causal: bool = False,
                   layout: str = "zigzag", scale: float | None = None,
                   attn_mask: torch.Tensor | None = None, dropout_p: float = 0.0
                   ) -> torch.Tensor:
    """``F.scaled_dot_product_attention(q, k, v, is_causal=causal)`` of the whole sequence,
    on this rank's sequence shard, with keys and values passed around ``group``'s ring.

    Args:
        q, k, v: this rank's shards, ``(batch, heads, S / cp, head_dim)``, the same shape,
            laid out by ``layout`` (shard with `meshrun.parallel.cp.shard_sequence`).
        group: the context-parallel group (default: the world), ``cp`` ranks.
        causal: the causal mask on global positions (as SDPA's ``is_causal``).
        layout: ``"zigzag"`` (load-balanced under ``causal``) or ``"contiguous"``.
        scale: score scale (default ``1 / sqrt(head_dim)``, as SDPA).
        attn_mask, dropout_p: not supported (refused).

    Returns:
        This rank's shard of the output, ``(batch, heads, S / cp, head_dim)``, in q's dtype;
        differentiable in q, k and v (the backward is a second ring, see the module doc).

    Raises:
        ValueError: an ``attn_mask`` (use ``causal=True``), ``dropout_p`` > 0, tensors that
            are not 4-D or differ in shape, dtype or device, an unknown layout, or a local
            length the layout cannot split (zigzag needs an even one).
    """
    cp = dist.get_world_size(group) if dist.is_initialized() else 1
    check_attention_inputs("ring_attention", q, k, v, cp, layout, attn_mask, dropout_p)
    if k.shape != q.shape or v.shape != q.shape:
        raise ValueError(f"ring_attention: q, k and v must have one shape (got {tuple(q.shape)}, "
                         f"{tuple(k.shape)}, {tuple(v.shape)}); repeat grouped key/value heads "
                         f"to q's head count first")
    scale = q.shape[-1] ** -0.5 if scale is None else float(scale)
    return _RingAttention.apply(q, k, v, group, causal, layout, scale)


def check_attention_inputs(name, q, k, v, cp, layout, attn_mask, dropout_p) -> None:
    """The refusals ring and Ulysses attention share (see `ring_attention`'s Raises)."""
    if attn_mask is not None:
        raise ValueError(f"{name}: attn_mask is not supported under context parallelism (a "
                         f"mask over the whole sequence would have to be sharded too); for a "
                         f"causal mask pass causal=True and no attn_mask")
    if dropout_p:
        raise ValueError(f"{name}: dropout_p={dropout_p} is not supported; use 0 (dropout on "
                         f"the attention output instead)")
    for t, label in ((q, "q"), (k, "k"), (v, "v")):
        if t.dim() != 4:
            raise ValueError(f"{name}: {label} must be (batch, heads, seq_local, head_dim), "
                             f"got shape {tuple(t.shape)}")
    if not (q.dtype == k.dtype == v.dtype and q.device == k.device == v.device):
        raise ValueError(f"{name}: q, k and v must share dtype and device (got {q.dtype}/"
                         f"{q.device}, {k.dtype}/{k.device}, {v.dtype}/{v.device})")
    if layout not in LAYOUTS:
        check_layout(layout, 0, cp)  # the unknown-layout error
    local = q.shape[2]
    check_layout(layout, local * cp, cp, detail=f" ({local} per rank x {cp} ranks)")


def _acc_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float32 if dtype in (torch.float16, torch.bfloat16) else dtype


def _blocks(rank: int, src: int, causal: bool, layout: str, n: int):
    """What of (q of ``rank``) x (keys of ``src``) is visible: [(q rows, k rows, diagonal)]."""
    every = slice(None)
    if not causal:
        return [(every, every, False)]
    if src == rank:
        return [(every, every, True)]
    if layout == "contiguous":
        return [(every, every, False)] if src < rank else []
    half = n // 2  # zigzag: chunk r, then chunk 2cp-1-r
    if src < rank:
        return [(every, slice(0, half), False)]
    return [(slice(half, None), every, False)]


def _scores(q, k, scale, diagonal):
    s = torch.matmul(q, k.transpose(-2, -1)).mul_(scale)
    if diagonal:
        n, m = s.shape[-2:]
        s.masked_fill_(torch.ones(n, m, dtype=torch.bool, device=s.device).triu_(1),
                       float("-inf"))
    return s


# torch's fused CPU attention kernel returns the log-sum-exp a block needs, and its backward
# takes the final output and log-sum-exp, which is exactly a block's share of the gradients;
# elsewhere the blocks are computed here with matmuls (the same math, S/cp x S/cp scores).
_CPU_FLASH, _CPU_FLASH_BACKWARD = _torch.cpu_flash_attention()
use_fused_kernel = True  # tests switch it off to check the matmul blocks on CPU too


def _fused(t: torch.Tensor) -> bool:
    return (use_fused_kernel and t.device.type == "cpu" and _CPU_FLASH is not None
            and t.dtype in (torch.float32, torch.float64))


def _block_forward(q, k, v, scale, diagonal):
    if _fused(q):
        return _CPU_FLASH(q, k, v, 0.0, diagonal, scale=scale)
    s = _scores(q, k, scale, diagonal)
    lse = torch.logsumexp(s, dim=-1)
    return torch.matmul(s.sub_(lse.unsqueeze(-1)).exp_(), v), lse


def _merge_(out, lse, block_out, block_lse) -> None:
    """In place on views of the running (out, lse): add a block's softmax-weighted share."""
    new = torch.logaddexp(lse, block_lse)
    out.mul_((lse - new).exp_().unsqueeze(-1)).add_(block_out * (block_lse - new).exp_()
                                                    .unsqueeze(-1))
    lse.copy_(new)


def _block_backward(dout, q, k, v, out, lse, delta, scale, diagonal):
    if _fused(q):
        return _CPU_FLASH_BACKWARD(dout, q, k, v, out, lse, 0.0, diagonal, scale=scale)
    p = _scores(q, k, scale, diagonal).sub_(lse.unsqueeze(-1)).exp_()
    dv = torch.matmul(p.transpose(-2, -1), dout)
    ds = p.mul_(torch.matmul(dout, v.transpose(-2, -1)).sub_(delta.unsqueeze(-1)))
    return torch.matmul(ds, k).mul_(scale), torch.matmul(ds.transpose(-2, -1), q).mul_(scale), dv


class _Ring:
    """The ring's neighbours in global ranks, and one shift: send to r+1, receive from r-1."""

    def __init__(self, group):
        self.group = group
        self.size = dist.get_world_size(group)
        self.rank = dist.get_rank(group)
        self.next = dist.get_global_rank(group, (self.rank + 1) % self.size) \
            if group is not None else (self.rank + 1) % self.size
        self.prev = dist.get_global_rank(group, (self.rank - 1) % self.size) \
            if group is not None else (self.rank - 1) % self.size

    def shift(self, send: torch.Tensor, tag: int):
        """Start passing ``send`` on; returns (receive buffer, works): wait before reading."""
        recv = torch.empty_like(send)
        ops = [dist.P2POp(dist.isend, send, self.next, self.group, tag),
               dist.P2POp(dist.irecv, recv, self.prev, self.group, tag)]
        return recv, [launched(w) for w in dist.batch_isend_irecv(ops)]


def _wait_all(works) -> None:
    for w in works:
        wait(w)


class _RingAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, group, causal, layout, scale):
        acc = _acc_dtype(q.dtype)
        ring = _Ring(group) if dist.is_initialized() else None
        cp = ring.size if ring else 1
        rank = ring.rank if ring else 0
        qa = q.to(acc)
        out = torch.zeros_like(qa)
        lse = torch.full(q.shape[:-1], float("-inf"), dtype=acc, device=q.device)
        kv = torch.stack([k, v])  # one message per step
        for i in range(cp):
            if i + 1 < cp:
                incoming, works = ring.shift(kv, KV_TAG)
            for rows, cols, diagonal in _blocks(rank, (rank - i) % cp, causal, layout,
                                                q.shape[2]):
                o, block_lse = _block_forward(qa[:, :, rows], kv[0][:, :, cols].to(acc),
                                      kv[1][:, :, cols].to(acc), scale, diagonal)
                _merge_(out[:, :, rows], lse[:, :, rows], o, block_lse)
            if i + 1 < cp:
                _wait_all(works)
                kv = incoming
        out = out.to(q.dtype)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.group, ctx.causal, ctx.layout, ctx.scale = group, causal, layout, scale
        return out

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse = ctx.saved_tensors
        acc = _acc_dtype(q.dtype)
        ring = _Ring(ctx.group) if dist.is_initialized() else None
        cp = ring.size if ring else 1
        rank = ring.rank if ring else 0
        qa, da = q.to(acc), dout.to(acc).contiguous()
        oa = out.to(acc)
        delta = None if _fused(qa) else (da * oa).sum(-1)  # the fused kernel makes its own
        dq = torch.zeros_like(qa)
        kv = torch.stack([k, v])
        dkv_in, dkv_works, mine = None, [], None
        sending = None  # the accumulator in flight: alive until its send is waited
        for i in range(cp):
            if i + 1 < cp:
                incoming, works = ring.shift(kv, KV_TAG)
            dkv = torch.zeros(kv.shape, dtype=acc, device=kv.device)  # for the keys held now
            for rows, cols, diagonal in _blocks(rank, (rank - i) % cp, ctx.causal, ctx.layout,
                                                q.shape[2]):
                dq_b, dk_b, dv_b = _block_backward(
                    da[:, :, rows], qa[:, :, rows], kv[0][:, :, cols].to(acc),
                    kv[1][:, :, cols].to(acc), oa[:, :, rows], lse[:, :, rows],
                    None if delta is None else delta[:, :, rows], ctx.scale, diagonal)
                dq[:, :, rows] += dq_b
                dkv[0][:, :, cols] += dk_b
                dkv[1][:, :, cols] += dv_b
            if dkv_in is not None:  # what the ranks before us added for these keys
                _wait_all(dkv_works)
                dkv += dkv_in
            if ring is None or cp == 1:
                mine = dkv
            else:  # on to the next rank; after step cp-1 that is the keys' owner
                sending = dkv
                dkv_in, dkv_works = ring.shift(sending, DKV_TAG)
            if i + 1 < cp:
                _wait_all(works)
                kv = incoming
        if mine is None:
            _wait_all(dkv_works)
            mine, sending = dkv_in, None
        return (dq.to(q.dtype), mine[0].to(k.dtype), mine[1].to(v.dtype), None, None, None,
                None)
