"""Catch data that was never sharded: every data-parallel rank training on the same batches.

Nothing fails when a script forgets its ``DistributedSampler`` (or builds one without the
rank), or never calls ``set_epoch``: every rank trains on the same data, or every epoch repeats
the same order, the effective batch is smaller than the user thinks, and compute is wasted.
Two cheap checks say so, once each, as one warning line:

- `check_first_input`: at the first forward of a `ddp` model, the ranks of its data-parallel
  group compare a fingerprint of the forward's tensor arguments (one small all-gather, once).
  Identical inputs on every rank of the group get a warning naming ``DistributedSampler``.
  Only the data-parallel group is compared: tensor- and context-parallel peers share their
  inputs by design.
- `watch_set_epoch` (armed by ``meshrun.parallel.init()``): a ``DistributedSampler`` with
  ``shuffle=True`` iterated a second time at the same epoch (``set_epoch`` never called: the
  same order every epoch) gets a warning naming ``set_epoch``.

``MESHRUN_DATA_CHECK=0`` switches both off. The idea of the first is DeepSpeed's and torchtitan's
"same data on every rank" sanity checks, made one all-gather; the second wraps
``DistributedSampler.__iter__`` (the only place the mistake shows) and changes nothing it yields.
"""

from __future__ import annotations

import hashlib
import os
import sys

import torch
import torch.distributed as dist

from meshrun.parallel._comm import ALL_GATHER

#: Bytes of each tensor argument that go into the fingerprint (the head of its storage).
FINGERPRINT_BYTES = 1 << 20
_warned: set[str] = set()


def enabled() -> bool:
    """False when ``MESHRUN_DATA_CHECK=0`` (or "false", "no", "off")."""
    return os.environ.get("MESHRUN_DATA_CHECK", "1").strip().lower() not in ("0", "false", "no", "off")


def check_first_input(args: tuple, group, device: torch.device) -> None:
    """Compare the fingerprint of ``args`` (the first forward's positional arguments) across
    ``group``; warn once when every rank's is the same. A collective: every rank of the group
    calls it at the same forward. Arguments without a tensor of two or more elements compare
    nothing (no warning)."""
    if not enabled() or dist.get_world_size(group) < 2:
        return
    digest = fingerprint(args)
    mine = torch.tensor([digest, 1 if digest else 0], dtype=torch.int64, device=device)
    every = torch.empty(dist.get_world_size(group) * 2, dtype=torch.int64, device=device)
    getattr(dist, ALL_GATHER)(every, mine, group=group)  # torch 2.13's name or the old one
    pairs = every.view(-1, 2).tolist()
    if all(has for _, has in pairs) and len({d for d, _ in pairs}) == 1:
        if dist.get_rank(group) == 0:
            _warn_once(
                "same-input",
                f"every rank of the data-parallel group ({len(pairs)} ranks) got the same "
                "first batch, so each trains on the same data: shard it by the data-parallel "
                "rank (torch.utils.data.DistributedSampler(dataset, num_replicas=dp_size, "
                "rank=dp_rank), or meshrun.parallel's mesh ranks); MESHRUN_DATA_CHECK=0 "
                "switches this check off",
            )


def fingerprint(args) -> int:
    """A 63-bit hash of the tensors in ``args`` (nested lists, tuples and dicts): shapes,
    dtypes and the first `FINGERPRINT_BYTES` of each; 0 when there is no tensor of two or
    more elements."""
    h = hashlib.blake2b(digest_size=8)
    found = False
    for t in _tensors(args):
        if t.numel() < 2:
            continue
        found = True
        h.update(repr((tuple(t.shape), str(t.dtype))).encode())
        flat = t.detach().reshape(-1)
        n = max(1, FINGERPRINT_BYTES // max(1, flat.element_size()))
        head = flat[:n].contiguous().cpu()
        h.update(head.view(torch.uint8).numpy().tobytes() if head.dtype != torch.bool
                 else head.numpy().tobytes())  # fmt: skip
    if not found:
        return 0
    return int.from_bytes(h.digest(), "little") & ((1 << 63) - 1) or 1


def watch_set_epoch() -> None:
    """Wrap ``DistributedSampler.__iter__`` so that a shuffling sampler iterated twice at the
    same epoch warns once (``set_epoch`` was not called). Idempotent; a no-op when the check is
    off."""
    if not enabled():
        return
    from torch.utils.data.distributed import DistributedSampler

    if getattr(DistributedSampler.__iter__, "_meshrun_watch", False):
        return
    original = DistributedSampler.__iter__

    def __iter__(self):
        if getattr(self, "shuffle", False):
            seen = self.__dict__.setdefault("_meshrun_epochs_iterated", set())
            if self.epoch in seen and getattr(self, "rank", 0) == 0:  # one line per job
                _warn_once(
                    "set-epoch",
                    f"a DistributedSampler with shuffle=True was iterated again at epoch "
                    f"{self.epoch}: every epoch repeats the same order; call "
                    "sampler.set_epoch(epoch) before each epoch",
                )
            seen.add(self.epoch)
        return original(self)

    __iter__._meshrun_watch = True  # type: ignore[attr-defined]
    DistributedSampler.__iter__ = __iter__


def _tensors(value):
    if isinstance(value, torch.Tensor):
        yield value
    elif isinstance(value, (list, tuple)):
        for v in value:
            yield from _tensors(v)
    elif isinstance(value, dict):
        for v in value.values():
            yield from _tensors(v)


def _warn_once(key: str, message: str) -> None:
    if key in _warned:
        return
    _warned.add(key)
    print(f"meshrun.parallel: warning: {message}", file=sys.stderr, flush=True)
