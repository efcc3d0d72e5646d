"""Where a rank's local parameter sits in the global (unsharded) tensor.

Strategies change what a rank holds of a parameter, but never its name:

- tensor parallelism (`parallelize`) keeps a shard along one dim, possibly in several fused
  blocks (``qkv``: ``[q_r; k_r; v_r]``) and with vocabulary padding (recorded on the parameter
  as ``_meshrun_tp_spec`` and ``_meshrun_tp_group``);
- `fully_shard` then keeps ``torch.chunk`` rows of dim 0 of *that* local tensor
  (``_fsdp_unit``);
- ``ddp`` and pipeline stages keep whole tensors (replicated, or held by one stage only).

`pieces(param)` composes those into a list of `Piece` s: each a rectangular block of the
local tensor and the block of the global tensor it holds. That list is all a resharding
checkpoint needs (`meshrun.parallel.checkpoint` writes and reads blocks by global offset), and
`sharded_over(param)` (the groups a parameter is cut over) is all a global gradient norm
needs. The idea is DCP's chunk metadata (``ChunkStorageMetadata``: offsets and sizes in the
global tensor), generalised to the several blocks per rank that fused TP shards produce.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist


@dataclass(frozen=True)
class Piece:
    """One block: ``local[index]`` is ``global[offsets[d]:offsets[d] + sizes[d], ...]``.

    ``index`` is a tuple of slices, one per dim of the local tensor; ``offsets`` and ``sizes``
    are in elements of the global tensor, one per dim.
    """

    index: tuple[slice, ...]
    offsets: tuple[int, ...]
    sizes: tuple[int, ...]

    def view(self, local: torch.Tensor) -> torch.Tensor:
        """The block of ``local`` (a view, shape ``sizes``)."""
        return local[self.index]

    @property
    def region(self) -> tuple[slice, ...]:
        """Where the block sits in the global tensor: ``global[region]`` has shape ``sizes``."""
        return tuple(slice(o, o + n) for o, n in zip(self.offsets, self.sizes, strict=True))


def global_shape(param: torch.Tensor) -> torch.Size:
    """The unsharded shape of ``param`` (its own shape when no strategy cut it)."""
    spec = getattr(param, "_meshrun_tp_spec", None)
    shape = list(_pre_fsdp_shape(param))
    if spec is not None:
        shape[spec.dim] = spec.size
    return torch.Size(shape)


def pieces(param: torch.Tensor) -> list[Piece]:
    """The blocks of the global tensor that this rank's ``param`` holds (empty ones dropped).

    Raises:
        ValueError: a parameter whose local shape does not match what its strategies recorded
            (it was replaced after sharding).
    """
    shape = _pre_fsdp_shape(param)
    blocks = _tp_pieces(param, shape)
    unit = getattr(param, "_fsdp_unit", None)
    if unit is not None:
        blocks = _narrow_dim0(blocks, *_fsdp_rows(param, unit))
    expected = tuple(param.shape)
    for b in blocks:
        got = tuple(len(range(*s.indices(n))) for s, n in zip(b.index, expected, strict=True))
        if got != b.sizes:
            raise ValueError(f"layout: a block of a parameter of shape {expected} has "
                             f"{got} elements, {b.sizes} expected")
    return [b for b in blocks if all(b.sizes)]


def sharded_over(param: torch.Tensor) -> list[dist.ProcessGroup | None]:
    """The process groups ``param`` is cut over (TP, then FSDP); ``None`` is the world."""
    groups = []
    if getattr(param, "_meshrun_tp_spec", None) is not None:
        groups.append(param._meshrun_tp_group)
    unit = getattr(param, "_fsdp_unit", None)
    if unit is not None:
        groups.append(unit.group)
    return groups


# -- helpers ----------------------------------------------------------------------------------


def _pre_fsdp_shape(param: torch.Tensor) -> torch.Size:
    """The shape before `fully_shard` cut dim 0 (the TP-local shape under TP)."""
    unit = getattr(param, "_fsdp_unit", None)
    if unit is None:
        return param.shape
    return unit.layout.slots[_index_in(unit, param)].shape


def _index_in(unit, param) -> int:
    return next(i for i, p in enumerate(unit.params) if p is param)


def _fsdp_rows(param, unit) -> tuple[int, int]:
    """[start, stop) of dim 0 of the pre-FSDP tensor that this rank's shard holds."""
    slot = unit.layout.slots[_index_in(unit, param)]
    start = min(unit.rank * slot.rows, slot.shape[0])
    return start, start + slot.rows_of(unit.rank)


def _tp_pieces(param, shape: torch.Size) -> list[Piece]:
    """Blocks of the TP-local tensor (shape ``shape``) in the global tensor."""
    full = tuple(slice(0, n) for n in shape)
    spec = getattr(param, "_meshrun_tp_spec", None)
    if spec is None:
        return [Piece(full, (0,) * len(shape), tuple(shape))]
    group = param._meshrun_tp_group
    tp_size, tp_rank = dist.get_world_size(group), dist.get_rank(group)
    n = spec.padded // (tp_size * spec.chunks)  # rows per chunk per rank
    per_chunk = spec.padded // spec.chunks
    blocks = []
    for k in range(spec.chunks):
        start = k * per_chunk + tp_rank * n
        rows = max(0, min(n, spec.size - start))  # padding rows hold nothing global
        index, offsets, sizes = list(full), [0] * len(shape), list(shape)
        index[spec.dim] = slice(k * n, k * n + rows)
        offsets[spec.dim], sizes[spec.dim] = min(start, spec.size), rows
        blocks.append(Piece(tuple(index), tuple(offsets), tuple(sizes)))
    return blocks


def _narrow_dim0(blocks: list[Piece], start: int, stop: int) -> list[Piece]:
    """Keep rows [start, stop) of dim 0 of the local tensor, renumbered from 0."""
    out = []
    for b in blocks:
        lo, hi = max(b.index[0].start, start), min(b.index[0].stop, stop)
        rows = max(0, hi - lo)
        shift = lo - b.index[0].start  # rows of the block dropped at its top
        index = (slice(lo - start, lo - start + rows), *b.index[1:])
        offsets = (b.offsets[0] + shift, *b.offsets[1:]) if rows else b.offsets
        out.append(Piece(index, offsets, (rows, *b.sizes[1:])))
    return out
