"""Sequence layouts for context parallelism: which tokens of a sequence each CP rank holds.

Two layouts of a sequence of ``S`` tokens over ``cp`` ranks:

- ``"contiguous"``: rank r holds tokens ``[r S/cp, (r+1) S/cp)``. Under a causal mask rank
  cp-1 attends to the whole sequence and rank 0 only to its own slice: the ring's work is
  unbalanced (the last rank computes about 2cp-1 times the first rank's blocks).
- ``"zigzag"``: the sequence is cut into ``2 cp`` chunks and rank r holds chunks ``r`` and
  ``2cp-1-r``, in that order (an early chunk and its mirror image), so every rank computes
  the same number of unmasked blocks under a causal mask (Megatron-LM's context parallel;
  Brandon et al., "Striped Attention", 2023, balance by striping tokens instead).

A rank's local tokens are always in increasing position order, so a causal mask on the local
indices of one rank's own block is the causal mask on positions. `position_ids` gives the
global positions (for position embeddings / RoPE); `shard_sequence` and `unshard_sequence` move
between the full sequence and the per-rank shards.
"""

from __future__ import annotations

import torch

LAYOUTS = ("zigzag", "contiguous")


def check_layout(layout: str, seq_len: int, cp: int, *, what: str = "sequence",
                 detail: str = "") -> None:
    """Raise ValueError unless ``layout`` is known and splits ``seq_len`` tokens over ``cp``
    ranks (zigzag: ``seq_len`` a multiple of 2 cp; contiguous: of cp)."""
    if layout not in LAYOUTS:
        raise ValueError(f"context parallel: unknown layout {layout!r}; use one of "
                         f"{', '.join(LAYOUTS)}")
    parts = n_chunks(layout, cp)
    if seq_len % parts:
        raise ValueError(
            f"context parallel: a {what} of {seq_len} tokens{detail} cannot be split in the "
            f"{layout} layout over {cp} ranks ({parts} equal chunks); use a length that is a "
            f"multiple of {parts} (pad the sequence){_other_layout_hint(layout, seq_len, cp)}")


def n_chunks(layout: str, cp: int) -> int:
    """Equal chunks the sequence is cut into: 2 cp (zigzag) or cp (contiguous)."""
    return 2 * cp if layout == "zigzag" else cp


def chunks_of(rank: int, cp: int, layout: str) -> tuple[int, ...]:
    """The chunk indices rank ``rank`` holds, in local order: ``(r, 2cp-1-r)`` or ``(r,)``."""
    return (rank, 2 * cp - 1 - rank) if layout == "zigzag" else (rank,)


def shard_sequence(x: torch.Tensor, rank: int, cp: int, layout: str = "zigzag", *,
                   dim: int = 1) -> torch.Tensor:
    """This rank's shard of the full sequence ``x`` along ``dim`` (``S`` -> ``S / cp`` tokens).

    ``x``: e.g. token ids ``(batch, S)`` (``dim=1``) or ``(batch, heads, S, head_dim)``
    (``dim=2``). Returns a new tensor (the zigzag shard is two slices concatenated).

    Raises:
        ValueError: an unknown layout, a rank outside ``[0, cp)``, or ``S`` the layout cannot
            split (see `check_layout`).
    """
    if not 0 <= rank < cp:
        raise ValueError(f"shard_sequence: rank {rank} is outside [0, {cp})")
    check_layout(layout, x.shape[dim], cp)
    pieces = x.chunk(n_chunks(layout, cp), dim=dim)
    return torch.cat([pieces[c] for c in chunks_of(rank, cp, layout)], dim=dim)


def unshard_sequence(shards: list[torch.Tensor], layout: str = "zigzag", *,
                     dim: int = 1) -> torch.Tensor:
    """The full sequence from every rank's shard (``shards[r]`` is rank r's), the inverse of
    `shard_sequence`. Raises ValueError for an unknown layout or shards of odd length
    (zigzag)."""
    cp = len(shards)
    check_layout(layout, sum(s.shape[dim] for s in shards), cp)
    full: list[torch.Tensor | None] = [None] * n_chunks(layout, cp)
    for rank, shard in enumerate(shards):
        check_layout(layout, shard.shape[dim] * cp, cp, what=f"rank {rank}'s shard x {cp}")
        for c, piece in zip(chunks_of(rank, cp, layout),
                            shard.chunk(len(chunks_of(rank, cp, layout)), dim=dim), strict=True):
            full[c] = piece
    return torch.cat(full, dim=dim)


def position_ids(seq_len: int, rank: int, cp: int, layout: str = "zigzag", *,
                 device: torch.device | str | None = None) -> torch.Tensor:
    """The global positions (``int64``, ``seq_len / cp`` of them) of the tokens this rank
    holds: ``shard_sequence(arange(seq_len), rank, cp, layout, dim=0)``."""
    return shard_sequence(torch.arange(seq_len, device=device), rank, cp, layout, dim=0)


def _other_layout_hint(layout: str, seq_len: int, cp: int) -> str:
    if layout == "zigzag" and seq_len % cp == 0:
        return ", or layout='contiguous' (a multiple of cp)"
    return ""
