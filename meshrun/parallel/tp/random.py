"""`RNGTracker`: random streams for dropout under tensor parallelism (Megatron's RNG tracker).

Under tensor parallelism some activations are replicated on every rank of the TP group (the
residual stream without sequence parallelism) and some are sharded (the hidden units between
a column- and a row-parallel layer, attention heads, the sequence shard under sequence
parallelism). Dropout must then draw:

- on replicated activations, the *same* mask on every rank, or the replicas diverge: the
  default generator, seeded identically on every TP rank (``torch.manual_seed(seed)``);
- on sharded activations, *independent* masks per rank, or each rank's shard repeats the same
  pattern and the model's noise depends on the TP degree: a second stream seeded with
  ``seed + 2718 + tp_rank`` (Megatron's offset), entered with `RNGTracker.fork`.

``fork()`` swaps the per-rank stream's state into the default generator (CPU, and the current
CUDA device when present) and swaps it back out on exit, so code inside draws from the
per-rank stream and the default stream is exactly where it was before. Mirrors Megatron-LM's
``CudaRNGStatesTracker`` (``tensor_parallel/random.py``), for CPU and CUDA.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
import torch.distributed as dist

from meshrun.parallel._comm import group_device

MODEL_PARALLEL_SEED_OFFSET = 2718  # Megatron's offset of the tensor-parallel stream


class RNGTracker:
    """A per-TP-rank random stream beside the default (replicated) one.

    Args:
        group: the tensor-parallel process group (the stream is seeded by rank in it).
        seed: base seed; default: ``torch.initial_seed()`` of TP rank 0, broadcast over the
            group (one 8-byte broadcast), so every rank derives from the same base.

    The per-rank seed is ``seed + 2718 + rank_in_group``.
    """

    def __init__(self, group: dist.ProcessGroup | None = None, seed: int | None = None):
        self.group = group
        self.rank = dist.get_rank(group)
        if seed is None:
            base = torch.tensor([torch.initial_seed() % 2**62], dtype=torch.int64,
                                device=group_device(group))
            dist.broadcast(base, group=group, group_src=0)
            seed = int(base.item())
        self.seed = seed + MODEL_PARALLEL_SEED_OFFSET + self.rank
        self._cuda = torch.cuda.is_available()
        with torch.random.fork_rng(devices=self._devices()):
            torch.manual_seed(self.seed)
            self._state = self._get()

    @contextlib.contextmanager
    def fork(self) -> Iterator[None]:
        """Draw from this rank's stream inside the block; the default stream is untouched."""
        outer = self._get()
        self._set(self._state)
        try:
            yield
        finally:
            self._state = self._get()
            self._set(outer)

    def get_state(self):
        """The stream's state (a copy), for `set_state`: activation checkpointing replays the
        stream in the recompute (Megatron's ``CudaRNGStatesTracker.get_states``)."""
        cpu, cuda = self._state
        return cpu.clone(), None if cuda is None else cuda.clone()

    def set_state(self, state) -> None:
        """Make the stream continue from ``state`` (from `get_state`)."""
        cpu, cuda = state
        self._state = (cpu.clone(), None if cuda is None else cuda.clone())

    def _devices(self):
        return [torch.cuda.current_device()] if self._cuda else []

    def _get(self):
        cuda = torch.cuda.get_rng_state() if self._cuda else None
        return torch.get_rng_state(), cuda

    def _set(self, state) -> None:
        cpu, cuda = state
        torch.set_rng_state(cpu)
        if cuda is not None:
            torch.cuda.set_rng_state(cuda)
