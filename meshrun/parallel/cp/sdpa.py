"""`context_parallel_attention`: route ``F.scaled_dot_product_attention`` to CP attention.

For a model that calls SDPA itself and cannot be edited: inside the ``with`` block every call
of ``torch.nn.functional.scaled_dot_product_attention`` (looked up at call time, as
``F.scaled_dot_product_attention(...)`` is) runs `ring_attention` or `ulysses_attention` over
the group instead, its ``is_causal`` becoming ``causal``. torch's experimental
``context_parallel`` does the same by dispatching SDPA on DTensor (CUDA kernels only); this
swaps the function, so it is not thread-safe and does not reach code that bound SDPA to
another name before the block.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch.distributed as dist
import torch.nn.functional as F

from meshrun.parallel.cp.ring import ring_attention
from meshrun.parallel.cp.ulysses import ulysses_attention

MODES = {"ring": ring_attention, "ulysses": ulysses_attention}


@contextlib.contextmanager
def context_parallel_attention(group: dist.ProcessGroup | None = None, *, mode: str = "ring",
                               layout: str = "zigzag") -> Iterator[None]:
    """Inside the block, SDPA calls on sequence shards ``(batch, heads, S / cp, head_dim)``
    in ``layout`` are ``mode`` attention over ``group`` (``"ring"`` or ``"ulysses"``).

    Raises:
        ValueError: an unknown ``mode`` (at entry); inside, what the chosen attention raises
            (an ``attn_mask``: use ``is_causal=True``; ``enable_gqa``: repeat the key/value
            heads first).
    """
    if mode not in MODES:
        raise ValueError(f"context_parallel_attention: unknown mode {mode!r}; use "
                         f"{' or '.join(MODES)}")
    attention, original = MODES[mode], F.scaled_dot_product_attention

    def routed(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None,
               enable_gqa=False):
        if enable_gqa:
            raise ValueError("context_parallel_attention: enable_gqa is not supported; repeat "
                             "the key/value heads to the query's head count first")
        return attention(query, key, value, group, causal=is_causal, layout=layout,
                         scale=scale, attn_mask=attn_mask, dropout_p=dropout_p)

    F.scaled_dot_product_attention = routed
    try:
        yield
    finally:
        F.scaled_dot_product_attention = original
