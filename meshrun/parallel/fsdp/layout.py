"""Per-parameter dim-0 sharding of one unit, and the two collectives that move it.

Each parameter of shape ``(d0, *rest)`` is cut on dim 0 the way ``torch.chunk`` cuts it:
every rank owns ``c = ceil(d0 / N)`` rows, rank ``r`` rows ``[r*c, min((r+1)*c, d0))``, so the
last ranks may own fewer rows, or none. A rank's *shard* of the unit is one flat buffer that
holds, parameter after parameter, its rows padded to ``c`` rows::

    shard (rank r):  [ p0 rows of r | pad ][ p1 rows of r | pad ] ...   (shard_numel elements)

All ranks' shards have the same length, so the unit moves with one
``all_gather_into_tensor`` (output ``[N, shard_numel]``: row r is rank r's shard) and one
``reduce_scatter_tensor`` (input ``[N, shard_numel]`` packed the same way). `unpack` copies the
gathered rows into unpadded full parameters; `pack` is its inverse for gradients. The padding
never leaves this file: users see parameters of their true local shape ``(rows_r, *rest)``.
This is FSDP2's per-parameter sharding (torch ``distributed/fsdp/_fully_shard/_fsdp_param.py``),
and DTensor's ``Shard(0)`` layout, so a local shard is a valid ``DTensor`` local tensor.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Slot:
    """Where one parameter lives in a rank's shard."""

    shape: torch.Size  # unsharded shape (d0, *rest)
    rows: int  # rows per rank, padded: ceil(d0 / N)
    row_numel: int  # elements per row: prod(rest)
    offset: int  # element offset of this parameter's padded chunk in a shard

    @property
    def chunk_numel(self) -> int:
        return self.rows * self.row_numel

    def rows_of(self, rank: int) -> int:
        """Unpadded rows that ``rank`` owns (0 for trailing ranks when d0 < N * rows)."""
        return max(0, min(self.rows, self.shape[0] - rank * self.rows))


class ShardLayout:
    """The shard layout of a list of parameter shapes over ``world_size`` ranks.

    Args:
        shapes: unsharded shapes, each with at least one dim.
        world_size: N, the number of ranks sharing the unit.
        rank: this rank's index in the group.

    Raises:
        ValueError: a 0-dim shape (nothing to cut on dim 0).
    """

    def __init__(self, shapes: list[torch.Size], world_size: int, rank: int):
        self.world_size, self.rank = world_size, rank
        self.slots: list[Slot] = []
        offset = 0
        for shape in shapes:
            if len(shape) == 0:
                raise ValueError("0-dim parameters cannot be sharded on dim 0")
            rows = math.ceil(shape[0] / world_size)
            slot = Slot(torch.Size(shape), rows, math.prod(shape[1:]), offset)
            self.slots.append(slot)
            offset += slot.chunk_numel
        self.shard_numel = offset

    def local_shape(self, i: int) -> torch.Size:
        slot = self.slots[i]
        return torch.Size((slot.rows_of(self.rank), *slot.shape[1:]))

    def local_view(self, shard: torch.Tensor, i: int) -> torch.Tensor:
        """Parameter i's unpadded rows in ``shard`` (a view, shape `local_shape(i)`)."""
        slot = self.slots[i]
        shape = self.local_shape(i)
        return shard[slot.offset:slot.offset + shape.numel()].view(shape)

    def shard(self, full: list[torch.Tensor], out: torch.Tensor) -> None:
        """Copy this rank's rows of each full parameter into ``out`` (``[shard_numel]``)."""
        for slot, t in zip(self.slots, full, strict=True):
            n = slot.rows_of(self.rank) * slot.row_numel
            start = self.rank * slot.chunk_numel
            out[slot.offset:slot.offset + n].copy_(t.reshape(-1)[start:start + n])

    def unpack(self, gathered: torch.Tensor, full: list[torch.Tensor]) -> None:
        """All-gather output ``[N * shard_numel]`` -> full parameters (copied, padding dropped)."""
        rows = gathered.view(self.world_size, self.shard_numel)
        for slot, t in zip(self.slots, full, strict=True):
            flat = t.view(-1)
            for r in range(self.world_size):
                n = slot.rows_of(r) * slot.row_numel
                if n:
                    flat[r * slot.chunk_numel:r * slot.chunk_numel + n].copy_(
                        rows[r, slot.offset:slot.offset + n])

    def pack(self, full: list[torch.Tensor | None], packed: torch.Tensor) -> None:
        """Add full gradients into a reduce-scatter input ``[N * shard_numel]`` (None: skip).

        Adds, so a buffer carried over from steps without sync accumulates; a fresh buffer must
        be zeros (the padding then stays zero)."""
        rows = packed.view(self.world_size, self.shard_numel)
        for slot, t in zip(self.slots, full, strict=True):
            if t is None:
                continue
            flat = t.reshape(-1)
            for r in range(self.world_size):
                n = slot.rows_of(r) * slot.row_numel
                if n:
                    rows[r, slot.offset:slot.offset + n].add_(
                        flat[r * slot.chunk_numel:r * slot.chunk_numel + n])
